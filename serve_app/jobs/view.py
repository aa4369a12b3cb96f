"""What a job looks like to its readers: :class:`JobView`, decoded from a store reply."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any


class JobStatus(enum.StrEnum):
    """The life of a job: ``queued -> running -> succeeded | failed | cancelled``; a running
    job goes back to ``queued`` when its worker requeues it or dies (its heartbeat expired)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# The statuses a job never leaves.
FINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


@dataclass(frozen=True, kw_only=True)
class JobView:
    """One job as stored, read atomically.

    Attributes:
        id: ``"job-"`` + 32 hex digits.
        route: the HTTP route the job runs, e.g. ``"/v1/embeddings"``.
        status: see :class:`JobStatus`.
        created_at, started_at, finished_at: unix seconds (the last two ``None`` until set;
            ``started_at`` is the latest claim).
        attempts: how many times a worker claimed it.
        price_bytes: device bytes the request is priced at.
        request: the caller's serialized validated request (opaque bytes), for the worker.
        body_json: the request body as the client sent it (JSON text).
        position: jobs ahead of it in the queue (0 = next) while queued, else ``None``.
        eta_s: while queued, ``(position + 1) / completions per second``, or ``None`` when no
            completion rate was measured yet.
        worker: the worker that claimed it last (or recorded its outcome).
        cancel_requested: a cancel came while it ran; its outcome will be ``cancelled``.
        result_json: the route's response body (JSON text), when it succeeded.
        error_json: the OpenAI error body ``{"error": {...}}`` (JSON text), when it failed.
        status_code: the HTTP status of that error.
        idempotency_key: the client's Idempotency-Key, if it sent one.
    """

    id: str
    route: str
    status: JobStatus
    created_at: float
    attempts: int
    price_bytes: int
    request: bytes = field(repr=False)
    body_json: str = field(repr=False)
    position: int | None = None
    eta_s: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    cancel_requested: bool = False
    result_json: str | None = field(default=None, repr=False)
    error_json: str | None = field(default=None, repr=False)
    status_code: int | None = None
    idempotency_key: str | None = None

    def to_body(self) -> dict[str, Any]:
        """The HTTP body of ``GET /v1/jobs/{id}``: ``id``, ``object`` (``"job"``), ``status``,
        ``route``, ``created_at``, ``attempts``; ``position`` and ``eta_s`` (may be null) while
        queued; ``result`` (the parsed response body) when succeeded; ``error`` (the parsed
        OpenAI error body) when failed."""
        body: dict[str, Any] = {"id": self.id, "object": "job", "status": str(self.status),
                                "route": self.route, "created_at": self.created_at,
                                "attempts": self.attempts}
        if self.status is JobStatus.QUEUED:
            body["position"], body["eta_s"] = self.position, self.eta_s
        if self.status is JobStatus.SUCCEEDED and self.result_json is not None:
            body["result"] = json.loads(self.result_json)
        if self.status is JobStatus.FAILED and self.error_json is not None:
            body["error"] = json.loads(self.error_json)
        return body


def _text(fields: dict[str, bytes], name: str) -> str | None:
    value = fields.get(name)
    return None if value is None else value.decode()


def _number(fields: dict[str, bytes], name: str, kind: type = float) -> Any:
    value = fields.get(name)
    return None if value is None else kind(value)


def view_from_reply(reply: list[Any]) -> JobView:
    """Decode a view reply of a :mod:`serve_app.jobs.lua` script,
    ``[[field, value, ...], position or -1]`` (bytes); ``eta_s`` is left ``None``."""
    flat, position = reply
    fields = {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}
    status = JobStatus(fields["status"].decode())
    queued_at = int(position) if status is JobStatus.QUEUED and int(position) >= 0 else None
    return JobView(
        id=fields["id"].decode(), route=fields["route"].decode(), status=status,
        created_at=float(fields["created_at"]), attempts=int(fields.get("attempts", b"0")),
        price_bytes=int(fields["price_bytes"]), request=fields.get("request", b""),
        body_json=_text(fields, "body") or "", position=queued_at,
        started_at=_number(fields, "started_at"), finished_at=_number(fields, "finished_at"),
        worker=_text(fields, "worker"), cancel_requested=fields.get("cancel_requested") == b"1",
        result_json=_text(fields, "result"), error_json=_text(fields, "error"),
        status_code=_number(fields, "status_code", int),
        idempotency_key=_text(fields, "idempotency_key"))
