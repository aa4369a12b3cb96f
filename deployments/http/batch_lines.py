"""A batch's lines in the ingress: checked up front as the route would check them
(:func:`validate_lines`), and the output or error line each finished job becomes
(:func:`result_line`), in OpenAI's shapes
(https://platform.openai.com/docs/guides/batch: ``{id, custom_id, response: {status_code,
request_id, body}, error}``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from deployments.http.http_errors import validation_error
from deployments.http.jobs_http import JobsRoutes
from serve_app.batches.files import FileStore
from serve_app.batches.models import Batch, BatchError, BatchLine
from serve_app.errors import InvalidRequestError, ServeAppError
from serve_app.jobs.view import JobStatus, JobView

MAX_ERRORS = 100
"""The most line errors one failed batch lists (the first ones, in file order)."""
LINE_ERRORS = frozenset({"model_not_found"})
"""Refusals of a well-formed line that make it an error line rather than fail the batch
(its ``model`` is not served here), as a ``url`` other than the batch's endpoint does."""


@dataclass
class CheckedLines:
    """What :func:`validate_lines` found: the valid lines (``{"custom_id", "body"}`` JSON,
    in file order) and the errors (empty when every line is valid)."""

    lines: list[str] = field(default_factory=list)
    errors: list[BatchError] = field(default_factory=list)

    def refuse(self, number: int, error: ServeAppError, param: str | None = None) -> None:
        """Line ``number`` is malformed: it fails the batch."""
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(BatchError(code=error.code, message=error.message,
                                          line=number, param=param))

    def fail_line(self, custom_id: str, error: ServeAppError) -> None:
        """The line is well formed but not for this batch (another ``url``, a ``model`` not
        served): it becomes an error line and the batch runs the others."""
        self.lines.append(json.dumps({"custom_id": custom_id, "error": {
            "code": error.code, "message": error.message}}, separators=(",", ":")))


async def validate_lines(batch: Batch, files: FileStore, jobs: JobsRoutes) -> CheckedLines:
    """Check every line of the batch's input file: its fields (:class:`BatchLine`, unknown
    ones refused), ``custom_id`` unique, and its body validated, tokenized and priced exactly
    as a job on that route (:meth:`JobsRoutes.parsed`,
    :meth:`~deployments.http.jobs_http.JobsFront.price`): the same error codes; any of these
    wrong fails the batch. A line whose ``url`` is not the batch's endpoint, or whose
    ``model`` no model here serves (:data:`LINE_ERRORS`), is kept as an error line instead."""
    checked, seen = CheckedLines(), set()
    async for number, raw in files.lines(batch.input_file_id):
        if number % 100 == 0:
            await asyncio.sleep(0)  # tokenizing thousands of lines: let requests through
        try:
            line = BatchLine.model_validate_json(raw)
        except ValidationError as exc:
            error = validation_error(exc.errors())
            checked.refuse(number, error, error.code)
            continue
        if line.custom_id in seen:
            checked.refuse(number, InvalidRequestError(
                f"custom_id {line.custom_id!r} appears on an earlier line",
                code="duplicate_custom_id"), "custom_id")
        elif line.url != batch.endpoint:
            checked.fail_line(line.custom_id, InvalidRequestError(
                f"url {line.url!r} is not the batch's endpoint {batch.endpoint!r}",
                code="invalid_url"))
        elif (refusal := await _refusal(jobs, line)) is not None:
            if refusal.code in LINE_ERRORS:
                checked.fail_line(line.custom_id, refusal)
            else:
                checked.refuse(number, refusal, refusal.code)
        else:
            checked.lines.append(json.dumps({"custom_id": line.custom_id, "body": line.body},
                                            separators=(",", ":")))
        seen.add(line.custom_id)
    return checked


async def _refusal(jobs: JobsRoutes, line: BatchLine) -> ServeAppError | None:
    """What a job of ``line`` would be refused with now, else ``None``."""
    try:
        route, body = jobs.parsed(line.url, line.body)
        await route.context.jobs.price(await route.prepare(body, line.custom_id))
    except ValidationError as exc:
        return validation_error(exc.errors())
    except ServeAppError as exc:
        return exc
    return None


def line_key(batch_id: str, custom_id: str) -> str:
    """The Idempotency-Key of a line's job, ``batch:{batch_id}:{custom_id}``, so a line is
    one job whoever submits it and however often; a ``custom_id`` that is not short visible
    ASCII is named by its sha256 instead."""
    if len(custom_id) <= 200 and custom_id.isascii() and custom_id.isprintable() \
            and " " not in custom_id:
        return f"batch:{batch_id}:{custom_id}"
    return f"batch:{batch_id}:sha256:{hashlib.sha256(custom_id.encode()).hexdigest()}"


def result_line(custom_id: str, job: JobView | None) -> tuple[dict[str, Any], bool] | None:
    """The output line (``failed`` False) or error line (True) of a line whose job is
    ``job`` (``None``: the job is gone, its result expired); ``None`` while it is queued or
    running."""
    if job is None:
        return error_line(custom_id, "job_lost", "the line's job and its result expired "
                          "before they were collected"), True
    if job.status is JobStatus.SUCCEEDED:
        return {"id": _line_id(), "custom_id": custom_id, "error": None,
                "response": {"status_code": 200, "request_id": job.id,
                             "body": json.loads(job.result_json or "null")}}, False
    if job.status is JobStatus.FAILED:
        body = json.loads(job.error_json or "{}")
        error = body.get("error") or {}
        return {"id": _line_id(), "custom_id": custom_id,
                "response": {"status_code": job.status_code, "request_id": job.id,
                             "body": body},
                "error": {"code": error.get("code"), "message": error.get("message")}}, True
    if job.status is JobStatus.CANCELLED:
        return error_line(custom_id, "batch_cancelled", "the batch was cancelled before "
                          "this line ran"), True
    return None


def unrun_line(line: dict[str, Any], code: str, message: str) -> dict[str, Any]:
    """The error line of a stored ``line`` that will not run: its own error when validation
    made it an error line, else ``code`` and ``message`` (cancelled, expired, refused)."""
    error = line.get("error") or {"code": code, "message": message}
    return error_line(line["custom_id"], error["code"], error["message"])


def error_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """An error line of a line that got no response (cancelled, expired, lost)."""
    return {"id": _line_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex[:24]}"
