"""The HTTP ingress: OpenAI-compatible routes in a FastAPI app inside a Ray Serve deployment.

It assembles the ingress's parts and serves the routes that are not inference: the inference
routes (one per request kind an engine serves, :mod:`deployments.http.routes`; each request goes to
the model it names, :mod:`deployments.http.served_models`) validate,
tokenize and price a request once (:class:`~deployments.http.request_factory.RequestFactory`),
send it to a model replica (:class:`~deployments.http.model_client.ModelClient`), run keyed
requests once (:class:`~deployments.http.idempotency_guard.IdempotencyGuard`) and render OpenAI's
shapes; errors become HTTP only in :mod:`deployments.http.http_errors`. Ray Serve's proxy already
reads or assigns ``X-Request-Id`` and echoes it on every response. Its models are opened in
the background (:mod:`deployments.http.ingress_opening`): the probes answer from its start.
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
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from deployments.cluster.replica_registry import publish_forever
from deployments.http.batches_http import BatchesRoutes
from deployments.http.early_refusal import EarlyRefusalMiddleware
from deployments.http.http_errors import error_response, install_error_handlers
from deployments.http.http_middleware import (
    BearerAuth,
    BodyLimitMiddleware,
    HeadMiddleware,
    HttpMetricsMiddleware,
    TenantMiddleware,
)
from deployments.http.ingress_opening import Opening, OpeningGate
from deployments.http.jobs_http import JobsRoutes
from deployments.http.openapi import responses
from deployments.http.served_models import ModelBinding, ServedModels, open_model_front
from serve_app.config import parse_args
from serve_app.errors import OverloadedError
from serve_app.metrics import ProcessMetrics, merge_expositions
from serve_app.schemas import HealthResponse, ModelList, ReadyResponse, StatusResponse

logger = logging.getLogger("ray.serve")

READYZ_WAIT_S = 0.5
"""The longest ``/readyz`` waits for the registry's snapshot of the model replicas: a
registry that is not running yet (or restarting) must not hold a probe; it answers from what
it has (nothing yet: 503)."""


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """OpenAI-compatible HTTP front of the app's model deployments: one, or several
    (``args.models``), a request going to the model it names
    (:class:`deployments.http.served_models.ServedModels`).

    Args:
        models: each model's args and handles (:class:`ModelBinding`), in config order; the
            first's app-wide sections (auth, logging, jobs) are the app's.
        registry: handle to :class:`deployments.cluster.replica_registry.ReplicaRegistry`.
        idempotency: handle to :class:`deployments.cluster.idempotency_store.IdempotencyStore`.
    """

    async def __init__(self, models: list[ModelBinding], registry: DeploymentHandle,
                       idempotency: DeploymentHandle) -> None:
        self._registry = registry
        self._created = int(time.time())
        context = _replica_context()
        self._replica_id = context.replica_id.unique_id if context else "local"
        self._metrics = ProcessMetrics(context.deployment if context else "Ingress",
                                       self._replica_id, use_ray=context is not None)
        self._models = ServedModels()
        self._model_args = [parse_args(binding.args) for binding in models]
        self._args = self._model_args[0]
        self._jobs = JobsRoutes(self._models) if self._args.jobs.enabled else None
        self._batches = None if self._jobs is None else \
            BatchesRoutes(self._jobs, self._args.jobs, self._metrics)
        self._app: FastAPI | None = None
        # Returns at once: Ray Serve routes to this replica only once __init__ has returned.
        self._opening = Opening(self._open(models, registry, idempotency))
        self._publisher = asyncio.get_running_loop().create_task(
            publish_forever(registry, self._replica_id, self._metrics))

    async def _open(self, models: list[ModelBinding], registry: DeploymentHandle,
                    idempotency: DeploymentHandle) -> None:
        """Each model's engine, tokenizer and job store (:func:`open_model_front`), in order;
        then its inference routes, if the app is built already (else as it is built)."""
        for binding in models:
            await open_model_front(binding, registry, idempotency, self._metrics, self._models)
        if self._batches is not None:  # in the first model's job store
            self._batches.open(self._models.fronts[0].jobs.store)
        if self._app is not None:
            self._install_inference_routes(self._app)

    def _install_inference_routes(self, app: FastAPI) -> None:
        """The models' inference routes (their engines' kinds: known once the engines are
        imported, which takes seconds with torch), and the project's routes no model here
        serves (404 ``model_not_found``). Added to the running app: no request
        reaches the routes before (:class:`OpeningGate`), and FastAPI writes the OpenAPI
        schema when it is first asked for, after."""
        for route in self._models.installed_routes():
            route.install(app)
        self._models.install_unserved(app)

    async def check_health(self) -> None:
        """Ray Serve's health check: fails once opening the models has failed (Ray Serve then
        replaces this replica).

        Raises:
            Exception: what opening the models raised.
        """
        if (failure := self._opening.failure()) is not None:
            raise failure

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray Serve calls this after ``__init__``; the routes close over this replica."""
        args = self._args
        auth = BearerAuth(args.auth.tenant_keys())
        app = FastAPI(title="vramgate",
                      description="Memory-budget admission for model serving on Ray Serve.",
                      dependencies=[Depends(auth)])
        app.add_middleware(BodyLimitMiddleware, max_body_bytes=max(
            args.limits.max_body_bytes for args in self._model_args), streamed={
            "/v1/files": args.jobs.batch_max_file_bytes} if self._batches else None)
        # Before the body is read: refusals by prediction under overload skip it.
        app.add_middleware(EarlyRefusalMiddleware, models=self._models, auth=auth)
        # Before any part that needs the models open: the probes alone pass before.
        app.add_middleware(OpeningGate, opening=self._opening)
        app.add_middleware(TenantMiddleware, auth=auth,
                           priorities=args.auth.priorities())
        app.add_middleware(HttpMetricsMiddleware, metrics=self._metrics)
        app.add_middleware(HeadMiddleware)  # outermost: the others see a GET
        install_error_handlers(app)
        self._app = app
        if self._opening.done and self._opening.failure() is None:
            self._install_inference_routes(app)
        if self._jobs is not None:
            self._jobs.install(app)
        if self._batches is not None:
            self._batches.install(app)
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
        """``GET /v1/models``: every served model, in config order."""
        return {"object": "list", "data": [{
            "id": front.name, "object": "model", "created": self._created,
            "owned_by": "vramgate", "root": front.engine.profile_identity(front.args),
            "max_model_len": front.front_end.max_seq_tokens}
            for front in self._models.fronts]}

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``: every live model replica's admission state (``replicas``, each
        naming its ``model``) and each served model (``models``); an app of one model also
        names it at the top (``model``, ``engine``, ``max_seq_tokens``)."""
        models = [{"model": front.name, "engine": front.args.model.engine_name,
                   "max_seq_tokens": front.front_end.max_seq_tokens,
                   **front.front_end.describe()} for front in self._models.fronts]
        states = await self._models.states()
        single = models[0] if len(models) == 1 else {}
        return {**single, "models": models, "replicas": [s.to_status() for s in states]}

    async def metrics(self) -> Response:
        """``GET /metrics``: the project's metrics of every ingress and model replica, in
        Prometheus text format (see :mod:`serve_app.metrics`). Every process's series come
        from what it last published to the registry (at most one publish period old), so
        scrapes answered by different ingress replicas agree and counters never go back."""
        texts = await self._models.fronts[0].client.call(self._registry.metrics)
        # Parsing and writing every process's series takes tens of milliseconds on a busy
        # node: off the event loop, so that requests are not held up by each scrape (load
        # test: /metrics took 76 ms at the median, 160 ms at p90, scraped every second).
        merged = await asyncio.to_thread(merge_expositions, texts)
        return Response(merged, media_type=CONTENT_TYPE_LATEST)

    async def healthz(self) -> dict[str, str]:
        """``GET /healthz`` (and ``HEAD``, :class:`HeadMiddleware`): 200 while the ingress
        runs."""
        return {"status": "ok"}

    async def readyz(self) -> JSONResponse:
        """``GET /readyz`` (and ``HEAD``): 200 once every served model has a replica that has
        loaded and measured its model; at once, whatever is still starting: 503 ``starting``
        while this ingress opens its models (:class:`Opening`), 503 ``no_replicas`` (naming
        the models without) while a model has no such replica, or while the registry has
        not answered within ``READYZ_WAIT_S``."""
        if (starting := self._opening.not_ready()) is not None:
            return error_response(starting)
        states = await self._models.states(max_wait_s=READYZ_WAIT_S)
        waiting = [name for name in self._models.names
                   if not any(s.model == name for s in states)]
        if waiting:
            return error_response(OverloadedError(
                f"no model replica of {waiting} has loaded and measured its model yet",
                code="no_replicas", retry_after_s=1))
        return JSONResponse({"status": "ready", "replicas": len(states)})

    def __del__(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.cancel()
        if getattr(self, "_opening", None) is not None:
            self._opening.cancel()
        if getattr(self, "_batches", None) is not None:
            self._batches.stop()


def _replica_context() -> Any:
    """Ray Serve's context of this replica; ``None`` outside one (tests)."""
    try:
        return serve.get_replica_context()
    except RayServeException:
        return None
