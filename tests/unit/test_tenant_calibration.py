"""Each tenant's predicted waits are corrected by its own errors
(:class:`serve_app.admission.calibration.TenantCalibrations`): one tenant whose waits run
longer than predicted is refused by prediction sooner, and no other tenant with it.

Pure: the admission queue and controller on a fake clock, the ingress's view of published
replica figures; no Ray, no sleeps."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import random

import pytest

from deployments.http.replica_view import ReplicaView
from serve_app.admission.budget import MemoryBudget
from serve_app.admission.calibration import MIN_ERRORS, TenantCalibrations
from serve_app.admission.controller import AdmissionController
from serve_app.admission.drain import DrainRateEstimator
from serve_app.admission.fair import FairShare
from serve_app.admission.policy import BudgetPolicy
from serve_app.admission.priority import Priority
from serve_app.admission.queue import AdmissionQueue, Outcome, Reason
from tests.ingress_parts import PublishedRegistry
from tests.unit.conftest import FakeClock
from tests.unit.test_early_refusal import BUDGET, published_state
from tests.unit.test_queue import admitted


def two_tenants(clock: FakeClock, weights: dict[str, float] | None = None,
                budget_bytes: int = 100, max_queue_len: int = 8) -> AdmissionQueue:
    """A queue of tenants ``a`` and ``b`` (``weights``, equal by default), each with its
    own calibration, that has drained 20 bytes a second."""
    weights = weights or {"a": 1.0, "b": 1.0}
    queue = AdmissionQueue(MemoryBudget(budget_bytes), max_queue_len, 10.0, clock=clock,
                           drain=DrainRateEstimator(10.0, clock),
                           fair=FairShare(weights, clock), calibration=TenantCalibrations(weights))
    clock.advance(2)
    queue.release(admitted(queue, 40).lease)  # 40 B over 2 s
    return queue


def test_one_tenants_mispredicted_waits_do_not_refuse_another_by_prediction() -> None:
    """``b``'s requests waited 8 s longer than predicted, ``a``'s as predicted: ``b``'s
    requests predicted to wait 5 s are refused (5 + 8 > 10 s), ``a``'s, predicted the same,
    wait (with one margin for both, 8 s, they were refused too)."""
    clock = FakeClock()
    queue = two_tenants(clock)
    held = admitted(queue, 100)
    for _ in range(MIN_ERRORS):
        queue.calibration.record(8.0, "b")
        queue.calibration.record(0.0, "a")
    refused = queue.submit(100, tenant="b")  # (100 + 0 free) / 20 = 5 s, + 8 s > 10 s
    assert (refused.reason, refused.margin_s) == (Reason.PREDICTED_TIMEOUT, 8.0)
    waits = queue.submit(100, tenant="a")  # 5 s, + its own margin 0
    assert waits.outcome is Outcome.QUEUED
    queue.cancel(waits.waiter)
    queue.release(held.lease)


def test_a_tenant_with_too_few_errors_of_its_own_uses_the_shared_margin() -> None:
    calibration = TenantCalibrations(["a", "b"])
    for _ in range(MIN_ERRORS):
        calibration.record(3.0, "b")
    assert calibration.margin_s("a") == 3.0  # none of its own yet: everyone's
    for _ in range(MIN_ERRORS - 1):
        calibration.record(0.0, "a")
    assert calibration.margin_s("a") == 3.0
    calibration.record(0.0, "a")
    assert (calibration.margin_s("a"), calibration.margin_s("b")) == (0.0, 3.0)


def test_tenants_not_configured_share_one_margin() -> None:
    """Names clients send beyond the configured ones get no margin of their own (the set
    cannot grow): their errors go to the shared margin, which they use."""
    calibration = TenantCalibrations(["a"])
    for i in range(MIN_ERRORS):
        calibration.record(4.0, f"stranger-{i}")
    assert calibration.margin_s("stranger-0") == calibration.margin_s("other") == 4.0
    for _ in range(MIN_ERRORS):
        calibration.record(0.0, "a")
    assert calibration.margin_s("a") == 0.0


def test_a_tenants_batch_errors_leave_its_interactive_margin() -> None:
    """Batch requests wait behind every interactive request that comes meanwhile, so their
    waits run longer than predicted; the tenant's interactive predictions keep their own."""
    calibration = TenantCalibrations(["a"])
    for _ in range(MIN_ERRORS):
        calibration.record(6.0, "a", Priority.BATCH)
        calibration.record(0.5, "a", Priority.INTERACTIVE)
    assert calibration.margin_s("a", Priority.BATCH) == 6.0
    assert calibration.margin_s("a") == 0.5


def test_the_controller_keeps_configured_tenants_apart_and_fifo_together() -> None:
    """``record_error``/``record_timeout`` as the replica calls them; ``/v1/status`` shows
    each tenant's margin. Under ``fifo`` every request queues as the default tenant, so one
    margin serves all."""
    for fair_queue, expected in ((True, {"a": 0.0, "b": 7.0}), (False, {"a": 7.0, "b": 7.0})):
        controller = AdmissionController(100, 8, 10.0, FakeClock(),
                                         weights={"a": 1.0, "b": 1.0}, fair_queue=fair_queue)
        for _ in range(MIN_ERRORS):
            controller.record_error(0.0, "a")
            controller.record_timeout(10.0, 3.0, "b")  # waited 10 s, predicted 3
        figures = controller.tenant_figures()
        assert {t: figures[t]["wait_margin_s"] for t in "ab"} == expected


def one_replica_view(b_queued: int, b_margin_s: float, shared_margin_s: float) -> ReplicaView:
    """An ingress's view of one replica that drains one budget a second, its budget all
    leased, tenants ``a`` and ``b`` of weight 1, ``b`` with ``b_queued`` bytes queued and a
    margin of ``b_margin_s`` (``a``'s 0)."""
    state = published_state(thread_wait_s=0.0)
    tenants = {t: {"weight": 1.0, "waiting": int(t == "b" and b_queued > 0),
                   "queued_bytes": b_queued * (t == "b"), "held_bytes": 0,
                   "served_byte_s": 0.0, "wait_margin_s": b_margin_s * (t == "b")}
               for t in "ab"}
    gate = dataclasses.replace(state.gate, reserved_bytes=BUDGET, free_bytes=0,
                               queue_depth=int(b_queued > 0), queued_bytes=b_queued,
                               drain_bytes_per_s=BUDGET, busy_drain_bytes_per_s=BUDGET,
                               wait_margin_s=shared_margin_s, tenants=tenants)
    registry = PublishedRegistry()
    registry.published = [dataclasses.replace(state, gate=gate)]
    return ReplicaView(registry, BudgetPolicy, 10.0, model="fake", clock=FakeClock())


def predicted_by_tenant(view: ReplicaView,
                        in_flight: dict[str, int] | None = None) -> dict[str, float | None]:
    """Each tenant's predicted wait for a request of one budget."""
    async def predicted() -> dict[str, float | None]:
        return {t: await view.predicted_wait_s(BUDGET, in_flight, tenant=t) for t in "ab"}

    return asyncio.run(predicted())


def test_the_ingress_adds_the_margin_published_for_the_requests_tenant() -> None:
    """A replica that drains one budget a second, one budget queued by ``b``, and ``b``'s
    margin 8 s: ``b``'s request is predicted 2 + 8 s at the ingress, ``a``'s 2 s (its half of
    ``b``'s backlog and its own), not 2 + the replica's shared margin."""
    view = one_replica_view(b_queued=BUDGET, b_margin_s=8.0, shared_margin_s=5.0)
    assert predicted_by_tenant(view) == {"a": pytest.approx(2.0), "b": pytest.approx(10.0)}


def test_requests_in_flight_to_the_replicas_queue_under_their_own_tenants() -> None:
    """This ingress has 40 requests of ``a`` (a budget each) sent but not yet taken by the
    replica (a burst on its way): they will queue under ``a``, so ``b``'s request is predicted
    behind its own budget and as much of ``a``'s (2 s at one budget a second), not behind all
    40 (41 s, as when every request in flight counted as ahead of every tenant); ``a``'s own
    next one is behind all of them."""
    view = one_replica_view(b_queued=0, b_margin_s=0.0, shared_margin_s=0.0)
    assert predicted_by_tenant(view, {"a": 40 * BUDGET}) == {"a": pytest.approx(41.0),
                                                              "b": pytest.approx(2.0)}


class Overload:
    """Two tenants of weights 3:1 each sending twice what the replica drains (Poisson, 80
    requests a second of 1/4 of the budget, each held 0.1 s, 10 s of wait at most): the
    benchmark's 3:1 run (``benchmarks/tenants.py``) on the pure queue and a fake clock, every
    admitted and timed-out request's error recorded as the replica records them."""

    def __init__(self, seed: int = 0) -> None:
        self.clock = FakeClock(0.0)
        weights = {"a": 3.0, "b": 1.0}
        self.queue = AdmissionQueue(
            MemoryBudget(400), 10**6, 10.0, clock=self.clock,
            drain=DrainRateEstimator(10.0, self.clock), fair=FairShare(weights, self.clock),
            calibration=TenantCalibrations(weights))
        self.queue.on_admit = lambda waiter: self._started(waiter, waiter.lease)
        self.events: list = []
        self.order, self.rng = itertools.count(), random.Random(seed)
        self.waiting: dict[int, object] = {}
        for tenant in weights:
            self._at(self.rng.expovariate(80), "arrive", tenant)

    def _at(self, at_s: float, kind: str, what: object) -> None:
        heapq.heappush(self.events, (at_s, next(self.order), kind, what))

    def _started(self, waiter, lease) -> None:
        if waiter is not None:
            self.waiting.pop(waiter.waiter_id)
            self._record(waiter)
        self._at(self.clock() + 0.1, "end", lease)

    def _arrive(self, tenant: str) -> None:
        self._at(self.clock() + self.rng.expovariate(80), "arrive", tenant)
        decision = self.queue.submit(100, tenant=tenant)
        if decision.outcome is Outcome.ADMITTED:
            self._started(None, decision.lease)
        elif decision.outcome is Outcome.QUEUED:
            self.waiting[decision.waiter.waiter_id] = decision.waiter
            self._at(decision.waiter.deadline, "deadline", decision.waiter)

    def _deadline(self, waiter) -> None:
        if self.waiting.pop(waiter.waiter_id, None) is not None:
            self.queue.cancel(waiter)
            self._record(waiter)

    def _record(self, waiter) -> None:
        """How much longer ``waiter`` waited than predicted (none before a rate)."""
        if waiter.predicted_wait_s is not None:
            self.queue.calibration.record(self.clock() - waiter.enqueued_at
                                          - waiter.predicted_wait_s, waiter.tenant)

    def until(self, end_s: float) -> None:
        while self.events[0][0] <= end_s:
            at_s, _, kind, what = heapq.heappop(self.events)
            self.clock.advance(at_s - self.clock())
            {"arrive": self._arrive, "end": self.queue.release,
             "deadline": self._deadline}[kind](what)


@pytest.mark.parametrize("seed", [0, 1])
def test_under_overload_the_heavy_tenant_stays_backlogged_whatever_the_light_ones_errors(
        seed: int) -> None:
    """While ``a``'s queue is short, ``b``'s fluid share counts only what ``a`` has queued,
    not what ``a`` sends meanwhile, so ``b`` waits up to 4x longer than predicted (``a``
    takes 3/4 of each drain). Those are ``b``'s errors: ``b``'s margin grows to seconds,
    ``a``'s stays under a pass or two, and ``a`` stays backlogged (with one margin for
    both, ``a`` was refused by ``b``'s errors and its queue fell to under half)."""
    run = Overload(seed)
    least_a = None
    for second in range(2, 20):
        run.until(float(second))
        waiting_a = run.queue.backlog().get("a", (0, 0))[0]
        if second >= 6:
            least_a = waiting_a if least_a is None else min(least_a, waiting_a)
    assert run.queue.calibration.margin_s("b") > 2.0
    assert run.queue.calibration.margin_s("a") < 0.3
    assert least_a >= 250  # 10 s at a's 3/4 of the 40 a second drained is 300
