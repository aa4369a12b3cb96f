"""The ingress's view of the model replicas: their published states, cached briefly, and what
the ingress derives from them (a request's price for the router, a cluster-wide
``Retry-After``, readiness)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping

from ray.serve.handle import DeploymentHandle

from deployments.http.http_errors import as_serve_app_error
from serve_app.admission.drain import predicted_wait_s, wait_s
from serve_app.admission.fair import DEFAULT_TENANT, share_ahead
from serve_app.memory.cost_model import Shape
from serve_app.pricing import UnitsPolicy, estimate_units
from serve_app.replica_state import GateFigures, ReplicaState

logger = logging.getLogger("ray.serve")

STATUS_CACHE_S = 0.5
"""How old a snapshot may be before it is fetched again: refusals under load must not flood
the registry."""
STALE_WHILE_FETCHING_S = 2.0
"""How old a snapshot may be and still be used while a newer one is being fetched, so that
under load no request waits for the registry (a fetch is one Ray call, tens of milliseconds
on a busy node); older than this (after a quiet spell), requests wait for the fetch."""


class ReplicaView:
    """The registry's snapshot of the model replicas' states, fetched again once it is
    ``STATUS_CACHE_S`` old, by one fetch at a time however many requests ask meanwhile; a
    snapshot up to ``STALE_WHILE_FETCHING_S`` old is used while the next one is on its way.

    Args:
        registry: handle to :class:`deployments.cluster.replica_registry.ReplicaRegistry`.
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
        self._fetching: asyncio.Future[None] | None = None

    async def states(self, max_wait_s: float | None = None) -> list[ReplicaState]:
        """Every live model replica's last published state (``[]`` while the registry is
        unavailable: no replicas, not a 500). ``max_wait_s``: the longest this call waits for
        a snapshot being fetched (``None``: until it arrives); then it answers with the one
        it has (``[]`` before the first)."""
        age_s = self._clock() - self._taken_at
        if age_s < STATUS_CACHE_S:
            return self._states
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._fetch())
        if age_s >= STALE_WHILE_FETCHING_S:
            # A caller leaving (or giving up) does not stop the fetch.
            try:
                await asyncio.wait_for(asyncio.shield(self._fetching), max_wait_s)
            except TimeoutError:
                pass
        return self._states

    async def _fetch(self) -> None:
        started = self._clock()
        try:
            states = await self._registry.snapshot.remote()
            self._states = [s for s in states if self._model is None or s.model == self._model]
        except Exception as exc:  # the registry restarting
            logger.warning("replica registry unavailable: %s", as_serve_app_error(exc).message)
            self._states = []
        finally:
            self._taken_at, self._fetching = started, None

    async def estimate(self, shape: Shape) -> int | None:
        """A request of ``shape``'s price for the budget-aware router: what the replicas'
        published cost models charge (:func:`serve_app.pricing.estimate_units`, the largest
        over replicas), ``None`` while none has published one."""
        return estimate_units([s.cost_model for s in await self.states()], shape,
                              self._policy)

    async def predicted_wait_s(self, units: int | None,
                               ahead_units: Mapping[str, int] | None = None,
                               generates: bool = False,
                               tenant: str = DEFAULT_TENANT) -> float | None:
        """The shortest wait a request of ``units`` should get on any replica before it
        starts (:func:`serve_app.admission.drain.predicted_wait_s` of each replica's
        published gate, plus the margin it publishes for ``tenant``), ``None`` while no
        replica has a measured rate or its price is unknown. ``ahead_units``: units of this
        ingress's requests not yet taken by a replica, by tenant: they will queue on the
        replicas under their tenants, so only a tenant's share of them is ahead of it (a
        burst of one tenant's requests in flight once predicted 13.5 s for another
        tenant's request that then waited under a pass). Where they wait in Ray Serve's
        handle queue (every replica at ``max_ongoing_requests``), which is FIFO, this
        predicts short; the replica decides again.
        ``generates``: a completion, which on a replica with continuous batching joins the
        running batch once its own bytes are free; anything else runs after the work leased
        before it. ``tenant``: whose request it is; what is queued ahead of it is its share
        of each replica's backlog (:func:`serve_app.admission.fair.share_ahead` of the
        published tenants), not every tenant's. Published figures are up to a publish period
        old, so this is a first check: the replica decides again on its own figures."""
        if units is None:
            return None
        states = await self.states()
        spread = max(1, len(states))  # the router spreads them over the replicas
        ahead = {t: u / spread for t, u in (ahead_units or {}).items()}
        waits = [(_predicted_wait_s(s, _ahead_of(s.gate, tenant, units, ahead), units,
                                    generates), _margin_s(s.gate, tenant)) for s in states]
        known = [wait + margin for wait, margin in waits if wait is not None]
        return min(known) if known and len(known) == len(waits) else None

    async def drain_s(self, units: int) -> float | None:
        """Seconds until ``units`` more, behind everything leased and queued on the replicas
        now, should have drained at their summed busy drain rates (the rate predicted waits
        use); ``None`` while no replica has one."""
        states = await self.states()
        rate = sum(s.gate.busy_drain_bytes_per_s or 0.0 for s in states)
        if not rate:
            return None
        backlog = sum(s.gate.reserved_bytes + s.gate.queued_bytes for s in states)
        return (backlog + max(units, 0)) / rate

    async def retry_after_s(self) -> float:
        """``Retry-After`` for a request refused before reaching a replica: the bytes queued
        on all replicas over their summed measured drain rate."""
        states = await self.states()
        queued = sum(s.gate.queued_bytes for s in states)
        rate = sum(s.gate.drain_bytes_per_s or 0.0 for s in states)
        return wait_s(queued, rate, fallback_s=self._fallback_s)


def _ahead_of(gate: GateFigures, tenant: str, units: float,
              in_flight: Mapping[str, float]) -> float:
    """Bytes queued on a replica ahead of ``units`` of ``tenant``, and ``units``, in its fair
    order (:func:`share_ahead` of its published tenants' queued bytes, with ``in_flight``'s
    bytes on their way to it, and weights; all it queues and all in flight, from a replica
    that publishes no tenants)."""
    if not gate.tenants:
        return gate.queued_bytes + sum(in_flight.values()) + units
    queued = Counter({t: int(f["queued_bytes"]) for t, f in gate.tenants.items()})
    queued.update({t: round(b) for t, b in in_flight.items()})
    weights = {t: float(f["weight"]) for t, f in gate.tenants.items()}
    own = queued.get(tenant, 0) + units
    return own + share_ahead(weights, tenant, round(own), queued) - round(own)


def _margin_s(gate: GateFigures, tenant: str) -> float:
    """Seconds a replica adds to ``tenant``'s predicted waits before refusing on them: the
    margin of its own recent errors (:class:`serve_app.admission.calibration.TenantCalibrations`)
    where the replica publishes one, else the replica's shared margin."""
    return float(gate.tenants.get(tenant, {}).get("wait_margin_s", gate.wait_margin_s))


def _predicted_wait_s(state: ReplicaState, through: float, units: int,
                      generates: bool) -> float | None:
    """:func:`predicted_wait_s` on a replica of a request of ``units`` with ``through``
    bytes queued before it and its own (:func:`_ahead_of`): it runs after the work leased
    and queued before it, unless it is a completion that joins a running batch."""
    gate = state.gate
    in_flight = None if generates and state.kv_cache is not None \
        else gate.reserved_bytes + through - units
    return predicted_wait_s(through - gate.free_bytes, gate.busy_drain_bytes_per_s,
                            gate.thread_wait_s, in_flight)
