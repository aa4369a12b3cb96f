"""The ingress's FastAPI app built without Ray, around the parts its routes read: for tests
of routes, middlewares and probes that need no model replica."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from deployments.engines.registry import engine_class
from deployments.http.ingress import Ingress
from deployments.http.ingress_opening import Opening
from deployments.http.model_client import ModelClient
from deployments.http.replica_view import ReplicaView
from deployments.http.routes import ROUTES, RouteContext
from deployments.http.served_models import ModelFront, ServedModels
from serve_app.admission.policy import policy_class
from serve_app.config import AppArgs
from serve_app.metrics import ProcessMetrics


class PublishedRegistry:
    """Ray's handle to the replica registry: ``snapshot.remote()`` answers the states in
    ``published`` (none at first)."""

    def __init__(self) -> None:
        self.published: list[Any] = []
        self.snapshot = self

    async def remote(self) -> list[Any]:
        return list(self.published)


def ingress_app(args: AppArgs, replicas: Any = None, factory: Any = None,
                guard: Any = None, client: Any = None,
                metrics: ProcessMetrics | None = None) -> FastAPI:
    """The app of an ingress serving ``args``'s one model, whose routes use ``factory`` and
    ``guard`` (``None``: routes that never get that far) and ``client`` (``None``: one whose
    replicas have published nothing), whose ``/readyz`` and
    ``/v1/status`` read ``replicas`` (anything with ``async states()``) and whose HTTP series
    go to ``metrics``."""
    ingress = object.__new__(Ingress.func_or_class)
    engine = engine_class(args)
    metrics = metrics or ProcessMetrics("Ingress", "test", use_ray=False)
    if client is None:  # no replica has published anything: nothing is refused by prediction
        wait_s = args.admission.max_queue_wait_s
        client = ModelClient(None, ReplicaView(PublishedRegistry(), policy_class(
            args.admission.policy), wait_s, model=args.model.name), wait_s, metrics)
    ingress._models = ServedModels()
    context = RouteContext(args, factory, client, guard, None, ingress._models)
    routes = {R.path: R(context) for R in ROUTES if R.kind.name in engine.kinds}
    ingress._models.add(ModelFront(args=args, engine=engine, front_end=None, replicas=replicas,
                                   client=client, routes=routes, jobs=None))
    ingress._args, ingress._jobs, ingress._model_args = args, None, [args]
    ingress._batches = None
    ingress._opening = Opening()  # its one model is open already
    ingress._metrics = metrics
    return ingress.__serve_build_asgi_app__()
