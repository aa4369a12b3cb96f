"""What the generation routes share (``/v1/completions``, ``/v1/chat/completions``): one
prompt completed whole, or streamed as server-sent events, with the usage at the end when
``stream_options.include_usage`` asks for it. A subclass says how its body becomes a request
and how its replies look (:class:`Reply`)."""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from deployments.http.http_errors import as_serve_app_error
from deployments.http.openapi import INFERENCE_ERRORS, INFERENCE_PARAMETERS, responses
from deployments.http.routes.base import Prepared, Route, from_client, request_id_of
from serve_app.client_wait import prefers_async
from serve_app.errors import InvalidRequestError, ServeAppError
from serve_app.kinds import KINDS
from serve_app.request import GenerationParams, InferenceRequest
from serve_app.responses import CompletionBody
from serve_app.schemas import GenerationFields
from serve_app.stream_events import (
    Admitted,
    Finished,
    Queued,
    StreamError,
    StreamEvent,
    TextPiece,
)


class Reply:
    """One response's id, creation time and model, and how its streamed events look (its
    body returned whole: the route's :attr:`GenerationRoute.whole_body`).

    Args:
        completion_id: the response id (``cmpl-...``, ``chatcmpl-...``).
        created: Unix time, s.
        model: the served model's name.
    """

    def __init__(self, completion_id: str, created: int, model: str) -> None:
        self.id, self.created, self.model = completion_id, created, model

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def opening(self) -> list[dict[str, Any]]:
        """Events before the first piece of text (none by default)."""
        return []

    def piece(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """The event carrying ``text`` (and, on the last one, the ``finish_reason``)."""
        raise NotImplementedError

    def usage_event(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last event under ``stream_options.include_usage``: no choices, the usage."""
        raise NotImplementedError


class GenerationRoute(Route):
    """A route of kind ``generate`` (see module docstring)."""

    kind = KINDS["generate"]
    id_prefix = "cmpl"
    whole_body: type[CompletionBody]  # how a completion returned whole renders
    path: str
    response_model: type
    stream_events: str  # what a streamed response's events are, for the OpenAPI schema

    def install(self, app: FastAPI) -> None:
        app.post(self.path, response_model=None, responses=responses(
            self.response_model, *INFERENCE_ERRORS, inference=True, event_stream=(
                f"stream: true: {self.stream_events} (with stream_options.include_usage, a "
                "last one with no choices and the usage; an error after the first event "
                "comes in-band as an ErrorResponse); the last one is `[DONE]`")),
            openapi_extra={"parameters": INFERENCE_PARAMETERS})(self.endpoint)

    async def endpoint(self, body: Any, request: Request) -> Response:
        """The route's handler, with its body's type for FastAPI (subclasses)."""
        raise NotImplementedError

    async def build(self, body: Any, params: GenerationParams, stream: bool) -> InferenceRequest:
        """The validated, tokenized, priced request of ``body``."""
        raise NotImplementedError

    def params(self, body: Any) -> GenerationParams:
        """The sampling parameters ``body`` asks for."""
        raise NotImplementedError

    def reply(self, completion_id: str, created: int, model: str) -> Reply:
        raise NotImplementedError

    async def handle(self, body: GenerationFields, request: Request) -> Response:
        if not body.stream:
            return await super().handle(body, request)
        if request.headers.get("idempotency-key") is not None:
            raise InvalidRequestError("Idempotency-Key is not supported with stream: true",
                                      code="idempotency_key")
        if prefers_async(request.headers) and self.context.jobs is not None:
            raise InvalidRequestError("Prefer: respond-async is not supported with "
                                      "stream: true (a job's result is fetched whole)",
                                      code="stream")
        params, reply = self._checked(body, request_id_of(request))
        inference = await self.build(body, params, True)
        return await self._stream(
            from_client(inference, request), body, reply)

    async def prepare(self, body: GenerationFields, request_id: str) -> Prepared:
        params, reply = self._checked(body, request_id)
        inference = await self.build(body, params, False)
        return Prepared(inference, self.whole_body(reply.id, reply.created, reply.model))

    def _checked(self, body: GenerationFields, request_id: str) -> tuple[GenerationParams, Reply]:
        """The body's parameters (checked against the limits as the request is built) and
        its reply's shapes."""
        context = self.context
        context.check_model(body.model)
        return self.params(body), self.reply(f"{self.id_prefix}-{request_id}",
                                             int(time.time()), context.args.model.name)

    async def _stream(self, inference: InferenceRequest, body: GenerationFields,
                      reply: Reply) -> StreamingResponse:
        """Admission errors come before the first byte, as ordinary HTTP errors, unless the
        request was queued: a queued stream starts at once with SSE comment lines
        (``: queued position=N eta_ms=M``, ignored by SSE clients) while it waits. Anything
        after the first byte goes in-band as a final ``data: {"error": ...}`` event, then
        ``[DONE]``."""
        first, rest = await self.context.client.stream(inference)
        include_usage = body.include_usage

        async def events() -> AsyncIterator[str]:
            for line in render(first, reply, include_usage):
                yield line
            for event in reply.opening():
                yield _sse(event)
            try:
                async for batch in rest:  # one body chunk per batch the replica sent
                    if chunk := "".join(line for item in batch
                                        for line in render(item, reply, include_usage)):
                        yield chunk
            except Exception as exc:  # after the first byte: in-band, never a broken stream
                for line in render(StreamError(as_serve_app_error(exc)), reply, include_usage):
                    yield line
            finally:
                await rest.aclose()
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**first.headers(), "Cache-Control": "no-cache"})


DONE = "data: [DONE]\n\n"
"""The last line of every stream."""


def render(event: StreamEvent, reply: Reply, include_usage: bool) -> list[str]:
    """The server-sent event lines of one stream item (:mod:`serve_app.stream_events`), the
    one place they are written: :class:`Queued`, an SSE comment (``: queued position=N
    eta_ms=M``, ignored by SSE clients); :class:`Admitted`, nothing; :class:`TextPiece`, the
    reply's piece; :class:`Finished`, the piece with the finish reason and, with
    ``include_usage``, the usage event; :class:`StreamError`, the error in-band."""
    match event:
        case Queued(position=position, eta_ms=eta_ms):
            return [f": queued position={position}"
                    f"{'' if eta_ms is None else f' eta_ms={eta_ms}'}\n\n"]
        case Admitted():
            return []
        case TextPiece(text=text):
            return [_sse(reply.piece(text, None))]
        case Finished(finish_reason=finish_reason):
            lines = [_sse(reply.piece("", finish_reason))]
            if include_usage:
                lines.append(_sse(reply.usage_event(event.prompt_tokens,
                                                    event.completion_tokens)))
            return lines
        case StreamError(error=error):
            return [_sse(_in_band(error))]
    raise TypeError(f"not a stream event: {event!r}")


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _in_band(err: ServeAppError) -> dict[str, Any]:
    """The error event of a stream already started: the error body, and for a refusal (a
    queued stream that was not admitted in time) its wait, ``retry_after_ms``, since the
    headers that would carry it are gone."""
    body = err.to_body()
    if err.retry_after_ms is not None:
        body["error"]["retry_after_ms"] = err.retry_after_ms
    return body
