"""Budget-aware replica scoring for the Serve request router: pure, no Ray.

The thin Ray adapter is :mod:`deployments.cluster.router`. This module decides *where* a request
should go, from three inputs:

* each replica's last report (:class:`ReplicaStats`, read from the dict its
  ``record_routing_stats()`` returns, refreshed every ``request_routing_stats_period_s``);
* the request's estimated device bytes (``None`` when the caller did not price it);
* the router's own optimistic reservations (:class:`BudgetRouterState`): bytes it has sent
  to a replica since that replica's last report, so a burst routed between two reports does
  not pile onto the replica that looked emptiest.

The replica stays the authority: it may still queue or refuse, so a stale router view is never
unsafe (README, "On a GPU cluster", Routing). Every figure here
is therefore a *preference*: no replica is ever dropped from the ranking, and an error in the
optimistic bookkeeping only makes routing less even, never unsafe.

Units: bytes are ints; times are seconds of the router's monotonic clock unless a name says
``unix``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from fractions import Fraction
from typing import Any

from serve_app.replica_state import (
    ROUTING_BYTES_KEYS,
    ROUTING_MEASURED_AT_KEY,
    ROUTING_QUEUE_DEPTH_KEY,
)
from serve_app.request import InferenceRequest


def _count(value: Any) -> int | None:
    """A non-negative finite number as an int, else ``None`` (unknown)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(value)


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's admission state as last reported; ``None`` means unknown.

    Attributes:
        replica_id: the replica's unique id (Ray's ``ReplicaID.unique_id``).
        node_id: Ray node the replica runs on, ``None`` if unknown.
        budget_bytes: the replica's current byte budget.
        reserved_bytes: bytes leased to admitted (running) requests.
        free_bytes: ``budget_bytes - reserved_bytes``.
        queue_depth: requests waiting in the replica's admission FIFO.
        queued_bytes: sum of the waiting requests' prices.
        measured_at_s: when the figures were taken, in the *router's* monotonic seconds
            (see :meth:`from_routing_stats`), ``None`` if the report carries no time.
    """

    replica_id: str
    _: KW_ONLY
    node_id: str | None = None
    budget_bytes: int | None = None
    reserved_bytes: int | None = None
    free_bytes: int | None = None
    queue_depth: int | None = None
    queued_bytes: int | None = None
    measured_at_s: float | None = None

    @property
    def known(self) -> bool:
        """Whether the figures the ranking needs (budget > 0, free, queued) are all known."""
        return (self.budget_bytes is not None and self.budget_bytes > 0
                and self.free_bytes is not None and self.queued_bytes is not None)

    @classmethod
    def from_routing_stats(cls, routing_stats: Mapping[str, Any] | None, *, replica_id: str,
                           node_id: str | None = None, now_s: float | None = None,
                           unix_now_s: float | None = None) -> ReplicaStats:
        """Read the dict a replica's ``record_routing_stats()`` returned.

        Missing, negative, non-finite or non-numeric figures become ``None`` (unknown); an
        empty or ``None`` dict (no report yet) gives a replica with every figure unknown,
        which the ranking puts last but never drops.

        ``measured_at_unix_s`` (the replica's wall clock) is mapped onto the router's
        monotonic clock by its age: ``measured_at_s = now_s - max(0, unix_now_s - t)``.
        Clock skew between nodes shifts it by the skew; a report that looks as if it came
        from the future counts as taken now.

        Args:
            routing_stats: the replica's report.
            replica_id: the replica's unique id.
            node_id: its Ray node id.
            now_s: the router's monotonic now (default ``time.monotonic()``).
            unix_now_s: the router's wall-clock now (default ``time.time()``).
        """
        stats = routing_stats or {}
        figures = {key: _count(stats.get(key)) for key in ROUTING_BYTES_KEYS}
        measured_at_s = None
        measured_unix = stats.get(ROUTING_MEASURED_AT_KEY)
        if (not isinstance(measured_unix, bool) and isinstance(measured_unix, int | float)
                and math.isfinite(measured_unix)):
            now_s = time.monotonic() if now_s is None else now_s
            unix_now_s = time.time() if unix_now_s is None else unix_now_s
            measured_at_s = now_s - max(0.0, unix_now_s - measured_unix)
        return cls(replica_id=replica_id, node_id=node_id,
                   queue_depth=_count(stats.get(ROUTING_QUEUE_DEPTH_KEY)),
                   measured_at_s=measured_at_s, **figures)


@dataclass(frozen=True)
class Reservation:
    """Bytes the router has sent to a replica that the replica's last report may not show.

    Attributes:
        reservation_id: unique within one :class:`BudgetRouterState`.
        replica_id: where the request was sent.
        nbytes: its estimated price.
        reserved_at_s: router monotonic seconds when it was made.
    """

    reservation_id: int
    replica_id: str
    nbytes: int
    reserved_at_s: float


class BudgetRouterState:
    """Optimistic per-replica reservations kept by one router between stats reports.

    A reservation counts against its replica's free bytes until the first of:

    1. :meth:`settle` (the request completed, failed, was refused or cancelled); idempotent.
    2. **A newer report covers it.** When :meth:`observe` sees a report of replica R with
       ``measured_at_s`` later than any report of R seen before, every reservation on R with
       ``reserved_at_s + arrival_grace_s <= measured_at_s`` is dropped: the request had
       reached R by then, so R's own ``reserved_bytes`` / ``queued_bytes`` include it
       (or it already finished), and counting it again would be double. Reservations made
       later stay. A report without a time (``measured_at_s is None``) or one not newer than
       the last drops nothing. This follows the rule that the replica is the
       authority: its measurement replaces the router's guess as soon as it can contain it.
    3. **Age.** A reservation older than ``max_age_s`` is dropped: a backstop so that a lost
       completion cannot hold bytes forever (rule 2 already covers replicas that report).

    Args:
        clock: monotonic seconds (the clock ``ReplicaStats.measured_at_s`` is expressed in).
        arrival_grace_s: how long a routed request may take to reach its replica and be
            counted there (>= 0). Larger double-counts briefly; smaller under-counts briefly.
        max_age_s: backstop lifetime of a reservation (> 0).

    Not thread-safe: use it from the router's event loop only.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 arrival_grace_s: float = 0.0, max_age_s: float = 60.0) -> None:
        if arrival_grace_s < 0:
            raise ValueError(f"arrival_grace_s must be >= 0, got {arrival_grace_s}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self._clock = clock
        self._arrival_grace_s = arrival_grace_s
        self._max_age_s = max_age_s
        self._ids = itertools.count(1)
        self._live: dict[str, dict[int, Reservation]] = {}
        self._measured_at_s: dict[str, float] = {}

    def reserve(self, replica_id: str, nbytes: int) -> Reservation:
        """Count ``nbytes`` (>= 0) against ``replica_id`` from now on; returns the token."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        reservation = Reservation(next(self._ids), replica_id, nbytes, self._clock())
        self._live.setdefault(replica_id, {})[reservation.reservation_id] = reservation
        return reservation

    def settle(self, reservation: Reservation) -> bool:
        """Stop counting ``reservation``. Idempotent: ``True`` only the first time it was
        still counted (a reservation already dropped by rule 2 or 3 returns ``False``)."""
        on_replica = self._live.get(reservation.replica_id)
        if on_replica is None or on_replica.pop(reservation.reservation_id, None) is None:
            return False
        if not on_replica:
            del self._live[reservation.replica_id]
        return True

    def is_live(self, reservation: Reservation) -> bool:
        """Whether ``reservation`` still counts (ignoring rule 3 until the next read)."""
        return reservation.reservation_id in self._live.get(reservation.replica_id, {})

    def observe(self, stats: ReplicaStats) -> int:
        """Take a replica's report into account (rule 2); returns how many were dropped."""
        measured_at_s = stats.measured_at_s
        if measured_at_s is None:
            return 0
        last = self._measured_at_s.get(stats.replica_id)
        if last is not None and measured_at_s <= last:
            return 0
        self._measured_at_s[stats.replica_id] = measured_at_s
        on_replica = self._live.get(stats.replica_id, {})
        covered = [r.reservation_id for r in on_replica.values()
                   if r.reserved_at_s + self._arrival_grace_s <= measured_at_s]
        for reservation_id in covered:
            del on_replica[reservation_id]
        if not on_replica:
            self._live.pop(stats.replica_id, None)
        return len(covered)

    def pending_by_replica(self) -> dict[str, int]:
        """``{replica_id: reserved bytes}`` for every replica with a live reservation."""
        self._expire()
        return {replica_id: sum(r.nbytes for r in on_replica.values())
                for replica_id, on_replica in self._live.items()}

    def live_count(self) -> int:
        """Number of reservations still counted."""
        self._expire()
        return sum(len(on_replica) for on_replica in self._live.values())

    def retain_replicas(self, active_replica_ids: Iterable[str]) -> None:
        """Forget reservations and report times of replicas no longer running."""
        active = set(active_replica_ids)
        for replica_id in [r for r in self._live if r not in active]:
            del self._live[replica_id]
        for replica_id in [r for r in self._measured_at_s if r not in active]:
            del self._measured_at_s[replica_id]

    def _expire(self) -> None:
        oldest_s = self._clock() - self._max_age_s
        for replica_id in list(self._live):
            on_replica = self._live[replica_id]
            for reservation_id in [i for i, r in on_replica.items()
                                   if r.reserved_at_s < oldest_s]:
                del on_replica[reservation_id]
            if not on_replica:
                del self._live[replica_id]


def headroom_bytes(stats: ReplicaStats, reserved_ahead_bytes: int) -> int | None:
    """Bytes a new request could lease at once on this replica: ``free - queued - reserved
    ahead`` (``None`` if unknown). The replica's FIFO lets nothing overtake a waiting head,
    so bytes already queued there are spent before a newcomer's; with an empty queue this is
    ``free - reservations``."""
    if not stats.known:
        return None
    assert stats.free_bytes is not None and stats.queued_bytes is not None
    return stats.free_bytes - stats.queued_bytes - reserved_ahead_bytes


def rank_replicas(stats: Sequence[ReplicaStats], request_bytes: int | None,
                  reservations: Mapping[str, int],
                  local_node_id: str | None = None,
                  tie_break: Mapping[str, float] | None = None) -> list[list[str]]:
    """Rank replicas for one request; returns ``[fitting, rest]`` (each possibly empty).

    Every replica in ``stats`` appears exactly once: the replica decides (it queues or
    answers 503), so the ranking only orders.

    * ``fitting``: known replicas whose :func:`headroom_bytes` (reservations counted) is
      ``>= request_bytes``, by least bytes ahead (``queued + reserved``), then the local
      node first, then replica id.
    * ``rest``: known replicas that do not fit, by least ``(queued + reserved) / budget``,
      then most headroom, then local node first, then replica id; then replicas with
      unknown figures, by least reserved bytes, local node first, replica id.
    * ``request_bytes is None`` (unpriced): ``fitting`` is empty and ``rest`` orders known
      replicas by least ``queued + reserved`` bytes (local first, id), then unknown ones.

    Args:
        stats: one entry per candidate replica (unique ``replica_id``).
        request_bytes: the request's estimated price (>= 0), or ``None``.
        reservations: ``{replica_id: bytes}`` reserved by this router and not yet in that
            replica's report (:meth:`BudgetRouterState.pending_by_replica`); absent = 0.
        local_node_id: the router's Ray node; replicas there win ties.
        tie_break: ``{replica_id: number}`` ordering replicas that tie on everything else,
            before their ids ("replica id" above); the router passes fresh random numbers so
            that equally idle replicas share sequential traffic instead of the lowest id
            taking all of it. Default: by id only.

    Raises:
        ValueError: a negative ``request_bytes`` or a duplicate replica id.
    """
    if request_bytes is not None and request_bytes < 0:
        raise ValueError(f"request_bytes must be >= 0, got {request_bytes}")
    if len({s.replica_id for s in stats}) != len(stats):
        raise ValueError("duplicate replica ids in stats")
    order = _Order(reservations, local_node_id, tie_break or {})
    known = [s for s in stats if s.known]
    unknown = sorted((s for s in stats if not s.known),
                     key=lambda s: (reservations.get(s.replica_id, 0), order.remote(s)))
    if request_bytes is None:
        rest = sorted(known, key=lambda s: (order.ahead(s), order.remote(s)))
        return [[], [s.replica_id for s in rest + unknown]]
    fitting = sorted((s for s in known if order.fits(s, request_bytes)),
                     key=lambda s: (order.ahead(s), order.remote(s)))
    rest = sorted((s for s in known if not order.fits(s, request_bytes)),
                  key=lambda s: (Fraction(order.ahead(s), s.budget_bytes or 1),
                                 -(order.headroom(s) or 0), order.remote(s)))
    return [[s.replica_id for s in fitting], [s.replica_id for s in rest + unknown]]


@dataclass(frozen=True)
class _Order:
    """The sort keys of :func:`rank_replicas` for one ranking."""

    reservations: Mapping[str, int]
    local_node_id: str | None
    tie_break: Mapping[str, float]

    def remote(self, s: ReplicaStats) -> tuple[int, float, str]:
        """Local node first, then the tie-break, then the replica id."""
        local = self.local_node_id is not None and s.node_id == self.local_node_id
        return (0 if local else 1, self.tie_break.get(s.replica_id, 0.0), s.replica_id)

    def ahead(self, s: ReplicaStats) -> int:
        """Bytes a newcomer waits behind: queued there and reserved by this router."""
        return (s.queued_bytes or 0) + self.reservations.get(s.replica_id, 0)

    def headroom(self, s: ReplicaStats) -> int | None:
        return headroom_bytes(s, self.reservations.get(s.replica_id, 0))

    def fits(self, s: ReplicaStats, request_bytes: int) -> bool:
        headroom = self.headroom(s)
        return headroom is not None and headroom >= request_bytes


def estimated_bytes_of(args: Sequence[Any] | None) -> int | None:
    """The request's price from a handle call's positional arguments: the
    :attr:`~serve_app.request.InferenceRequest.estimated_bytes` of the first
    :class:`~serve_app.request.InferenceRequest` among them; ``None`` when there is none or
    it carries no non-negative finite price."""
    for arg in args or ():
        if isinstance(arg, InferenceRequest):
            return _count(arg.estimated_bytes)
    return None
