"""The ingress's FastAPI app built without Ray, around the parts its routes read: for tests
of routes, middlewares and probes that need no model replica."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from deployments.engines.registry import engine_class
from deployments.ingress import Ingress
from deployments.routes import ROUTES, RouteContext
from deployments.served_models import ModelFront, ServedModels
from serve_app.config import AppArgs
from serve_app.metrics import ProcessMetrics


def ingress_app(args: AppArgs, replicas: Any = None, factory: Any = None,
                guard: Any = None, client: Any = None,
                metrics: ProcessMetrics | None = None) -> FastAPI:
    """The app of an ingress serving ``args``'s one model, whose routes use ``factory``,
    ``guard`` and ``client`` (``None``: routes that never get that far), whose ``/readyz`` and
    ``/v1/status`` read ``replicas`` (anything with ``async states()``) and whose HTTP series
    go to ``metrics``."""
    ingress = object.__new__(Ingress.func_or_class)
    engine = engine_class(args)
    ingress._models = ServedModels()
    context = RouteContext(args, factory, client, guard, None, ingress._models)
    routes = {R.path: R(context) for R in ROUTES if R.kind in engine.kinds}
    ingress._models.add(ModelFront(args, engine, None, replicas, client, routes, None))
    ingress._args, ingress._jobs = args, None
    ingress._metrics = metrics or ProcessMetrics("Ingress", "test", use_ray=False)
    return ingress.__serve_build_asgi_app__()
