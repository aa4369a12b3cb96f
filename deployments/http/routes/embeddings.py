"""``POST /v1/embeddings`` (OpenAI-compatible)."""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
from fastapi import FastAPI, Request
from fastapi.responses import Response

from deployments.http.openapi import INFERENCE_ERRORS, INFERENCE_PARAMETERS, responses
from deployments.http.routes.base import Prepared, Route
from serve_app.kinds import KINDS
from serve_app.responses import EmbeddingsBody
from serve_app.schemas import EmbeddingRequest, EmbeddingResponse


class EmbeddingsRoute(Route):
    """Embeddings of 1..``limits.max_inputs`` inputs (kind ``embed``)."""

    kind = KINDS["embed"]
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
        return Prepared(inference, EmbeddingsBody(context.args.model.name, body.dimensions,
                                                  body.encoding_format))
