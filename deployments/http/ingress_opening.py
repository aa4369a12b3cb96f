"""The ingress opens its models in the background, so that it answers probes from its start.

Ray Serve routes HTTP to an ingress replica only once its constructor has returned: until
then, Ray Serve's proxy holds every request, ``/readyz`` included, without an answer. What an
ingress needs per model before it can serve it (the tokenizer, the connection to the job
store, which waits for the app's embedded Redis) takes seconds, so its constructor only
starts that work (:class:`Opening`); :class:`OpeningGate` holds every request but the probes
until it is done, and ``/readyz`` answers 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.http.http_errors import error_response
from deployments.http.http_middleware import BearerAuth, route_path
from serve_app.errors import OverloadedError

logger = logging.getLogger("ray.serve")


class Opening:
    """The opening of the ingress's models, running as a task of the ingress's event loop.

    Args:
        work: what opens them (a coroutine); ``None``: nothing to open (already open).
    """

    def __init__(self, work: Awaitable[None] | None = None) -> None:
        self._task = asyncio.ensure_future(work) if work is not None else None
        if self._task is not None:
            self._task.add_done_callback(self._log_failure)

    @property
    def done(self) -> bool:
        """Whether the opening has ended (opened, or failed)."""
        return self._task is None or self._task.done()

    def failure(self) -> BaseException | None:
        """Why the opening failed (``None``: it has not, or not yet)."""
        if self._task is None or not self._task.done() or self._task.cancelled():
            return None
        return self._task.exception()

    async def wait(self) -> None:
        """Until the models are open (a caller leaving does not stop the opening).

        Raises:
            Exception: what the opening raised.
        """
        if self._task is not None:
            await asyncio.shield(self._task)

    def not_ready(self) -> OverloadedError | None:
        """``/readyz``'s 503 while the opening runs or after it failed; ``None`` once open."""
        if not self.done:
            return OverloadedError("the ingress is still loading its models' tokenizers and "
                                   "connecting to their job stores", code="starting",
                                   retry_after_s=1)
        if (failure := self.failure()) is not None:
            return OverloadedError(f"the ingress could not open its models: {failure}",
                                   code="starting", retry_after_s=1)
        return None

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    @staticmethod
    def _log_failure(task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("the ingress could not open its models (its health check now fails, "
                         "so Ray Serve replaces it): %s", task.exception())


class OpeningGate:
    """ASGI middleware: holds every HTTP request but the probes (``/healthz``, ``/readyz``)
    until ``opening`` is done; one that failed answers 503 ``starting`` with the reason.

    Args:
        app: the ASGI app behind.
        opening: the ingress's :class:`Opening`.
    """

    def __init__(self, app: ASGIApp, opening: Opening) -> None:
        self._app, self._opening = app, opening

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in BearerAuth.PROBES:
            try:
                await self._opening.wait()
            except Exception:  # logged by Opening; the reason goes to the client
                await error_response(self._opening.not_ready())(scope, receive, send)
                return
        await self._app(scope, receive, send)
