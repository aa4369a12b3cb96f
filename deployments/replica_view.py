"""The ingress's view of the model replicas: their published states, cached briefly, and what
the ingress derives from them (a request's price for the router, a cluster-wide
``Retry-After``, readiness)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ray.serve.handle import DeploymentHandle

from deployments.http_errors import as_serve_app_error
from serve_app.admission.drain import predicted_wait_s, wait_s
from serve_app.memory.cost_model import Shape
from serve_app.pricing import UnitsPolicy, estimate_units
from serve_app.replica_state import ReplicaState

logger = logging.getLogger("ray.serve")

STATUS_CACHE_S = 0.5
"""How old a snapshot may be: refusals under load must not flood the registry."""


class ReplicaView:
    """The registry's snapshot of the model replicas' states, at most ``STATUS_CACHE_S`` old.

    Args:
        registry: handle to :class:`deployments.registry.ReplicaRegistry`.
        policy: the admission policy's class (prices in its units).
        fallback_retry_after_s: ``Retry-After`` while no drain rate is measured
            (``admission.max_queue_wait_s``).
        model: the model whose replicas it shows (``model.name``; the registry holds every
            model's of the app); ``None``: all.
        clock: monotonic seconds.
    """

    def __init__(self, registry: DeploymentHandle, policy: UnitsPolicy,
                 fallback_retry_after_s: float, model: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry, self._policy, self._model = registry, policy, model
        self._fallback_s, self._clock = fallback_retry_after_s, clock
        self._states: list[ReplicaState] = []
        self._taken_at = -float("inf")

    async def states(self) -> list[ReplicaState]:
        """Every live model replica's last published state (``[]`` while the registry is
        unavailable: no replicas, not a 500)."""
        now = self._clock()
        if now - self._taken_at >= STATUS_CACHE_S:
            try:
                states = await self._registry.snapshot.remote()
                self._states = [s for s in states
                                if self._model is None or s.model == self._model]
            except Exception as exc:  # the registry restarting
                logger.warning("replica registry unavailable: %s",
                               as_serve_app_error(exc).message)
                self._states = []
            self._taken_at = now
        return self._states

    async def estimate(self, shape: Shape) -> int | None:
        """A request of ``shape``'s price for the budget-aware router: what the replicas'
        published cost models charge (:func:`serve_app.pricing.estimate_units`, the largest
        over replicas), ``None`` while none has published one."""
        return estimate_units([s.cost_model for s in await self.states()], shape,
                              self._policy)

    async def predicted_wait_s(self, units: int | None,
                               ahead_units: int = 0) -> float | None:
        """The shortest wait a request of ``units`` should get on any replica before it
        starts (:func:`serve_app.admission.drain.predicted_wait_s` of each replica's
        published gate, plus its published margin), ``None`` while no replica has a measured
        rate or its price is unknown. ``ahead_units``: requests of this ingress still waiting
        for a replica (in Ray Serve's handle queue), which will queue ahead of it. Published
        figures are up to a publish period old, so this is a first check: the replica decides
        again on its own figures."""
        if units is None:
            return None
        states = await self.states()
        ahead = ahead_units / max(1, len(states))  # the router spreads them over the replicas
        waits = [(predicted_wait_s(s.gate.queued_bytes + ahead + units - s.gate.free_bytes,
                                   s.gate.busy_drain_bytes_per_s, s.gate.thread_wait_s),
                  s.gate.wait_margin_s) for s in states]
        known = [wait + margin for wait, margin in waits if wait is not None]
        return min(known) if known and len(known) == len(waits) else None

    async def retry_after_s(self) -> float:
        """``Retry-After`` for a request refused before reaching a replica: the bytes queued
        on all replicas over their summed measured drain rate."""
        states = await self.states()
        queued = sum(s.gate.queued_bytes for s in states)
        rate = sum(s.gate.drain_bytes_per_s or 0.0 for s in states)
        return wait_s(queued, rate, fallback_s=self._fallback_s)
