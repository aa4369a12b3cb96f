"""``POST /v1/embeddings`` (OpenAI-compatible)."""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import base64
from functools import partial
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from deployments.openapi import INFERENCE_ERRORS, INFERENCE_PARAMETERS, responses
from deployments.routes.base import Prepared, Route
from serve_app.errors import InvalidRequestError
from serve_app.schemas import EmbeddingRequest, EmbeddingResponse, InferenceResult


class EmbeddingsRoute(Route):
    """Embeddings of 1..``limits.max_inputs`` inputs (kind ``embed``)."""

    kind = "embed"
    path = "/v1/embeddings"
    body_model = EmbeddingRequest

    def install(self, app: FastAPI) -> None:
        app.post(self.path, response_model=None,
                 responses=responses(EmbeddingResponse, *INFERENCE_ERRORS, inference=True),
                 openapi_extra={"parameters": INFERENCE_PARAMETERS})(self.embeddings)

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        """``POST /v1/embeddings`` (OpenAI-compatible)."""
        return await self.dispatch(body, request)

    async def prepare(self, body: EmbeddingRequest, request_id: str) -> Prepared:
        context = self.context
        context.check_model(body.model)
        truncate = context.args.limits.truncate if body.truncate is None else body.truncate
        inference = await context.factory.build(self.kind, body.inputs(), truncate=truncate,
                                                input_type=body.input_type)
        return Prepared(inference, partial(self._render, body))

    def _render(self, body: EmbeddingRequest, result: InferenceResult) -> dict[str, Any]:
        vectors = fit_dimensions(result.output.embeddings, body.dimensions)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(vector, body.encoding_format)}
                for i, vector in enumerate(vectors)]
        tokens = result.output.prompt_tokens
        return {"object": "list", "data": data, "model": self.context.args.model.name,
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
