"""Fair shares of one budget among tenants (:mod:`serve_app.admission.fair`) in the pure
admission queue, on a fake clock: weighted fair queuing on byte-seconds, FIFO within a tenant,
idleness banks no credit, the budget is never exceeded, and nothing stays leased.

The simulation keeps every tenant it names backlogged (a few requests always waiting), holds
each admitted lease for a drawn time, and moves the clock from one lease's end to the next."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.admission.budget import Lease, MemoryBudget
from serve_app.admission.fair import FairShare, TenantQuota
from serve_app.admission.queue import AdmissionQueue, Outcome, Reason
from tests.unit.conftest import FakeClock

BUDGET = 1000


class Simulation:
    """A queue of ``BUDGET`` bytes, tenants of ``weights``, leases of ``sizes`` bytes held
    ``holds_s`` seconds (both drawn from ``seed``)."""

    def __init__(self, weights: dict[str, float], sizes: tuple[int, int],
                 holds_s: tuple[float, float], seed: int = 0) -> None:
        self.clock, self.weights = FakeClock(), weights
        self.fair = FairShare(weights, clock=self.clock)
        self.queue = AdmissionQueue(MemoryBudget(BUDGET), 10**6, 10**9, clock=self.clock,
                                    fair=self.fair, refuse_predicted=False)
        self.rng, self.sizes, self.holds_s = random.Random(seed), sizes, holds_s
        self.ends: dict[int, tuple[float, Lease]] = {}
        self.admitted: dict[str, list[int]] = {}
        self.backlogged: set[str] = set()
        self.queue.on_admit = lambda waiter: self._held(waiter.lease, waiter.waiter_id)

    def _held(self, lease: Lease, order: int) -> None:
        assert self.queue.budget.reserved_bytes <= BUDGET
        self.admitted.setdefault(lease.tenant, []).append(order)
        self.ends[lease.lease_id] = (self.clock() + self.rng.uniform(*self.holds_s), lease)

    def send(self, tenant: str) -> None:
        decision = self.queue.submit(self.rng.randint(*self.sizes), tenant=tenant)
        assert decision.outcome is not Outcome.REJECTED, decision
        if decision.lease is not None:
            self._held(decision.lease, 0)

    def keep_backlogged(self) -> None:
        for tenant in self.backlogged:
            while self.queue.backlog().get(tenant, (0, 0))[0] < 4:
                self.send(tenant)

    def step(self) -> None:
        """The next lease ends; whoever then fits is admitted; the backlog is refilled."""
        self.keep_backlogged()
        lease_id = min(self.ends, key=lambda i: self.ends[i][0])
        end_s, lease = self.ends.pop(lease_id)
        self.clock.advance(max(0.0, end_s - self.clock()))
        self.queue.release(lease)
        self.keep_backlogged()

    def advance(self, steps: int) -> dict[str, float]:
        """``steps`` lease ends; the tenants' byte-seconds served since start then."""
        for _ in range(steps):
            self.step()
        return self.served()

    def served(self) -> dict[str, float]:
        return {t: self.fair.served_byte_s(t) for t in self.weights}


def gap_bound(weights: dict[str, float], hold_s: float) -> float:
    """What every lease held at once can add beyond its charge, twice, per unit of the
    smaller weight (serve_app.admission.fair's docstring)."""
    return 2 * BUDGET * hold_s / min(weights.values())


@settings(max_examples=25, deadline=None)
@given(w1=st.integers(1, 4), w2=st.integers(1, 4), seed=st.integers(0, 10**6),
       sizes=st.tuples(st.integers(1, 200), st.integers(200, 500)),
       holds=st.tuples(st.floats(0.01, 1.0), st.floats(1.0, 5.0)))
def test_two_backlogged_tenants_get_byte_seconds_within_the_bound(w1, w2, seed, sizes,
                                                                  holds) -> None:
    weights = {"a": float(w1), "b": float(w2)}
    sim = Simulation(weights, sizes, holds, seed)
    sim.backlogged = {"a", "b"}
    start = sim.advance(20)
    for _ in range(200):
        sim.step()
        now = sim.served()
        gap = abs((now["a"] - start["a"]) / w1 - (now["b"] - start["b"]) / w2)
        assert gap <= gap_bound(weights, holds[1]), (gap, now, start)
    for tenant, order in sim.admitted.items():
        queued = [i for i in order if i]
        assert queued == sorted(queued), f"{tenant} was not served first come first served"


def test_weights_three_to_one_split_byte_seconds_three_to_one() -> None:
    sim = Simulation({"a": 3.0, "b": 1.0}, (50, 150), (0.5, 1.5), seed=7)
    sim.backlogged = {"a", "b"}
    start = sim.advance(50)
    end = sim.advance(2000)
    ratio = (end["a"] - start["a"]) / (end["b"] - start["b"])
    assert ratio == pytest.approx(3.0, rel=0.10)


def test_a_tenant_back_from_idle_gets_its_share_not_its_idle_time() -> None:
    """``a`` is served alone for 200 s; then ``b`` arrives and both stay backlogged: ``b``
    gets about half from then on, not everything until it has caught up with ``a``'s 200 s
    (what counters without VTC's lift would give)."""
    sim = Simulation({"a": 1.0, "b": 1.0}, (100, 100), (1.0, 1.0))
    sim.backlogged = {"a"}
    while sim.clock() < 1200.0:
        sim.step()
    sim.backlogged = {"a", "b"}
    start = sim.served()
    while sim.clock() < 1250.0:
        sim.step()
    end = sim.served()
    a, b = end["a"] - start["a"], end["b"] - start["b"]
    assert a + b == pytest.approx(50 * BUDGET, rel=0.05)  # the budget stayed full
    assert b == pytest.approx(a, abs=gap_bound({"a": 1, "b": 1}, 1.0))


def test_a_light_tenant_queued_behind_a_flood_waits_for_its_share_only() -> None:
    """100 requests of ``a`` wait; ``b``'s first request is ahead of all but the one of
    ``a`` its equal share lets through first, and its predicted wait counts those bytes, not
    the flood's."""
    clock = FakeClock()
    queue = AdmissionQueue(MemoryBudget(BUDGET), 1000, 60.0, clock=clock,
                           fair=FairShare(clock=clock))
    queue.submit(BUDGET, tenant="a")  # holds the whole budget
    for _ in range(100):
        queue.submit(100, tenant="a")
    queue.drain.record(BUDGET)  # some drain measured: 1000 bytes in the window
    decision = queue.submit(100, tenant="b")
    assert (decision.outcome, decision.queue_position) == (Outcome.QUEUED, 1)
    flood_wait_s = queue.predicted_wait_s(100, tenant="a")
    assert decision.predicted_wait_s < flood_wait_s / 10


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), steps=st.integers(1, 60))
def test_random_cancellations_leave_nothing_leased_or_queued(seed, steps) -> None:
    sim = Simulation({"a": 2.0, "b": 1.0, "c": 1.0}, (1, 400), (0.1, 2.0), seed)
    sim.backlogged = {"a", "b", "c"}
    rng = random.Random(seed)
    for _ in range(steps):
        sim.step()
        for waiter in sim.queue.waiters():
            if rng.random() < 0.2:
                sim.queue.cancel(waiter)
    sim.backlogged = set()
    for waiter in sim.queue.waiters():
        sim.queue.cancel(waiter)
    while sim.ends:
        sim.step()
    budget = sim.queue.budget
    assert (budget.reserved_bytes, budget.active_leases, sim.queue.queue_depth) == (0, 0, 0)
    assert sim.queue.backlog() == {} and sim.queue.queued_bytes == 0
    assert all(sim.fair.held_bytes(t) == 0 for t in "abc")


def test_a_tenant_over_its_quota_is_refused_while_another_is_admitted() -> None:
    """``capped`` may hold or wait for half the budget and have one request waiting: past
    either, 429 ``tenant_quota`` with a wait; ``other`` is admitted meanwhile."""
    clock = FakeClock()
    fair = FairShare(clock=clock, quotas={"capped": TenantQuota(max_share=0.5, max_waiting=1)})
    queue = AdmissionQueue(MemoryBudget(BUDGET), 100, 60.0, clock=clock, fair=fair)
    held = queue.submit(400, tenant="capped")
    assert held.outcome is Outcome.ADMITTED
    over_share = queue.submit(200, tenant="capped")  # 400 + 200 > 500
    assert (over_share.outcome, over_share.reason) == (Outcome.REJECTED, Reason.TENANT_QUOTA)
    assert "holds or waits for 400 bytes of its 500" in over_share.detail
    assert over_share.retry_after_s is not None and over_share.retry_after_s > 0
    assert queue.submit(700, tenant="other").outcome is Outcome.QUEUED  # 400 + 700 > 1000
    assert queue.submit(100, tenant="capped").outcome is Outcome.QUEUED  # 500 of its 500
    over_waiting = queue.submit(1, tenant="capped")
    assert (over_waiting.reason, over_waiting.detail) == (
        Reason.TENANT_QUOTA, "tenant 'capped' has 1 requests waiting, its most "
        "(auth.tenants[].max_waiting)")
    queue.release(held.lease)
    assert (queue.budget.reserved_bytes, queue.queue_depth) == (800, 0)  # both waiters in
