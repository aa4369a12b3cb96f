"""``POST /v1/completions`` (OpenAI-compatible; ``stream: true`` for server-sent events)."""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from deployments.http.routes.generation import GenerationRoute, Reply
from serve_app.request import GenerationParams, InferenceRequest
from serve_app.responses import CompletionBody, usage
from serve_app.schemas import CompletionRequest, CompletionResponse


class CompletionsRoute(GenerationRoute):
    """Text completions of one prompt (text or token ids), whole or streamed."""

    body_model = CompletionRequest
    path = "/v1/completions"
    response_model = CompletionResponse
    whole_body = CompletionBody
    stream_events = "each event's data is a CompletionResponse without usage"

    async def endpoint(self, body: CompletionRequest, request: Request) -> Response:
        """``POST /v1/completions`` (OpenAI-compatible; ``stream: true`` for server-sent
        events ending with ``data: [DONE]``)."""
        return await self.dispatch(body, request)

    def params(self, body: CompletionRequest) -> GenerationParams:
        return GenerationParams(body.max_tokens, body.temperature, body.top_p, body.seed,
                                body.stop_strings())

    async def build(self, body: CompletionRequest, params: GenerationParams,
                    stream: bool) -> InferenceRequest:
        return await self.context.factory.build(self.kind, [body.prompt], params, stream)

    def reply(self, completion_id: str, created: int, model: str) -> Reply:
        return _Completion(completion_id, created, model)


class _Completion(Reply):
    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {**self.head("text_completion"),
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish_reason}]}

    def piece(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self._choice(text, finish_reason)

    def usage_event(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {**self.head("text_completion"), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}
