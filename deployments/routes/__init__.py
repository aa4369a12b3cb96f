"""The ingress's inference routes, one module per request kind, registered in :data:`ROUTES`
(:mod:`serve_app.kinds` names the kinds). The ingress installs the route of every kind its
engine serves."""

from deployments.routes.base import Route, RouteContext
from deployments.routes.completions import CompletionsRoute
from deployments.routes.embeddings import EmbeddingsRoute

ROUTES: dict[str, type[Route]] = {route.kind: route
                                  for route in (EmbeddingsRoute, CompletionsRoute)}
"""The route of each request kind."""

__all__ = ["ROUTES", "Route", "RouteContext"]
