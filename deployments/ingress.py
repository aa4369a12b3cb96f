"""The HTTP ingress: OpenAI-compatible routes in a FastAPI app inside a Ray Serve deployment.

It assembles the ingress's parts and serves the routes that are not inference: the inference
routes (one per request kind the engine serves, :mod:`deployments.routes`) validate,
tokenize and price a request once (:class:`~deployments.request_factory.RequestFactory`),
send it to a model replica (:class:`~deployments.model_client.ModelClient`), run keyed
requests once (:class:`~deployments.idempotency_guard.IdempotencyGuard`) and render OpenAI's
shapes; errors become HTTP only in :mod:`deployments.http_errors`. Ray Serve's proxy already
reads or assigns ``X-Request-Id`` and echoes it on every response.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import asyncio
import logging
import time
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.engines.registry import engine_class
from deployments.http_errors import error_response, install_error_handlers
from deployments.http_middleware import (
    BearerAuth,
    BodyLimitMiddleware,
    HeadMiddleware,
    HttpMetricsMiddleware,
)
from deployments.idempotency_guard import IdempotencyGuard
from deployments.job_broker import open_job_store
from deployments.jobs_http import JobsFront
from deployments.model_client import ModelClient
from deployments.openapi import responses
from deployments.registry import publish_forever
from deployments.replica_view import ReplicaView
from deployments.request_factory import RequestFactory
from deployments.routes import ROUTES, Route, RouteContext
from serve_app.admission.policy import policy_class
from serve_app.config import AppArgs, parse_args
from serve_app.errors import OverloadedError
from serve_app.metrics import ProcessMetrics, merge_expositions
from serve_app.schemas import HealthResponse, ModelList, ReadyResponse, StatusResponse

logger = logging.getLogger("ray.serve")


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """OpenAI-compatible HTTP front of one model deployment.

    Args:
        args: the validated config.
        model: handle to the :class:`deployments.model_server.ModelServer` deployment.
        registry: handle to :class:`deployments.registry.ReplicaRegistry`.
        idempotency: handle to :class:`deployments.idempotency.IdempotencyStore`.
        jobs: handle to the embedded :class:`deployments.job_broker.JobBroker`, or ``None``
            (``jobs.redis_url`` set, or jobs off).
    """

    async def __init__(self, args: AppArgs | dict[str, Any], model: DeploymentHandle,
                       registry: DeploymentHandle, idempotency: DeploymentHandle,
                       jobs: DeploymentHandle | None = None) -> None:
        self._args = args = parse_args(args)
        self._registry = registry
        self._created = int(time.time())
        context = serve.get_replica_context()
        self._replica_id = context.replica_id.unique_id if context else "local"
        self._metrics = ProcessMetrics(context.deployment if context else "Ingress",
                                       self._replica_id)
        adm = args.admission
        self._replicas = ReplicaView(registry, policy_class(adm.policy), adm.max_queue_wait_s)
        self._client = ModelClient(model, self._replicas, adm.max_queue_wait_s, self._metrics,
                                   args.deployment.max_replicas
                                   if args.deployment.autoscaling else None,
                                   adm.refuse_predicted_waits)
        self._engine = engine_class(args)
        front_end = await asyncio.to_thread(self._engine.front_end, args)
        guard = IdempotencyGuard(idempotency, self._client,
                                 adm.max_queue_wait_s + adm.inference_timeout_s + 5,
                                 self._metrics)
        self._front_end = front_end
        routes_by_path: dict[str, Route] = {}
        self._jobs = JobsFront(await open_job_store(args, jobs), routes_by_path,
                               self._replicas) if args.jobs.enabled else None
        context = RouteContext(args, RequestFactory(args, front_end), self._client, guard,
                               self._jobs)
        self._route_list = [route(context) for route in ROUTES
                            if route.kind in self._engine.kinds]
        routes_by_path.update({route.path: route for route in self._route_list})
        self._publisher = asyncio.get_running_loop().create_task(
            publish_forever(registry, self._replica_id, self._metrics))

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray Serve calls this after ``__init__``; the routes close over this replica."""
        args = self._args
        app = FastAPI(title="vramgate",
                      description="Memory-budget admission for model serving on Ray Serve.",
                      dependencies=[Depends(BearerAuth(args.auth.resolved_key()))])
        app.add_middleware(BodyLimitMiddleware, max_body_bytes=args.limits.max_body_bytes)
        app.add_middleware(HttpMetricsMiddleware, metrics=self._metrics)
        app.add_middleware(HeadMiddleware)  # outermost: the others see a GET
        install_error_handlers(app)
        for route in self._route_list:
            route.install(app)
        if self._jobs is not None:
            self._jobs.install(app)
        app.get("/v1/models", response_model=None,
                responses=responses(ModelList, 401))(self.models)
        app.get("/v1/status", response_model=None,
                responses=responses(StatusResponse, 401))(self.status)
        app.get("/metrics", response_model=None, responses={
            200: {"description": "Prometheus text exposition (version 0.0.4)",
                  "content": {"text/plain": {"schema": {"type": "string"}}}},
            401: responses(HealthResponse, 401)[401]})(self.metrics)
        app.get("/healthz", response_model=None,
                responses=responses(HealthResponse))(self.healthz)
        app.get("/readyz", response_model=None,
                responses=responses(ReadyResponse, 503))(self.readyz)
        return app

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``."""
        return {"object": "list", "data": [{
            "id": self._args.model.name, "object": "model", "created": self._created,
            "owned_by": "vramgate", "root": self._engine.profile_identity(self._args),
            "max_model_len": self._front_end.max_seq_tokens}]}

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``: every live model replica's admission state."""
        states = await self._replicas.states()
        return {"model": self._args.model.name, "engine": self._args.model.engine_name,
                "max_seq_tokens": self._front_end.max_seq_tokens, **self._front_end.describe(),
                "replicas": [s.to_status() for s in states]}

    async def metrics(self) -> Response:
        """``GET /metrics``: the project's metrics of every ingress and model replica, in
        Prometheus text format (see :mod:`serve_app.metrics`). Every process's series come
        from what it last published to the registry (at most one publish period old), so
        scrapes answered by different ingress replicas agree and counters never go back."""
        texts = await self._client.call(self._registry.metrics)
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)

    async def healthz(self) -> dict[str, str]:
        """``GET /healthz`` (and ``HEAD``, :class:`HeadMiddleware`): 200 while the ingress
        runs."""
        return {"status": "ok"}

    async def readyz(self) -> JSONResponse:
        """``GET /readyz`` (and ``HEAD``): 200 once a model replica has loaded and measured its
        model, 503 ``no_replicas`` before."""
        states = await self._replicas.states()
        if not states:
            return error_response(OverloadedError(
                "no model replica has loaded and measured its model yet", code="no_replicas",
                retry_after_s=1))
        return JSONResponse({"status": "ready", "replicas": len(states)})

    def __del__(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.cancel()
