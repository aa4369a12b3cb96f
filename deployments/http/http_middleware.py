"""The ingress's request guards: the body limit, HTTP metrics and ``HEAD`` answered as ``GET``
(plain ASGI middlewares; no ``BaseHTTPMiddleware``: it would buffer streamed responses), and
the API key (a FastAPI dependency of every route)."""

from __future__ import annotations

import hmac
import time
from collections.abc import Mapping

from fastapi import Request
from ray.exceptions import TaskCancelledError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.http.http_errors import error_response
from serve_app.admission.fair import DEFAULT_TENANT
from serve_app.admission.priority import Priority
from serve_app.client_wait import client_priority
from serve_app.errors import AuthenticationError, BodyTooLargeError
from serve_app.metrics import ProcessMetrics


class HttpMetricsMiddleware:
    """Counts every HTTP response (``http_requests_total``) and observes its duration up to
    the last body byte (``http_request_seconds``), labelled with the model the ingress chose
    for it (``request.state.model``; empty for routes of no one model). A client that leaves
    before the response starts is counted with status ``499`` (nginx's "client closed
    request")."""

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
            # The model the request named, once the ingress has chosen it (request.state).
            model = str(scope.get("state", {}).get("model", ""))
            self._metrics.inc("http_requests", route=route, status=str(status), model=model)
            self._metrics.observe("http_request_seconds", time.monotonic() - started,
                                  route=route, model=model)


class HeadMiddleware:
    """Answers ``HEAD`` on every ``GET`` route as ``GET`` does, without the body (RFC 9110
    9.3.2: the same status and headers, ``Content-Length`` included): load balancers and uptime
    monitors probe ``/healthz`` and ``/readyz`` with ``HEAD``, which FastAPI's ``GET`` routes
    would refuse with 405. The OpenAPI document keeps listing ``GET`` only."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self._app(scope, receive, send)
            return

        async def send_without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # one empty body message, at the end
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self._app({**scope, "method": "GET"}, receive, send_without_body)


class BodyLimitMiddleware:
    """Refuses bodies over ``max_body_bytes`` with 413: at once when ``Content-Length`` says
    so, else as soon as the streamed (chunked) body passes the limit. A body within the limit
    is read here and handed on whole; later ``receive`` calls (disconnects) pass through,
    a receive Ray Serve cancelled as the disconnect it is (:func:`receive_or_disconnect`).

    A path of ``streamed`` (``/v1/files``: uploads of up to ``jobs.batch_max_file_bytes``)
    has its own limit and its body is not read here: it streams on to the route, counted,
    a receive past the limit raising :class:`BodyTooLargeError` (413).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int,
                 streamed: Mapping[str, int] | None = None) -> None:
        self._app = app
        self._max_body_bytes = max_body_bytes
        self._streamed = dict(streamed or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self._streamed.get(route_path(scope))
        knob = "limits.max_body_bytes" if limit is None else "jobs.batch_max_file_bytes"
        too_large = error_response(BodyTooLargeError(
            f"the body exceeds {knob} = {limit or self._max_body_bytes} bytes"))
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > (limit or self._max_body_bytes):
            await too_large(scope, receive, send)
            return
        if limit is not None:
            await self._app(scope, _counted(receive, limit, knob), send)
            return
        chunks, size = [], 0
        while True:
            message = await receive_or_disconnect(receive)
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body_bytes:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive_or_disconnect(receive)
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self._app(scope, replay, send)


def _counted(receive: Receive, limit: int, knob: str) -> Receive:
    """``receive`` that raises :class:`BodyTooLargeError` once the body passes ``limit``."""
    size = 0

    async def counted() -> Message:
        nonlocal size
        message = await receive_or_disconnect(receive)
        size += len(message.get("body", b""))
        if size > limit:
            raise BodyTooLargeError(f"the body exceeds {knob} = {limit} bytes")
        return message

    return counted


async def receive_or_disconnect(receive: Receive) -> Message:
    """``receive()``, a receive Ray Serve cancelled answered as ``http.disconnect``: when a
    client leaves, Ray's proxy cancels the ingress's pull of the request's messages, and the
    replica's ``receive`` raises ``ray.exceptions.TaskCancelledError`` (where the proxy has
    already dropped the request, Ray itself answers ``http.disconnect``). Either way the
    client is gone, and Starlette ends the response as a disconnect (a streamed one from its
    ``listen_for_disconnect``), not as an error."""
    try:
        return await receive()
    except TaskCancelledError:
        return {"type": "http.disconnect"}


def route_path(scope: Scope) -> str:
    """The request's path below the app's prefix: ``scope["path"]`` without
    ``scope["root_path"]`` (Ray Serve's ``route_prefix``; ASGI servers put it in both, and
    FastAPI routes on what is left), e.g. ``/v1/embeddings`` for ``/api/v1/embeddings``
    under ``/api``."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("/", ""):
        return path[len(root):] or "/"
    return path


class BearerAuth:
    """Every route but the probes needs ``Authorization: Bearer <key>`` when a key is
    configured (``auth.*``); the key names the request's tenant
    (:meth:`serve_app.auth_config.AuthConfig.tenant_keys`). Keys are compared in constant
    time (``hmac.compare_digest``, each one).

    Args:
        tenant_keys: every key and its tenant (empty: no key; every request is the default
            tenant).
    """

    PROBES = ("/healthz", "/readyz")

    def __init__(self, tenant_keys: Mapping[str, str]) -> None:
        self._keys = [(key.encode(), tenant) for key, tenant in tenant_keys.items()]

    async def __call__(self, request: Request) -> None:
        """Raises AuthenticationError (401) for a missing or wrong key."""
        if not self.accepts(route_path(request.scope),
                            request.headers.get("authorization", "")):
            raise AuthenticationError("missing or invalid API key (send Authorization: "
                                      "Bearer <key>)")

    def accepts(self, path: str, authorization: str) -> bool:
        """Whether a request to ``path`` (below the app's prefix: :func:`route_path`) with
        this ``Authorization`` header may pass."""
        return not self._keys or path in self.PROBES or self.tenant(authorization) is not None

    def tenant(self, authorization: str) -> str | None:
        """The tenant this ``Authorization`` header's key names: the default tenant when no
        key is configured, ``None`` for a missing or unknown key."""
        if not self._keys:
            return DEFAULT_TENANT
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        found = None
        for key, tenant in self._keys:  # every key compared: the time says nothing
            if hmac.compare_digest(given.strip().encode(), key):
                found = tenant
        return found


class TenantMiddleware:
    """Names each HTTP request's tenant from its key (:meth:`BearerAuth.tenant`) in
    ``request.state.tenant`` (and the tenant's configured priority class in
    ``request.state.priority``), for the routes, the request log and the metrics, and answers
    it in the ``X-Tenant`` response header. A request whose key is missing or unknown has
    none (the key check refuses it with 401).

    Args:
        app: the ASGI app behind.
        auth: the app's key check.
        priorities: the tenants' configured priority classes
            (:meth:`serve_app.auth_config.AuthConfig.priorities`).
    """

    def __init__(self, app: ASGIApp, auth: BearerAuth,
                 priorities: Mapping[str, Priority] | None = None) -> None:
        self._app, self._auth, self._priorities = app, auth, dict(priorities or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = None
        if scope["type"] == "http":
            authorization = next((v.decode("latin-1") for k, v in scope["headers"]
                                  if k == b"authorization"), "")
            tenant = self._auth.tenant(authorization)
        if tenant is None:
            await self._app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["tenant"] = tenant
        if tenant in self._priorities:
            state["priority"] = self._priorities[tenant]

        async def send_with_tenant(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-tenant", tenant.encode())]}
            await send(message)

        await self._app(scope, receive, send_with_tenant)


def tenant_of(request: Request) -> str:
    """The request's tenant (:class:`TenantMiddleware`), the default one if none."""
    return getattr(request.state, "tenant", DEFAULT_TENANT)


def priority_of(request: Request, default: Priority = Priority.INTERACTIVE) -> Priority:
    """The request's priority class: the client's ``Prefer: priority=...``
    (:func:`serve_app.client_wait.client_priority`), else its tenant's configured one
    (:class:`TenantMiddleware`), else ``default`` (``batch`` for durable jobs)."""
    return client_priority(request.headers) or getattr(request.state, "priority", default)
