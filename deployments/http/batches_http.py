"""OpenAI's Batch API on the durable jobs: ``/v1/files`` (upload ``multipart/form-data`` with
``purpose=batch``, list, retrieve, ``/content``, delete) and ``/v1/batches`` (create,
retrieve, cancel, list with ``after``/``limit``), in OpenAI's shapes
(https://platform.openai.com/docs/api-reference/batch). Files and batches live in the first
model's job store's Redis (:mod:`serve_app.batches`); every ingress runs batches
(:mod:`deployments.http.batch_driver`)."""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException

from deployments.http.batch_driver import BatchDriver, BatchParts
from deployments.http.http_middleware import tenant_of
from deployments.http.jobs_http import JobsRoutes
from deployments.http.openapi import responses
from serve_app.batches.files import FileStore, JsonlChecker
from serve_app.batches.models import (
    WINDOWS_S,
    Batch,
    BatchCreate,
    BatchList,
    BatchStatus,
    FileDeleted,
    FileList,
    FileObject,
    new_batch_id,
)
from serve_app.batches.store import BatchStore
from serve_app.errors import InvalidRequestError, ModelNotFoundError, NotFoundError
from serve_app.jobs.config import JobsConfig
from serve_app.jobs.store import JobStore
from serve_app.metrics import ProcessMetrics

UPLOAD_CHUNK_BYTES = 1 << 20
"""How much of an upload is read (and appended to Redis) at a time."""
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "JSONL: one request a line, `{custom_id, method, url, body}`."},
        "purpose": {"type": "string", "enum": ["batch"]}}}}}}}
"""The OpenAPI declaration of ``POST /v1/files``'s body (the route parses it itself, streamed)."""


class BatchesRoutes:
    """``/v1/files`` and ``/v1/batches`` of one ingress.

    Args:
        jobs: the ingress's ``/v1/jobs`` routes (a line is validated and submitted as a job
            there would be).
        config: the app's ``jobs:`` section (the limits, the window).
        metrics: the ingress's metrics.
    """

    def __init__(self, jobs: JobsRoutes, config: JobsConfig, metrics: ProcessMetrics) -> None:
        self._jobs, self._config, self._metrics = jobs, config, metrics
        self._files: FileStore | None = None
        self._batches: BatchStore | None = None
        self._driver: BatchDriver | None = None

    def open(self, store: JobStore) -> None:
        """Keep files and batches in ``store``'s Redis (the first model's) and start
        running batches. Called once the models are open (requests wait until then)."""
        base = f"vramgate:batches:{store.namespace}:"
        self._files = FileStore(store.client, base)
        self._batches = BatchStore(store.client, base)
        self._driver = BatchDriver(BatchParts(self._batches, self._files, self._jobs,
                                              self._config.batch_window, self._metrics))
        self._driver.start()

    def stop(self) -> None:
        if self._driver is not None:
            self._driver.stop()

    def install(self, app: FastAPI) -> None:
        """Add the routes (and their OpenAPI declarations) to ``app``."""
        app.post("/v1/files", response_model=None, openapi_extra=UPLOAD_BODY,
                 responses=responses(FileObject, 400, 401, 413, 503))(self.upload)
        app.get("/v1/files", response_model=None,
                responses=responses(FileList, 400, 401, 503))(self.list_files)
        app.get("/v1/files/{file_id}", response_model=None,
                responses=responses(FileObject, 401, 404, 503))(self.show_file)
        app.delete("/v1/files/{file_id}", response_model=None,
                   responses=responses(FileDeleted, 401, 404, 503))(self.delete_file)
        content = responses(FileObject, 401, 404, 503)
        content[200] = {"description": "The file's bytes (JSONL).",
                        "content": {"application/jsonl": {"schema": {"type": "string"}}}}
        app.get("/v1/files/{file_id}/content", response_model=None,
                responses=content)(self.content)
        app.post("/v1/batches", response_model=None,
                 responses=responses(Batch, 400, 401, 404, 503))(self.create)
        app.get("/v1/batches", response_model=None,
                responses=responses(BatchList, 400, 401, 503))(self.list_batches)
        app.get("/v1/batches/{batch_id}", response_model=None,
                responses=responses(Batch, 401, 404, 503))(self.show)
        app.post("/v1/batches/{batch_id}/cancel", response_model=None,
                 responses=responses(Batch, 401, 404, 503))(self.cancel)

    async def upload(self, request: Request) -> dict[str, Any]:
        """``POST /v1/files``: store a JSONL file (``purpose=batch``), streamed and checked
        line by line (400 ``invalid_jsonl``/``too_many_lines``/``invalid_purpose``, 413
        ``body_too_large`` over ``jobs.batch_max_file_bytes``)."""
        try:
            form = await request.form(max_files=1, max_fields=8)
        except MultiPartException as exc:
            raise InvalidRequestError(f"the body is not valid multipart/form-data: "
                                      f"{exc.message}", code="invalid_multipart") from None
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise InvalidRequestError(f"purpose must be 'batch', not {purpose!r}",
                                          code="invalid_purpose")
            if not isinstance(upload, UploadFile):
                raise InvalidRequestError("a file is required (multipart field 'file')",
                                          code="file")
            checker = JsonlChecker(self._config.batch_max_file_bytes,
                                   self._config.batch_max_lines)
            file = await self._parts()[0].write(_chunks(upload), upload.filename or "file",
                                                "batch", checker)
        finally:
            await form.close()
        return file.model_dump()

    async def list_files(self, purpose: str | None = None,
                         limit: int = Query(10000, ge=1, le=10000),
                         after: str | None = None) -> dict[str, Any]:
        """``GET /v1/files``: newest first."""
        found = await self._parts()[0].list(purpose, limit + 1, after)
        return FileList(data=found[:limit], has_more=len(found) > limit).model_dump()

    async def show_file(self, file_id: str) -> dict[str, Any]:
        """``GET /v1/files/{file_id}`` (404 ``file_not_found``)."""
        return _found(await self._parts()[0].get(file_id), "file", file_id).model_dump()

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        """``DELETE /v1/files/{file_id}`` (404 ``file_not_found``)."""
        _found(await self._parts()[0].delete(file_id) or None, "file", file_id)
        return FileDeleted(id=file_id).model_dump()

    async def content(self, file_id: str) -> StreamingResponse:
        """``GET /v1/files/{file_id}/content``: the bytes, streamed."""
        files = self._parts()[0]
        _found(await files.get(file_id), "file", file_id)
        return StreamingResponse(files.read(file_id), media_type="application/jsonl")

    async def create(self, body: BatchCreate, request: Request) -> dict[str, Any]:
        """``POST /v1/batches``: a batch of the uploaded ``input_file_id``, ``validating``
        (404 ``file_not_found``; 404 ``model_not_found`` for an endpoint no model serves)."""
        files, batches = self._parts()
        file = _found(await files.get(body.input_file_id), "file", body.input_file_id)
        if file.purpose != "batch":
            raise InvalidRequestError(f"file {file.id} has purpose {file.purpose!r}, not "
                                      "'batch'", code="invalid_purpose")
        if body.endpoint not in self._jobs.paths():
            raise ModelNotFoundError(f"no model here serves {body.endpoint}")
        now = int(time.time())
        batch = Batch(id=new_batch_id(), endpoint=body.endpoint, input_file_id=file.id,
                      completion_window=body.completion_window, created_at=now,
                      expires_at=now + int(WINDOWS_S[body.completion_window]),
                      metadata=body.metadata)
        await batches.create(batch, tenant_of(request))
        self._driver.wake()
        return batch.model_dump()

    async def list_batches(self, limit: int = Query(20, ge=1, le=100),
                           after: str | None = None) -> dict[str, Any]:
        """``GET /v1/batches``: newest first, ``after`` a batch id."""
        found, more = await self._parts()[1].list(limit, after)
        return BatchList(data=found, first_id=found[0].id if found else None,
                         last_id=found[-1].id if found else None, has_more=more).model_dump()

    async def show(self, batch_id: str) -> dict[str, Any]:
        """``GET /v1/batches/{batch_id}`` (404 ``batch_not_found``)."""
        return _found(await self._parts()[1].get(batch_id), "batch", batch_id).model_dump()

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        """``POST /v1/batches/{batch_id}/cancel``: ``cancelling`` (then ``cancelled`` once
        its running lines stopped); a batch already final or cancelling is left as it is."""
        batches = self._parts()[1]
        await batches.transition(batch_id, {BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS},
                                 BatchStatus.CANCELLING)
        return await self.show(batch_id)

    def _parts(self) -> tuple[FileStore, BatchStore]:
        if self._files is None or self._batches is None:  # the opening gate holds requests
            raise RuntimeError("the Batch API is not open yet")
        return self._files, self._batches


async def _chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(UPLOAD_CHUNK_BYTES):
        yield chunk


def _found(found: Any, what: str, name: str) -> Any:
    if found is None:
        raise NotFoundError(f"no {what} {name!r}", code=f"{what}_not_found")
    return found
