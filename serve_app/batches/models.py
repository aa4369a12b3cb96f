"""OpenAI's Batch API objects (https://platform.openai.com/docs/api-reference/batch and
/files): the File, the Batch, and one line of a batch's input file. Pure pydantic."""

from __future__ import annotations

import enum
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

BATCH_ENDPOINTS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions")
"""The inference routes a batch may run (``endpoint``)."""


class BatchStatus(enum.StrEnum):
    """The life of a batch: ``validating -> in_progress -> finalizing -> completed``;
    ``validating -> failed`` (a malformed line); ``cancelling -> cancelled``; ``expired``
    once its ``completion_window`` has passed."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


FINAL_BATCH_STATUSES = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED,
                                  BatchStatus.CANCELLED, BatchStatus.EXPIRED})

WINDOWS_S = {"24h": 24 * 3600.0}
"""The ``completion_window`` values accepted, in seconds (OpenAI accepts ``24h`` only)."""


def new_file_id() -> str:
    """``"file-"`` and 24 hex digits."""
    return f"file-{uuid.uuid4().hex[:24]}"


def new_batch_id() -> str:
    """``"batch_"`` and 24 hex digits."""
    return f"batch_{uuid.uuid4().hex[:24]}"


class FileObject(BaseModel):
    """A stored file: ``bytes`` its size, ``created_at`` unix seconds; ``purpose`` ``batch``
    (an upload) or ``batch_output`` (a batch's output or error file)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"


class FileList(BaseModel):
    """``GET /v1/files``: newest first."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(BaseModel):
    """``DELETE /v1/files/{id}``."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchError(BaseModel):
    """One problem found while validating: ``line`` is 1-based; ``param`` the field."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class RequestCounts(BaseModel):
    """Lines in the batch, those answered (in the output file) and those failed (in the
    error file)."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(BaseModel):
    """A batch as ``GET /v1/batches/{id}`` shows it; the times are unix seconds (``None``
    until the batch reaches that step)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus = BatchStatus.VALIDATING
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchCreate(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: Literal["/v1/embeddings", "/v1/completions", "/v1/chat/completions"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)


class BatchLine(BaseModel):
    """One line of a batch's input file: a request to ``url`` with ``body``, named by the
    caller's ``custom_id`` (unique in the file); unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")
    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class BatchList(BaseModel):
    """``GET /v1/batches``: newest first; ``first_id``/``last_id`` of this page."""

    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
