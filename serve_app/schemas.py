"""Request and result types of the HTTP API (README, "HTTP API"), validated by pydantic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)


def _check_encodable(text: str) -> str:
    """JSON can carry lone UTF-16 surrogates (``"\\ud800"``) that are not text; refuse them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` body (OpenAI-compatible; unknown fields are refused like
    OpenAI does). Token-id arrays are not accepted as ``input``."""

    model_config = ConfigDict(extra="forbid")

    # (The lengths are checked by `_strings` first; declared here for the OpenAPI schema.)
    input: (Annotated[StrictStr, Field(min_length=1)]
            | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)])
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _strings(cls, value: object) -> object:
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError("input must be a string or a list of strings")
        if not texts:
            raise ValueError("input must contain at least one string")
        if any(not t for t in texts):
            raise ValueError("input strings must not be empty")
        for text in texts:
            _check_encodable(text)
        return value

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


@dataclass(frozen=True)
class Admitted:
    """How a request was admitted: queue wait (s) and waiters ahead (0: at once)."""

    queue_wait_s: float
    queue_position: int

    def headers(self) -> dict[str, str]:
        """``X-Queue-Wait-Ms`` and ``X-Queue-Position`` response headers."""
        return {"X-Queue-Wait-Ms": str(round(self.queue_wait_s * 1000)),
                "X-Queue-Position": str(self.queue_position)}


@dataclass(frozen=True)
class InferenceResult:
    """What a model replica returns for one request.

    Attributes:
        output: the engine's output for its kind (:class:`serve_app.request.EmbeddingOutput`,
            :class:`serve_app.request.GenerationOutput`).
        admitted: queue wait and position.
        replica_id: the replica that served it.
    """

    output: Any
    admitted: Admitted
    replica_id: str


class CompletionRequest(BaseModel):
    """``POST /v1/completions`` body (OpenAI-compatible subset; unknown fields are refused).

    ``max_tokens`` is further bounded by ``limits.max_tokens`` at the ingress.
    """

    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr = Field(min_length=1)
    model: StrictStr | None = None
    max_tokens: StrictInt = Field(16, ge=1)
    # Strict: JSON numbers only (integers included), not booleans or numeric strings.
    temperature: StrictFloat = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: StrictFloat = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = Field(None)
    stream: StrictBool = False
    n: StrictInt = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    user: StrictStr | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        for text in [value] if isinstance(value, str) else value or []:
            _check_encodable(text)
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: str) -> str:
        return _check_encodable(value)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


# --- Response bodies, as declared in the OpenAPI schema (the ingress renders them itself) -----


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None


class ErrorResponse(BaseModel):
    """Every error response (OpenAI error shape; CONTRACT.md "Errors")."""

    error: ErrorDetail


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(
        description="Floats, or base64 of little-endian float32 with encoding_format=base64.")


class EmbeddingResponse(BaseModel):
    """``POST /v1/embeddings`` 200 body."""

    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length"] | None = Field(
        description="null in the stream's text events; set in the last one.")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """``POST /v1/completions`` 200 body (``stream: false``; each event of a stream is the
    same without ``usage``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    """``GET /v1/models`` body."""

    object: Literal["list"]
    data: list[ModelCard]


class StatusResponse(BaseModel):
    """``GET /v1/status`` body: each live model replica's published admission state."""

    model: str
    replicas: list[dict[str, Any]]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class ReadyResponse(BaseModel):
    status: Literal["ready"]
    replicas: int
