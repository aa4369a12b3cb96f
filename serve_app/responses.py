"""How a finished request becomes its route's response body: one small value per route
(:class:`ResponseBody`), made where the request is validated (the route's ``prepare``) and
called with the :class:`~serve_app.schemas.InferenceResult`. The same value renders a
request answered at once (at the ingress) and a durable job (on the model replica, which
reads it from the job's record, :mod:`serve_app.jobs.payload`), so that a job's result is
the route's normal body. Each value turns into plain JSON fields and back
(:meth:`ResponseBody.to_dict`, :func:`response_body_from`).

Pure: numpy only (no Ray, torch or FastAPI).
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from serve_app.errors import InvalidRequestError
from serve_app.request import GenerationOutput
from serve_app.schemas import InferenceResult


class ResponseBody:
    """How one request's result renders (see module docstring); ``name`` identifies its
    class in a stored job."""

    name: ClassVar[str]

    def __call__(self, result: InferenceResult) -> dict[str, Any]:
        """The route's JSON body for ``result``.

        Raises:
            ServeAppError: a result the request's options cannot render (400)."""
        raise NotImplementedError

    def as_of(self, created: int) -> ResponseBody:
        """This body stamped as created at ``created`` (Unix seconds; a completion's
        ``created``); the same body where nothing says when."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON fields, ``"as"`` naming the class (:func:`response_body_from`)."""
        return {"as": self.name, **dataclasses.asdict(self)}  # type: ignore[call-overload]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class EmbeddingsBody(ResponseBody):
    """``/v1/embeddings``: the vectors cut to ``dimensions`` (re-normalised), as floats or
    base64 (``encoding_format``), of the served ``model``."""

    name: ClassVar[str] = "embeddings"
    model: str
    dimensions: int | None = None
    encoding_format: str = "float"

    def __call__(self, result: InferenceResult) -> dict[str, Any]:
        vectors = fit_dimensions(result.output.embeddings, self.dimensions)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(vector, self.encoding_format)}
                for i, vector in enumerate(vectors)]
        tokens = result.output.prompt_tokens
        return {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def fit_dimensions(embeddings: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Truncate to ``dimensions`` and re-normalise (OpenAI's ``dimensions`` parameter).

    Raises:
        InvalidRequestError: more dimensions than the model's.
    """
    if dimensions is None or dimensions == embeddings.shape[1]:
        return embeddings
    if dimensions > embeddings.shape[1]:
        raise InvalidRequestError(
            f"dimensions={dimensions} exceeds the model's {embeddings.shape[1]}",
            code="dimensions")
    cut = embeddings[:, :dimensions]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@dataclass(frozen=True)
class CompletionBody(ResponseBody):
    """``/v1/completions`` answered whole: response ``id``, ``created`` (Unix seconds) and
    ``model``."""

    name: ClassVar[str] = "completion"
    id: str
    created: int
    model: str

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def as_of(self, created: int) -> ResponseBody:
        return dataclasses.replace(self, created=created)

    def __call__(self, result: InferenceResult) -> dict[str, Any]:
        output: GenerationOutput = result.output
        return {**self.head("text_completion"),
                "choices": [{"index": 0, "text": output.text, "logprobs": None,
                             "finish_reason": output.finish_reason}],
                "usage": usage(output.prompt_tokens, output.completion_tokens)}


@dataclass(frozen=True)
class ChatCompletionBody(CompletionBody):
    """``/v1/chat/completions`` answered whole (fields as :class:`CompletionBody`)."""

    name: ClassVar[str] = "chat.completion"

    def __call__(self, result: InferenceResult) -> dict[str, Any]:
        output: GenerationOutput = result.output
        return {**self.head("chat.completion"),
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": output.text},
                             "logprobs": None, "finish_reason": output.finish_reason}],
                "usage": usage(output.prompt_tokens, output.completion_tokens)}


RESPONSE_BODIES: dict[str, type[ResponseBody]] = {
    cls.name: cls for cls in (EmbeddingsBody, CompletionBody, ChatCompletionBody)}
"""Every response body a stored job may carry, by :attr:`ResponseBody.name`."""


def response_body_from(fields: dict[str, Any]) -> ResponseBody:
    """The body :meth:`ResponseBody.to_dict` wrote.

    Raises:
        KeyError: ``"as"`` names no class of :data:`RESPONSE_BODIES`.
        TypeError: fields that class does not have.
    """
    fields = dict(fields)
    return RESPONSE_BODIES[fields.pop("as")](**fields)
