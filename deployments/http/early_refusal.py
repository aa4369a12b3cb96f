"""Refusal by prediction before the body is read: the ingress's load shedding.

Under overload most requests are refused by prediction (503 ``predicted_timeout``), and on
Ray Serve each of them costs a round trip to the proxy for its body (Ray's proxy hands the
body over on request), JSON parsing and validation, and tokenizing before the ingress's check
(:meth:`deployments.http.model_client.ModelClient.predicted_refusal`). Every one of those refusals
is decided here, from the headers alone, when even the smallest request
(:data:`serve_app.planning.SMALLEST_SHAPE`) could not start in time: the predicted wait grows
with the price, so the body could only make it longer. What is let through is checked again at
its real price, and again by the replica.

Not refused here (left to the normal path, which reads the body): a route several models of
the app serve (which model the body names is not known yet), a keyed request
(``Idempotency-Key``: a retry of a finished one is answered from the store), a
``Prefer: respond-async`` one (a durable job waits in its queue instead), and a request whose
API key is missing or wrong (401 comes first).
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.http.http_errors import error_response
from deployments.http.http_middleware import BearerAuth, route_path
from deployments.http.served_models import ModelFront, ServedModels
from serve_app.admission.fair import DEFAULT_TENANT
from serve_app.client_wait import client_wait_limit_s, prefers_async
from serve_app.errors import OverloadedError
from serve_app.planning import SMALLEST_SHAPE


class EarlyRefusalMiddleware:
    """Answers 503 ``predicted_timeout`` (with ``Retry-After``) to an inference request that
    could not start in time whatever its body (see module docstring), before its body is
    read; the request's model is recorded for the HTTP metrics (``scope["state"]``).

    Args:
        app: the ASGI app it wraps (the body limit, then FastAPI).
        models: the ingress's models.
        auth: the app's API-key check.
    """

    def __init__(self, app: ASGIApp, models: ServedModels, auth: BearerAuth) -> None:
        self._app, self._models, self._auth = app, models, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = None
        if scope["type"] == "http" and scope["method"] == "POST":
            refused = await self._refusal(scope)
        if refused is None:
            await self._app(scope, receive, send)
            return
        front, error = refused
        scope.setdefault("state", {})["model"] = front.name
        await error_response(error)(scope, receive, send)

    async def _refusal(self, scope: Scope) -> tuple[ModelFront, OverloadedError] | None:
        path = route_path(scope)
        serving = self._models.serving(path)
        if len(serving) != 1:
            return None
        headers = Headers(scope=scope)
        if ("idempotency-key" in headers or prefers_async(headers)
                or not self._auth.accepts(path, headers.get("authorization", ""))):
            return None
        [front] = serving
        error = await front.client.shape_refusal(
            SMALLEST_SHAPE, client_wait_limit_s(headers), front.routes[path].kind.generates,
            scope.get("state", {}).get("tenant", DEFAULT_TENANT))
        return None if error is None else (front, error)
