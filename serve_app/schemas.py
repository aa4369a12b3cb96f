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
    model_validator,
)


def _check_encodable(text: str) -> str:
    """JSON can carry lone UTF-16 surrogates (``"\\ud800"``) that are not text; refuse them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
"""One input given as token ids (OpenAI's array-of-integers form)."""


def _check_inputs(value: object, field: str, batch: bool = True) -> object:
    """One input or (``batch``) a list of them, each a non-empty string or a non-empty list
    of token ids; a list mixes no kinds. Raises ValueError naming what is wrong."""
    forms = ("a string, a list of strings, a list of token ids or a list of lists of token "
             "ids" if batch else "a string or a list of token ids")
    if isinstance(value, str):
        return _check_text(value, field)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field} must be {forms}, not {_json_kind(value)}")
    kinds = {type(item) for item in value}
    if len(kinds) > 1 and (str in kinds or list in kinds):
        raise ValueError(f"{field} mixes kinds: it must be {forms}")
    if kinds == {str} and batch:
        for text in value:
            _check_text(text, field)
    elif kinds == {list} and batch:
        for ids in value:
            _check_ids(ids, field)
    else:
        if not batch and kinds & {str, list}:
            raise ValueError(f"{field} must be one prompt: {forms}")
        _check_ids(value, field)
    return value


def _json_kind(value: object) -> str:
    """What a JSON value is, in words: ``a number``, ``an empty list``, ``null``, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    return "an empty list" if value == [] else type(value).__name__


def _check_text(text: str, field: str) -> str:
    if not text:
        raise ValueError(f"{field} strings must not be empty")
    return _check_encodable(text)


def _check_ids(ids: list, field: str) -> None:
    if not ids or not all(type(token) is int and token >= 0 for token in ids):
        raise ValueError(f"{field} token ids must be non-empty lists of integers >= 0")


def _as_inputs(value: str | list) -> list[str | list[int]]:
    """The inputs of a checked ``input``/``prompt`` value, one entry each."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` body (OpenAI-compatible; unknown fields are refused like
    OpenAI does). ``input``: a string, a list of strings, a list of token ids or a list of
    lists of token ids (what LangChain's ``OpenAIEmbeddings`` sends)."""

    model_config = ConfigDict(extra="forbid")

    # (Checked by `_inputs` first; declared here for the OpenAPI schema.)
    input: (Annotated[StrictStr, Field(min_length=1)]
            | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)]
            | TokenIds
            | Annotated[list[TokenIds], Field(min_length=1)])
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None
    input_type: StrictStr | None = Field(
        None, description="The model's prompt to apply to text inputs, by name (its "
        "sentence-transformers `prompts`, e.g. `query`); default: its default prompt.")
    truncate: StrictBool | None = Field(
        None, description="Cut inputs longer than the limit at their end instead of "
        "refusing them (400); default: `limits.truncate`.")

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: object) -> object:
        return _check_inputs(value, "input")

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: its text or its token ids."""
        return _as_inputs(self.input)


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


class StreamOptions(BaseModel):
    """``stream_options`` (OpenAI): ``include_usage`` adds a last event with the usage."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class GenerationFields(BaseModel):
    """What ``/v1/completions`` and ``/v1/chat/completions`` share (OpenAI-compatible subset;
    unknown fields are refused naming them). ``null`` for an optional field means its
    default, as OpenAI's schema allows."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    # Strict: JSON numbers only (integers included), not booleans or numeric strings.
    # `| None`: null is declared (OpenAI's schema allows it) and means the default.
    temperature: StrictFloat | None = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = Field(None)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(1, ge=1, le=1,
                                description="Only one choice per request is supported.")
    user: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, value: object) -> object:
        if isinstance(value, dict):
            return {key: item for key, item in value.items() if item is not None}
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        for text in [value] if isinstance(value, str) else value or []:
            _check_encodable(text)
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        """A streamed response ends with a usage event."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationFields):
    """``POST /v1/completions`` body. ``max_tokens`` is further bounded by
    ``limits.max_tokens`` at the ingress."""

    prompt: Annotated[StrictStr, Field(min_length=1)] | TokenIds
    max_tokens: StrictInt | None = Field(16, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: object) -> object:
        return _check_inputs(value, "prompt", batch=False)


# --- Response bodies, as declared in the OpenAPI schema (the ingress renders them itself) -----


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None


class ErrorResponse(BaseModel):
    """Every error response (OpenAI error shape; the README's error table)."""

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
    root: str = Field(description="What is served: the model directory (or the engine).")
    max_model_len: int = Field(description="The longest input the model reads, tokens.")


class ModelList(BaseModel):
    """``GET /v1/models`` body."""

    object: Literal["list"]
    data: list[ModelCard]


class ModelStatus(BaseModel):
    """One served model in ``GET /v1/status``."""

    model: str = Field(description="Its `model.name`: what requests name it by.")
    engine: str
    max_seq_tokens: int = Field(description="The longest input the model reads, tokens.")
    embedding: dict[str, Any] | None = Field(
        None, description="Embedding models: how an input becomes a vector (sentence-"
        "transformers modules, pooling, normalize, prompts, do_lower_case).")


class StatusResponse(BaseModel):
    """``GET /v1/status`` body: each served model, and each live model replica's published
    admission state (its ``model`` names which). An app of one model also has that model's
    fields at the top."""

    model: str | None = Field(None, description="The model, in an app of one model.")
    engine: str | None = None
    max_seq_tokens: int | None = None
    embedding: dict[str, Any] | None = None
    models: list[ModelStatus]
    replicas: list[dict[str, Any]]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class ReadyResponse(BaseModel):
    status: Literal["ready"]
    replicas: int


class JobResponse(BaseModel):
    """A job (``GET /v1/jobs/{id}``)."""

    id: str
    object: str = "job"
    status: str = Field(description="queued, running, succeeded, failed or cancelled.")
    route: str
    created_at: float
    attempts: int
    position: int | None = Field(None, description="Jobs ahead of it (queued only).")
    eta_s: float | None = Field(None, description="Predicted seconds until it finishes "
                                "(queued only; null until a completion rate is measured).")
    result: dict[str, Any] | None = Field(None, description="The route's normal response "
                                          "body (succeeded only).")
    error: dict[str, Any] | None = Field(None, description="The route's error body "
                                         "(failed only).")
