"""The ingress's inference routes, one module each, registered in :data:`ROUTES`
(:mod:`serve_app.kinds` names the request kinds). The ingress installs every route of a kind
its engine serves."""

from deployments.http.routes.base import Route, RouteContext
from deployments.http.routes.chat import ChatCompletionsRoute
from deployments.http.routes.completions import CompletionsRoute
from deployments.http.routes.embeddings import EmbeddingsRoute
from deployments.http.routes.transcriptions import TranscriptionsRoute

ROUTES: tuple[type[Route], ...] = (EmbeddingsRoute, CompletionsRoute, ChatCompletionsRoute,
                                   TranscriptionsRoute)
"""Every inference route; each serves one request kind (``Route.kind``)."""

__all__ = ["ROUTES", "Route", "RouteContext"]
