"""What a durable job's record carries for the model replica that runs it (the ``request``
field of :mod:`serve_app.jobs.store`): the request as the ingress validated, tokenized and
priced it (:class:`~serve_app.request.InferenceRequest`: kind, token ids, priced shape,
parameters, batch key) and how its result renders (:class:`~serve_app.responses.ResponseBody`),
so the replica runs it as it runs any request, without routes or a tokenizer; or the
refusal the ingress got when it rebuilt an older job's body (:class:`StoredRefusal`).

The record is versioned (``"v"``, :data:`FORMAT_VERSION`). Format 1, that of earlier
releases, stored no request (an empty field) and only the client's body, which the replica
then validated and tokenized itself: the ingress rebuilds such a job's request from its body
(:meth:`deployments.http.jobs_http.JobsFront.rebuild_stored`); a replica that meets one that was
not rebuilt, or a format it does not know, cannot read it (:class:`UnreadableJobError`).

Pure: JSON (no Ray, torch or FastAPI).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serve_app.admission.fair import DEFAULT_TENANT
from serve_app.admission.priority import Priority
from serve_app.errors import ServeAppError
from serve_app.memory.cost_model import Shape
from serve_app.request import EmbeddingParams, GenerationParams, InferenceRequest, RequestParams
from serve_app.responses import ResponseBody, response_body_from

FORMAT_VERSION = 2
"""The record format this release writes and reads (1: the body alone, before it)."""

_PARAMS: dict[str, type] = {"generation": GenerationParams, "embedding": EmbeddingParams}


@dataclass(frozen=True)
class StoredJob:
    """A job as a replica runs it: its request and how its result renders."""

    request: InferenceRequest
    render: ResponseBody


@dataclass(frozen=True)
class StoredRefusal:
    """A job that cannot run: its error body (``{"error": {...}}``) and HTTP status."""

    error: dict[str, Any]
    status_code: int


class UnreadableJobError(ValueError):
    """A record this release cannot read: ``version`` 1 not rebuilt yet, or a format of
    another release (0: none that says so)."""

    def __init__(self, version: int) -> None:
        super().__init__(f"job record format {version}; this release reads {FORMAT_VERSION}")
        self.version = version


def encode_job(request: InferenceRequest, render: ResponseBody) -> bytes:
    """The record of a job that runs ``request`` and renders its result with ``render``.

    Raises:
        TypeError: parameters of a kind no job carries (a transcription's audio), or a
            render that is not a :class:`ResponseBody`.
    """
    if not isinstance(render, ResponseBody):
        raise TypeError(f"a job's result renders through a ResponseBody, not {render!r}")
    return _dump({"request": {
        "kind": request.kind, "input_ids": [list(ids) for ids in request.input_ids],
        "shape": list(request.shape), "params": _params_dict(request.params),
        "stream": request.stream, "tenant": request.tenant, "priority": request.priority,
        "batch_key": None if request.batch_key is None else list(request.batch_key)},
        "render": render.to_dict()})


def encode_refusal(error: ServeAppError) -> bytes:
    """The record of a job that fails with ``error`` when a replica takes it."""
    return _dump({"error": error.to_body(), "status_code": error.status_code})


def decode(record: bytes) -> StoredJob | StoredRefusal:
    """What :func:`encode_job` or :func:`encode_refusal` wrote.

    Raises:
        UnreadableJobError: an empty record (format 1), or another format.
    """
    if not record:
        raise UnreadableJobError(1)
    try:
        fields = json.loads(record)
    except ValueError:
        raise UnreadableJobError(0) from None
    version = fields.get("v", 0) if isinstance(fields, dict) else 0
    if version != FORMAT_VERSION:
        raise UnreadableJobError(version)
    try:
        return _stored(fields)
    except (KeyError, TypeError, ValueError) as exc:  # not as this release writes it
        raise UnreadableJobError(version) from exc


def _stored(fields: dict[str, Any]) -> StoredJob | StoredRefusal:
    if "error" in fields:
        return StoredRefusal(fields["error"], int(fields["status_code"]))
    stored = fields["request"]
    key = stored["batch_key"]
    request = InferenceRequest(
        stored["kind"], tuple(tuple(ids) for ids in stored["input_ids"]),
        Shape(*stored["shape"]), _params_of(stored["params"]), stream=stored["stream"],
        batch_key=None if key is None else tuple(key),
        tenant=stored.get("tenant", DEFAULT_TENANT),  # earlier records of format 2: none
        priority=Priority(stored.get("priority", Priority.BATCH)))
    return StoredJob(request, response_body_from(fields["render"]))


def _dump(fields: dict[str, Any]) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, **fields}, separators=(",", ":")).encode()


def _params_dict(params: RequestParams) -> dict[str, Any] | None:
    if params is None:
        return None
    for name, cls in _PARAMS.items():
        if type(params) is cls:
            fields = {f: getattr(params, f) for f in cls.__dataclass_fields__}
            return {"type": name, **fields}
    raise TypeError(f"a job cannot carry {type(params).__name__}")


def _params_of(fields: dict[str, Any] | None) -> RequestParams:
    if fields is None:
        return None
    fields = dict(fields)
    cls = _PARAMS[fields.pop("type")]
    if "stop" in fields:
        fields["stop"] = tuple(fields["stop"])
    return cls(**fields)
