"""What every inference route is given, and the route interface."""

from dataclasses import dataclass
from typing import ClassVar

from fastapi import FastAPI

from deployments.idempotency_guard import IdempotencyGuard
from deployments.model_client import ModelClient
from deployments.request_factory import RequestFactory
from serve_app.config import AppArgs
from serve_app.errors import ModelNotFoundError


@dataclass(frozen=True)
class RouteContext:
    """The ingress's parts a route uses.

    Attributes:
        args: the config.
        factory: builds validated, tokenized, priced requests.
        client: sends them to the model replicas.
        guard: runs keyed requests once (``Idempotency-Key``).
    """

    args: AppArgs
    factory: RequestFactory
    client: ModelClient
    guard: IdempotencyGuard

    def check_model(self, requested: str | None) -> None:
        """Raises ModelNotFoundError (404) for a ``model`` other than the one served."""
        served = self.args.model.name
        if requested is not None and requested != served:
            raise ModelNotFoundError(f"model {requested!r} is not served here; this "
                                     f"deployment serves {served!r}")


class Route:
    """One OpenAI-compatible inference route of one request kind.

    Args:
        context: the ingress's parts.
    """

    kind: ClassVar[str]

    def __init__(self, context: RouteContext) -> None:
        self.context = context

    def install(self, app: FastAPI) -> None:
        """Add the route (and its OpenAPI declaration) to ``app``."""
        raise NotImplementedError
