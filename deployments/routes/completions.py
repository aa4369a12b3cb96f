"""``POST /v1/completions`` (OpenAI-compatible; ``stream: true`` for server-sent events)."""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.http_errors import as_serve_app_error
from deployments.openapi import INFERENCE_ERRORS, INFERENCE_PARAMETERS, responses
from deployments.routes.base import Route
from serve_app.errors import InvalidRequestError
from serve_app.request import GenerationParams
from serve_app.schemas import CompletionRequest, CompletionResponse


class CompletionsRoute(Route):
    """Text completions of one prompt (kind ``generate``), whole or streamed."""

    kind = "generate"

    def install(self, app: FastAPI) -> None:
        app.post("/v1/completions", response_model=None, responses=responses(
            CompletionResponse, *INFERENCE_ERRORS, inference=True, event_stream=(
                "stream: true: each event's data is a CompletionResponse without usage "
                "(an error after the first event comes in-band as an ErrorResponse); "
                "the last one is `[DONE]`")),
            openapi_extra={"parameters": INFERENCE_PARAMETERS})(self.completions)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """``POST /v1/completions`` (OpenAI-compatible; ``stream: true`` for server-sent
        events ending with ``data: [DONE]``)."""
        context = self.context
        context.check_model(body.model)
        params = GenerationParams(body.max_tokens, body.temperature, body.top_p, body.seed,
                                  body.stop_strings())
        context.factory.check(self.kind, 1, params)
        completion = _Completion(f"cmpl-{request.headers.get('x-request-id', uuid.uuid4().hex)}",
                                 int(time.time()), context.args.model.name)
        if body.stream:
            if request.headers.get("idempotency-key") is not None:
                raise InvalidRequestError("Idempotency-Key is not supported with stream: true",
                                          code="idempotency_key")
            return await self._stream(body, params, completion)
        return await context.guard.run(request, body,
                                       lambda: self._complete(body, params, completion))

    async def _complete(self, body: CompletionRequest, params: GenerationParams,
                        completion: "_Completion") -> JSONResponse:
        context = self.context
        inference = await context.factory.build(self.kind, [body.prompt], params,
                                                field="prompt")
        result = await context.client.infer(inference)
        output = result.output
        return JSONResponse({
            **completion.choice(output.text, output.finish_reason),
            "usage": {"prompt_tokens": output.prompt_tokens,
                      "completion_tokens": output.completion_tokens,
                      "total_tokens": output.prompt_tokens + output.completion_tokens},
        }, headers=result.admitted.headers())

    async def _stream(self, body: CompletionRequest, params: GenerationParams,
                      completion: "_Completion") -> StreamingResponse:
        """Admission errors come before the first byte, as ordinary HTTP errors; anything
        after it goes in-band as a final ``data: {"error": ...}`` event, then ``[DONE]``."""
        context = self.context
        inference = await context.factory.build(self.kind, [body.prompt], params,
                                                stream=True, field="prompt")
        first, rest = await context.client.stream(inference)

        async def events() -> AsyncIterator[str]:
            try:
                async for item in rest:
                    text, reason = item.get("text", ""), item.get("finish_reason")
                    yield _sse(completion.choice(text, reason))
            except Exception as exc:  # after the first byte: in-band, never a broken stream
                yield _sse(as_serve_app_error(exc).to_body())
            finally:
                await rest.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**first["admitted"].headers(),
                                          "Cache-Control": "no-cache"})


class _Completion:
    """One completion's id, creation time and model, on every body or event."""

    def __init__(self, completion_id: str, created: int, model: str) -> None:
        self.id, self.created, self.model = completion_id, created, model

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish_reason}]}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
