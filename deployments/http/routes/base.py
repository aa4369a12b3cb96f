"""What every inference route is given, and the route interface."""

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from deployments.http.http_middleware import priority_of, tenant_of
from deployments.http.idempotency_guard import IdempotencyGuard
from deployments.http.model_client import ModelClient
from deployments.http.request_factory import RequestFactory
from serve_app.client_wait import client_wait_limit_s, prefers_async
from serve_app.config import AppArgs
from serve_app.errors import ModelNotFoundError
from serve_app.kinds import RequestKind
from serve_app.request import InferenceRequest
from serve_app.schemas import InferenceResult


@dataclass(frozen=True)
class RouteContext:
    """The ingress's parts a route uses.

    Attributes:
        args: the config.
        factory: builds validated, tokenized, priced requests.
        client: sends them to the model replicas.
        guard: runs keyed requests once (``Idempotency-Key``).
        jobs: accepts ``Prefer: respond-async`` requests as durable jobs
            (:class:`deployments.http.jobs_http.JobsFront`), or ``None`` (``jobs.enabled: false``).
        models: every model the ingress serves
            (:class:`deployments.http.served_models.ServedModels`): a request goes to the route of
            the model it names; ``None`` (a model replica's routes): this one.
    """

    args: AppArgs
    factory: RequestFactory
    client: ModelClient
    guard: IdempotencyGuard
    jobs: Any = None
    models: Any = None

    def check_model(self, requested: str | None) -> None:
        """Raises ModelNotFoundError (404) for a ``model`` other than the one served."""
        served = self.args.model.name
        if requested is not None and requested != served:
            raise ModelNotFoundError(f"model {requested!r} is not served here; this "
                                     f"deployment serves {served!r}")


@dataclass(frozen=True)
class Prepared:
    """A route's request, validated and built, and how its result becomes the route's
    response body (``render``: :class:`~serve_app.schemas.InferenceResult` -> JSON body; a
    :class:`~serve_app.responses.ResponseBody` for every route a durable job may name, which
    is stored with the job)."""

    request: InferenceRequest
    render: Callable[[InferenceResult], dict[str, Any]]


class Route:
    """One OpenAI-compatible inference route of one request kind.

    A route's work is :meth:`prepare` (validate, build, and say how the result renders):
    the same for a request answered at once (:meth:`respond`) and for one submitted as a
    durable job (:mod:`deployments.http.jobs_http`, which stores what it prepared for the model
    replica), so that a job's result is the route's normal body.

    Args:
        context: the ingress's parts.
    """

    kind: ClassVar[RequestKind]
    path: ClassVar[str]
    body_model: ClassVar[type[BaseModel]]

    def __init__(self, context: RouteContext) -> None:
        self.context = context

    def install(self, app: FastAPI) -> None:
        """Add the route (and its OpenAPI declaration) to ``app``."""
        raise NotImplementedError

    async def prepare(self, body: Any, request_id: str) -> Prepared:
        """Validate ``body`` and build its request (``request_id``: the response's id).

        Raises:
            ServeAppError: 400/404 for a body this route refuses."""
        raise NotImplementedError

    async def dispatch(self, body: Any, request: Request) -> Response:
        """The endpoint: :meth:`handle` on this route of the model the body names
        (``request.state.model`` records which, for the HTTP metrics).

        Raises:
            ModelNotFoundError, InvalidRequestError: as
                :meth:`deployments.http.served_models.ServedModels.route`."""
        models = self.context.models
        route = self if models is None else \
            models.route(self.path, getattr(body, "model", None))
        request.state.model = route.context.args.model.name
        return await route.handle(body, request)

    async def handle(self, body: Any, request: Request) -> Response:
        """The route's answer: a job (``Prefer: respond-async``, 202) or the response, a
        keyed request run once."""
        if prefers_async(request.headers) and self.context.jobs is not None:
            return await self.context.jobs.submit(self.path, body, request)
        return await self.context.guard.run(request, body,
                                            lambda: self.respond(body, request))

    async def respond(self, body: Any, request: Request) -> JSONResponse:
        """Run ``body`` on a model replica now; the client's wait limit from its headers
        (:func:`serve_app.client_wait.client_wait_limit_s`)."""
        prepared = await self.prepare(body, request_id_of(request))
        result = await self.context.client.infer(from_client(prepared.request, request))
        return JSONResponse(prepared.render(result), headers=result.admitted.headers())


def from_client(inference: InferenceRequest, request: Request) -> InferenceRequest:
    """``inference`` with what the client's HTTP request says of it: how long it will wait
    (:func:`serve_app.client_wait.client_wait_limit_s`), its tenant (its key's) and its
    priority class (:func:`deployments.http.http_middleware.priority_of`)."""
    return replace(inference, wait_limit_s=client_wait_limit_s(request.headers),
                   tenant=tenant_of(request), priority=priority_of(request))


def request_id_of(request: Request) -> str:
    """The request's ``X-Request-Id`` (Ray Serve's proxy sets one), else a new id."""
    return request.headers.get("x-request-id", uuid.uuid4().hex)
