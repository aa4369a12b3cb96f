"""HTTP metrics of the ingress: responses by route and status, and their duration.

A plain ASGI middleware (no ``BaseHTTPMiddleware``: it would buffer streamed responses). The
route label is the matched route's path template (``/v1/embeddings``), or ``other`` for
paths no route matched, so the label stays bounded whatever clients send.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.metrics import ProcessMetrics


class HttpMetricsMiddleware:
    """Counts every HTTP response (``http_requests_total``) and observes its duration up to
    the last body byte (``http_request_seconds``). A client that leaves before the response
    starts is counted with status ``499`` (nginx's "client closed request")."""

    def __init__(self, app: ASGIApp, metrics: ProcessMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = time.monotonic()
        status = 499

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", None) or "other"
            self._metrics.inc("http_requests", route=route, status=str(status))
            self._metrics.observe("http_request_seconds", time.monotonic() - started,
                                  route=route)
