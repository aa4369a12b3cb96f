"""Ray Serve request router that prefers replicas whose free byte budget fits the request.

A thin adapter over :mod:`serve_app.routing` (pure scoring and bookkeeping): it reads each
candidate's ``routing_stats`` and the price the ingress put on the request
(:attr:`serve_app.request.InferenceRequest.estimated_bytes`), ranks with
:func:`~serve_app.routing.rank_replicas`, and keeps optimistic reservations between stats
reports. Replicas stay the authority: this only orders them (:mod:`serve_app.routing`).

Ray Serve 2.60 contract used (``ray/serve/_private/request_router/request_router.py``,
``ray/serve/_private/router.py``):

* ``choose_replicas`` returns ranks; Ray tries them in order but, *within* one rank, takes
  the replica with the shortest Ray-side queue (``_select_from_candidate_replicas``), so every
  replica is returned as its own rank to keep the byte order.
* Ray sleeps between rounds only when ``routing_context.should_backoff`` is set
  (``_choose_replicas_with_backoff``); it is set here, so a round where every replica refuses
  (its ``max_ongoing_requests`` reached) backs off instead of spinning.
* Without ``FIFOMixin`` the replica a routing round finds goes to *that* round's request
  (``_fulfill_next_pending_request`` matches the internal request id), whose
  ``pending_request.future`` is then resolved with the replica.
* ``on_request_completed(replica_id, internal_request_id)`` runs on the router's loop when a
  sent request finishes, fails, is refused by the replica or cancelled (``router.py``
  ``_process_finished_request`` and the ``finally`` of ``_route_and_send_request_once``).

Reservation life cycle, per request with a known price:

1. *Tentative*, in ``choose_replicas``: the bytes are reserved on the first-ranked replica at
   once, so the next request routed in the same instant (a burst) already sees them.
2. *Assigned*, when Ray resolves ``pending_request.future``: the tentative reservation is
   replaced by one on the replica Ray really picked, stamped now (dropped if cancelled).
3. *Settled* by ``on_request_completed``, or dropped earlier once the replica's own report
   covers it, or after ``max_age_s`` (rules in :class:`~serve_app.routing.BudgetRouterState`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from serve_app.routing import (
    BudgetRouterState,
    ReplicaStats,
    Reservation,
    estimated_bytes_of,
    rank_replicas,
)

__all__ = ["ROUTER_CLASS_PATH", "BudgetAwareRequestRouter"]

ROUTER_CLASS_PATH = "deployments.cluster.router:BudgetAwareRequestRouter"
"""``request_router_config.request_router_class`` for the model deployment."""

_SWEEP_EVERY_CALLS = 256


@dataclass(eq=False)
class _Routed:
    """One routing of one request: its price and the reservation currently held for it."""

    future: asyncio.Future[Any]
    nbytes: int
    reservation: Reservation
    assigned: bool = False


class BudgetAwareRequestRouter(RequestRouter):
    """Ranks replicas by whether their free bytes fit the request, then by bytes queued.

    ``request_router_kwargs`` (passed to :meth:`initialize_state`):
        arrival_grace_s: float, default 0.1; see ``BudgetRouterState``.
        max_age_s: float, default 60; backstop lifetime of a reservation.
    """

    def __init__(self, *args: Any, self_node_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> None:
        super().__init__(*args, self_node_id=self_node_id, **kwargs)
        self._local_node_id = self_node_id
        self._clock = clock
        self._budget_state = BudgetRouterState(clock, arrival_grace_s=0.1)
        self._routed: dict[str, list[_Routed]] = {}
        self._stats_cache: dict[str, tuple[Any, ReplicaStats]] = {}
        self._calls = 0

    def initialize_state(self, arrival_grace_s: float = 0.1, max_age_s: float = 60.0,
                         **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"unknown request_router_kwargs: {sorted(kwargs)}")
        self._budget_state = BudgetRouterState(self._clock, arrival_grace_s=arrival_grace_s,
                                               max_age_s=max_age_s)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        stats = [self._read_stats(r) for r in candidate_replicas]
        for s in stats:
            self._budget_state.observe(s)
        self._maybe_sweep()
        nbytes = None
        if pending_request is not None:
            nbytes = estimated_bytes_of(pending_request.args)
            self._withdraw_tentative(pending_request)  # never count a request against itself
        tiers = rank_replicas(stats, nbytes, self._budget_state.pending_by_replica(),
                              self._local_node_id,
                              tie_break={r: random.random() for r in by_id})
        order = [replica_id for tier in tiers for replica_id in tier]
        if pending_request is not None and nbytes is not None and order:
            self._reserve_tentatively(pending_request, order[0], nbytes)
        return [[by_id[replica_id]] for replica_id in order]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        entries = self._routed.get(internal_request_id)
        if not entries:
            return
        unique_id = replica_id.unique_id
        entry = next((e for e in entries
                      if e.assigned and e.reservation.replica_id == unique_id), None)
        if entry is None:  # finished before its assignment callback ran
            entry = next((e for e in entries if e.future.done()), None)
        if entry is not None:
            self._budget_state.settle(entry.reservation)
            self._forget(internal_request_id, entry)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        active = {r.replica_id.unique_id for r in replicas}
        self._budget_state.retain_replicas(active)
        for unique_id in [u for u in self._stats_cache if u not in active]:
            del self._stats_cache[unique_id]

    # --- internals ---------------------------------------------------------------------

    def _read_stats(self, replica: RunningReplica) -> ReplicaStats:
        """The replica's last report, converted once per report (so its time is stable)."""
        unique_id = replica.replica_id.unique_id
        raw = replica.routing_stats
        cached = self._stats_cache.get(unique_id)
        if cached is not None and cached[0] is raw:
            return cached[1]
        stats = ReplicaStats.from_routing_stats(raw, replica_id=unique_id,
                                                node_id=replica.node_id, now_s=self._clock())
        self._stats_cache[unique_id] = (raw, stats)
        return stats

    def _entry(self, internal_request_id: str, future: asyncio.Future[Any]) -> _Routed | None:
        return next((e for e in self._routed.get(internal_request_id, ())
                     if e.future is future), None)

    def _withdraw_tentative(self, pending_request: PendingRequest) -> None:
        entry = self._entry(pending_request.metadata.internal_request_id,
                            pending_request.future)
        if entry is not None and not entry.assigned:
            self._budget_state.settle(entry.reservation)

    def _reserve_tentatively(self, pending_request: PendingRequest, replica_id: str,
                             nbytes: int) -> None:
        internal_request_id = pending_request.metadata.internal_request_id
        future = pending_request.future
        reservation = self._budget_state.reserve(replica_id, nbytes)
        entry = self._entry(internal_request_id, future)
        if entry is not None:
            entry.reservation = reservation
            return
        self._routed.setdefault(internal_request_id, []).append(
            _Routed(future, nbytes, reservation))
        future.add_done_callback(partial(self._on_assigned, internal_request_id))

    def _on_assigned(self, internal_request_id: str, future: asyncio.Future[Any]) -> None:
        """Ray resolved the request's future: move its bytes to the replica it really got."""
        entry = self._entry(internal_request_id, future)
        if entry is None:  # already completed and settled
            return
        self._budget_state.settle(entry.reservation)
        if future.cancelled() or future.exception() is not None:
            self._forget(internal_request_id, entry)
            return
        replica: RunningReplica = future.result()
        entry.reservation = self._budget_state.reserve(replica.replica_id.unique_id,
                                                       entry.nbytes)
        entry.assigned = True

    def _forget(self, internal_request_id: str, entry: _Routed) -> None:
        entries = self._routed.get(internal_request_id, [])
        if entry in entries:
            entries.remove(entry)
        if not entries:
            self._routed.pop(internal_request_id, None)

    def _maybe_sweep(self) -> None:
        """Drop bookkeeping of assigned requests whose bytes no longer count (covered by a
        report or expired): their completion would settle nothing."""
        self._calls += 1
        if self._calls % _SWEEP_EVERY_CALLS:
            return
        for internal_request_id, entries in list(self._routed.items()):
            for entry in [e for e in entries
                          if e.assigned and not self._budget_state.is_live(e.reservation)]:
                self._forget(internal_request_id, entry)
