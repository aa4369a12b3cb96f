"""Fair shares of one replica's budget among tenants, by device memory-time.

A request's real cost on a replica is the bytes it leases times the seconds it holds them.
Each tenant's *service* is that product summed over its leases, counted while they are held
(a lease held now adds ``bytes x seconds so far``). The admission queue
(:mod:`serve_app.admission.queue`) admits next the head of the backlogged tenant with the least
service per unit of weight: weighted fair queuing on byte-seconds, FIFO within a tenant.

The counters follow the Virtual Token Counter scheduler (Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024, Algorithm 2), with byte-seconds where VTC counts tokens:
a tenant that becomes backlogged is lifted to the least counter among the backlogged tenants
(or, with none backlogged, to the counter of the tenant admitted last), so idleness banks no
credit; the lift is kept apart from the service really delivered (:meth:`served_byte_s`).
VTC charges a request's input tokens when it is admitted; the hold of a lease is not known
then, so a lease is charged its bytes times the expected hold at once (:meth:`counter`) and
its real byte-seconds as they pass. VTC bounds the service gap of two backlogged tenants by
``2 x U``, ``U`` the most service one admission adds before the next choice; here several
leases may be taken in one instant and their holds differ from the expected one, so the
gap is bounded by what every lease held at once can add beyond its charge: the budget's
bytes times the longest hold, per unit of the smaller weight (``tests/unit/test_fair_share.py``
checks it).

Pure: no Ray, torch or FastAPI; the clock is injected; not thread-safe (the replica's event
loop).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

DEFAULT_TENANT = "default"
"""The tenant of every request when no tenants are configured, and of ``auth.api_key``."""
HOLD_SMOOTHING = 0.1
"""Weight of the newest hold in :attr:`FairShare.hold_s` (about the last 10 holds)."""


class TenantQuota(NamedTuple):
    """What one tenant may have on a replica at once (``auth.tenants[].max_*``)."""

    max_share: float = 1.0
    """Of the budget, held and waited for."""
    max_waiting: int | None = None
    """Requests waiting."""


class FairShare:
    """Byte-seconds of service per tenant and the order they give (module docstring).

    Args:
        weights: each tenant's weight (> 0); a tenant not named weighs 1.
        clock: monotonic seconds.
        quotas: the tenants that have one (:meth:`over_quota`).

    Raises:
        ValueError: a weight that is not > 0.
    """

    def __init__(self, weights: Mapping[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 quotas: Mapping[str, TenantQuota] | None = None) -> None:
        self._weights, self._quotas = dict(weights or {}), dict(quotas or {})
        if any(w <= 0 for w in self._weights.values()):
            raise ValueError(f"tenant weights must be > 0, got {self._weights}")
        self._clock = clock
        self._done: defaultdict[str, float] = defaultdict(float)  # of leases given back
        self._held: defaultdict[str, dict[int, tuple[int, float]]] = defaultdict(dict)
        self._lift: defaultdict[str, float] = defaultdict(float)  # byte-seconds, weighted
        self._tenant_of: dict[int, str] = {}
        self._last: str | None = None
        self.hold_s = 0.0
        """Expected seconds a lease is held: an exponentially weighted mean of the holds
        seen (weight :data:`HOLD_SMOOTHING` to the newest), 0 before the first."""

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def served_byte_s(self, tenant: str, now: float | None = None) -> float:
        """Byte-seconds ``tenant`` held so far: its leases given back, and those it holds
        up to now."""
        now = self._clock() if now is None else now
        return self._done[tenant] + sum(nbytes * (now - start)
                                        for nbytes, start in self._held[tenant].values())

    def held_bytes(self, tenant: str) -> int:
        """Bytes ``tenant`` holds now."""
        return sum(nbytes for nbytes, _ in self._held[tenant].values())

    def counter(self, tenant: str, now: float | None = None) -> float:
        """``tenant``'s virtual counter, per unit of weight: its leases given back, each
        lease it holds charged at least its expected hold (:attr:`hold_s`) from the moment it
        is taken, so that several leases taken at once count before they have run, and its
        lift."""
        now = self._clock() if now is None else now
        held = sum(nbytes * max(now - start, self.hold_s)
                   for nbytes, start in self._held[tenant].values())
        return (self._done[tenant] + held + self._lift[tenant]) / self.weight(tenant)

    def leased(self, lease_id: int, tenant: str, nbytes: int) -> None:
        """``tenant`` took lease ``lease_id`` of ``nbytes``: its service grows from now."""
        self._held[tenant][lease_id] = (nbytes, self._clock())
        self._tenant_of[lease_id] = tenant
        self._last = tenant

    def returned(self, lease_id: int) -> None:
        """Lease ``lease_id`` went back (idempotent; an unknown id is ignored)."""
        tenant = self._tenant_of.pop(lease_id, None)
        if tenant is None:
            return
        nbytes, start = self._held[tenant].pop(lease_id)
        held_s = self._clock() - start
        self._done[tenant] += nbytes * held_s
        self.hold_s += HOLD_SMOOTHING * (held_s - self.hold_s) if self.hold_s else held_s

    def joined(self, tenant: str, backlogged: Iterable[str]) -> None:
        """``tenant`` became backlogged beside ``backlogged`` (the others waiting): lifted
        to the least of their counters, or, with none waiting, to the counter of the tenant
        admitted last; never lowered (VTC's rule: idleness banks no credit)."""
        now = self._clock()
        others = [t for t in backlogged if t != tenant]
        if others:
            floor = min(self.counter(t, now) for t in others)
        elif self._last is not None and self._last != tenant:
            floor = self.counter(self._last, now)
        else:
            return
        gap = floor - self.counter(tenant, now)
        if gap > 0:
            self._lift[tenant] += gap * self.weight(tenant)

    def next_tenant(self, backlogged: Iterable[str]) -> str:
        """The backlogged tenant served next: the least counter (the first listed among
        equals: callers list tenants by their head's arrival).

        Raises:
            ValueError: nobody is backlogged.
        """
        now = self._clock()
        return min(backlogged, key=lambda t: self.counter(t, now))

    def over_quota(self, tenant: str, nbytes: int, queued: tuple[int, int],
                   budget_bytes: int) -> tuple[str, int] | None:
        """Why a request of ``tenant`` of ``nbytes`` is over its quota, with ``queued`` its
        requests and bytes waiting now, on a budget of ``budget_bytes``, and the bytes of
        the tenant that must drain before it is not; ``None`` when it is not (or has no
        quota)."""
        quota = self._quotas.get(tenant)
        if quota is None:
            return None
        waiting, queued_bytes = queued
        if quota.max_waiting is not None and waiting >= quota.max_waiting:
            return (f"tenant {tenant!r} has {waiting} requests waiting, its most "
                    "(auth.tenants[].max_waiting)", queued_bytes)
        share_bytes = int(quota.max_share * budget_bytes)
        used = self.held_bytes(tenant) + queued_bytes
        if used + nbytes > share_bytes:
            return (f"tenant {tenant!r} holds or waits for {used} bytes of its {share_bytes} "
                    f"({quota.max_share:g} of the budget: auth.tenants[].max_share); this "
                    f"request needs {nbytes} more", used + nbytes - share_bytes)
        return None

    def share_ahead(self, tenant: str, through_bytes: int,
                    queued_bytes: Mapping[str, int]) -> int:
        """:func:`share_ahead` under these weights."""
        return share_ahead(self._weights, tenant, through_bytes, queued_bytes)

    def tenants(self) -> set[str]:
        """Every tenant that held a lease or was named a weight."""
        return {*self._weights, *self._done, *(t for t, h in self._held.items() if h)}

    def waiters_ahead(self, tenant: str, through_bytes: int, own_ahead: int,
                      others: Mapping[str, Iterable[int]]) -> int:
        """Waiters admitted before ``tenant``'s first ``through_bytes`` queued bytes, in the
        fluid order of :meth:`share_ahead`: the ``own_ahead`` of its own tenant, and those of
        each other tenant (``others``: their waiters' bytes, in order) that fit its share of
        what drains first."""
        count, scale = own_ahead, through_bytes / self.weight(tenant)
        for other, sizes in others.items():
            cap, total = scale * self.weight(other), 0
            for nbytes in sizes:
                total += nbytes
                if total > cap:
                    break
                count += 1
        return count


def share_ahead(weights: Mapping[str, float], tenant: str, through_bytes: int,
                queued_bytes: Mapping[str, int]) -> int:
    """Bytes admitted before ``tenant``'s first ``through_bytes`` queued bytes are, if the
    backlogged tenants drain in proportion to their ``weights`` (fluid fair queuing; a tenant
    not named weighs 1): its own, and of every other tenant ``min(its queued bytes,
    through_bytes x its weight / tenant's weight)``. With one tenant: the bytes queued
    through its own, as FIFO gives."""
    scale = through_bytes / weights.get(tenant, 1.0)
    return through_bytes + sum(min(queued, int(scale * weights.get(other, 1.0)))
                               for other, queued in queued_bytes.items() if other != tenant)
