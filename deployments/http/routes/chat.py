"""``POST /v1/chat/completions`` (OpenAI-compatible; ``stream: true`` for
``chat.completion.chunk`` server-sent events): the messages rendered by the model's chat
template at the ingress, then completed as one prompt."""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from deployments.http.routes.generation import GenerationRoute, Reply
from serve_app.chat import ChatCompletionRequest, ChatCompletionResponse
from serve_app.request import GenerationParams, InferenceRequest
from serve_app.responses import ChatCompletionBody, usage


class ChatCompletionsRoute(GenerationRoute):
    """A chat model's reply to a conversation, whole or streamed."""

    id_prefix = "chatcmpl"

    body_model = ChatCompletionRequest
    path = "/v1/chat/completions"
    response_model = ChatCompletionResponse
    whole_body = ChatCompletionBody
    stream_events = ("each event's data is a ChatCompletionChunk: the role first, then "
                     "content deltas, then the finish_reason")

    async def endpoint(self, body: ChatCompletionRequest, request: Request) -> Response:
        """``POST /v1/chat/completions`` (OpenAI-compatible)."""
        return await self.dispatch(body, request)

    def params(self, body: ChatCompletionRequest) -> GenerationParams:
        return GenerationParams(body.new_tokens(self.context.args.limits.max_tokens),
                                body.temperature, body.top_p, body.seed, body.stop_strings())

    async def build(self, body: ChatCompletionRequest, params: GenerationParams,
                    stream: bool) -> InferenceRequest:
        return await self.context.factory.build_chat(self.kind, body.rendered_messages(),
                                                     params, stream)

    def reply(self, completion_id: str, created: int, model: str) -> Reply:
        return _ChatReply(completion_id, created, model)


class _ChatReply(Reply):
    def _chunk(self, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
        return {**self.head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish_reason}]}

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def piece(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self._chunk({"content": text} if text else {}, finish_reason)

    def usage_event(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {**self.head("chat.completion.chunk"), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}
