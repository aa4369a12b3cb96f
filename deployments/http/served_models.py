"""The models one ingress serves: each model's parts (:class:`ModelFront`), and the choice of
one by the request's ``model`` (:class:`ServedModels`).

An app serves one model, or several (``args.models``, :mod:`serve_app.app_config`), each its
own model deployment. The ingress keeps, per model, what pricing and sending a request needs
(the engine's front end, the view of that model's replicas, the client of its deployment, its
routes, its jobs) and installs each HTTP route once: a request goes to the routes of the
model it names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from ray.serve.handle import DeploymentHandle

from deployments.cluster.job_broker import open_job_store
from deployments.engines.registry import engine_class
from deployments.engines.spec import EngineSpec, FrontEnd
from deployments.http.idempotency_guard import IdempotencyGuard
from deployments.http.jobs_http import JobsFront
from deployments.http.model_client import ModelClient
from deployments.http.replica_view import ReplicaView
from deployments.http.request_factory import RequestFactory
from deployments.http.routes import ROUTES, Route, RouteContext
from serve_app.admission.policy import policy_class
from serve_app.config import AppArgs, parse_args
from serve_app.errors import InvalidRequestError, ModelNotFoundError
from serve_app.metrics import ProcessMetrics
from serve_app.replica_state import ReplicaState


@dataclass(frozen=True)
class ModelBinding:
    """What ``build_app`` gives the ingress for one model: its args, the handle of its
    model deployment and of its embedded job broker (``None``: ``jobs.redis_url`` or jobs
    off)."""

    args: AppArgs | dict[str, Any]
    handle: DeploymentHandle
    broker: DeploymentHandle | None = None


@dataclass(kw_only=True)
class ModelFront:
    """One served model's parts in the ingress.

    Attributes:
        args: its validated args.
        engine: its engine class.
        front_end: its tokenizer and context (:meth:`EngineSpec.front_end`).
        replicas: the view of its replicas only.
        client: sends requests to its model deployment.
        routes: its inference routes, by path.
        jobs: its durable jobs, or ``None`` (``jobs.enabled: false``).
    """

    args: AppArgs
    engine: type[EngineSpec]
    front_end: FrontEnd
    replicas: ReplicaView
    client: ModelClient
    routes: dict[str, Route]
    jobs: JobsFront | None

    @property
    def name(self) -> str:
        return self.args.model.name


async def open_model_front(binding: ModelBinding, registry: DeploymentHandle,
                           idempotency: DeploymentHandle, metrics: ProcessMetrics,
                           served: ServedModels) -> ModelFront:
    """Build one model's :class:`ModelFront` (loads its tokenizer; connects to its job store,
    waiting for it: :func:`deployments.cluster.job_broker.open_job_store`) and add it to ``served``,
    which its routes pick the request's model from.

    Raises:
        serve_app.config.ConfigError: its engine cannot be resolved.
        redis.exceptions.ConnectionError: its job store does not answer.
    """
    args = parse_args(binding.args)
    adm, metrics = args.admission, metrics.for_model(args.model.name)
    replicas = ReplicaView(registry, policy_class(adm.policy),
                           adm.max_queue_wait_s, model=args.model.name)
    client = ModelClient(binding.handle, replicas, adm.max_queue_wait_s, metrics,
                         args.deployment.max_replicas if args.deployment.autoscaling else None,
                         adm.refuse_predicted_waits)
    engine = await asyncio.to_thread(engine_class, args)  # imports torch: off the loop
    front_end = await asyncio.to_thread(engine.front_end, args)
    guard = IdempotencyGuard(idempotency, client,
                             adm.max_queue_wait_s + adm.inference_timeout_s + 5, metrics)
    routes: dict[str, Route] = {}
    jobs = JobsFront(await open_job_store(args, binding.broker), routes, replicas) \
        if args.jobs.enabled else None
    context = RouteContext(args, RequestFactory(args, front_end), client, guard, jobs, served)
    routes.update({route.path: route(context) for route in ROUTES
                   if route.kind.name in engine.kinds})
    front = ModelFront(args=args, engine=engine, front_end=front_end, replicas=replicas,
                       client=client, routes=routes, jobs=jobs)
    served.add(front)
    if jobs is not None:  # jobs stored by an earlier release, in the background
        jobs.start_rebuilding()
    return front


class ServedModels:
    """The models of one ingress, in config order; every route is the route of some model.

    Args:
        fronts: one per model (names unique: :func:`serve_app.app_config.parse_models`).
    """

    def __init__(self, fronts: Sequence[ModelFront] = ()) -> None:
        self.fronts: list[ModelFront] = []
        self.by_name: dict[str, ModelFront] = {}
        for front in fronts:
            self.add(front)

    def add(self, front: ModelFront) -> None:
        self.fronts.append(front)
        self.by_name[front.name] = front

    @property
    def names(self) -> list[str]:
        return [front.name for front in self.fronts]

    def paths(self) -> list[str]:
        """Every inference route's path, each once, in the order of :data:`ROUTES`."""
        served = {path for front in self.fronts for path in front.routes}
        return [route.path for route in ROUTES if route.path in served]

    def installed_routes(self) -> list[Route]:
        """One route per path (the first model's that serves it): the one FastAPI installs;
        its :meth:`~deployments.http.routes.base.Route.dispatch` hands each request on to the
        named model's."""
        return [next(front.routes[path] for front in self.fronts if path in front.routes)
                for path in self.paths()]

    def serving(self, path: str) -> list[ModelFront]:
        """The models whose inference routes include ``path``, in config order."""
        return [front for front in self.fronts if path in front.routes]

    def route(self, path: str, requested: str | None) -> Route:
        """The route at ``path`` of the model ``requested`` names; with no ``model``, of the
        one model that serves ``path``.

        Raises:
            ModelNotFoundError: no served model of that name, or it does not serve ``path``
                (404, naming what is served).
            InvalidRequestError: no ``model`` while several models serve ``path`` (400).
        """
        serving = self.serving(path)
        if requested is None and len(serving) == 1:
            return serving[0].routes[path]
        if requested is None and serving:
            raise InvalidRequestError(
                f"model is required: {path} is served by {[f.name for f in serving]}",
                code="model")
        front = self.by_name.get(requested) if requested is not None else None
        if front is None or path not in front.routes:
            raise self.not_served(path, requested)
        return front.routes[path]

    def not_served(self, path: str, requested: str | None = None) -> ModelNotFoundError:
        """The 404 ``model_not_found`` of a request to ``path`` naming the model
        ``requested`` (``None``: none), which is unknown or does not serve ``path``: it lists
        the models that serve ``path``, or says that none does."""
        said = []
        if requested is not None:
            said.append(f"model {requested!r} " + (
                "is not served here" if requested not in self.by_name
                else f"does not serve {path}"))
        serving = [front.name for front in self.serving(path)]
        said.append(f"{path} is served by {serving}" if serving
                    else f"no model here serves {path}")
        return ModelNotFoundError("; ".join(said) + " (GET /v1/models lists every model)")

    def install_unserved(self, app: FastAPI) -> None:
        """Add to ``app`` every inference route of the project (:data:`ROUTES`) that no
        model here serves, answering 404 ``model_not_found`` (:meth:`not_served`, naming
        the model a JSON body names) where a path that exists nowhere is 404 ``not_found``;
        left out of the OpenAPI document."""
        for path in (route.path for route in ROUTES if not self.serving(route.path)):
            app.post(path, include_in_schema=False, response_model=None)(
                self._refusal(path))

    def _refusal(self, path: str) -> Callable[[Request], Awaitable[None]]:
        async def not_served(request: Request) -> None:
            raise self.not_served(path, await _named_model(request))

        return not_served

    async def states(self, max_wait_s: float | None = None) -> list[ReplicaState]:
        """Every live model replica of every served model (``max_wait_s``: as
        :meth:`ReplicaView.states`)."""
        views = await asyncio.gather(*(front.replicas.states(max_wait_s=max_wait_s)
                                       for front in self.fronts))
        return [state for states in views for state in states]


async def _named_model(request: Request) -> str | None:
    """The ``model`` a JSON object body names, else ``None`` (no body, a form, not JSON)."""
    try:
        body = await request.json()
    except ValueError:  # not JSON (UnicodeDecodeError included)
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
