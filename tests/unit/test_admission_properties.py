"""Properties of AdmissionQueue under random arrivals, releases, cancellations and time.

The state machine keeps its own model of who holds what and who waits in which order, predicts
every ``submit`` decision from it, and checks the queue against it after every step. Time is
a fake clock the machine owns; it moves in quarter seconds so deadlines are hit exactly.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from serve_app.admission.budget import Lease, MemoryBudget
from serve_app.admission.drain import DrainRateEstimator
from serve_app.admission.queue import AdmissionQueue, Outcome, Reason, Waiter

# Small and fast: the whole unit suite must stay well under a minute. ``database=None`` keeps
# Hypothesis from writing ``.hypothesis/`` into the repository root.
SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

STEPS_S = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.5, 10.0])


class AdmissionMachine(RuleBasedStateMachine):
    """AdmissionQueue against a model: ``held`` leases, ``waiting`` waiters in arrival order."""

    def __init__(self) -> None:
        super().__init__()
        self.now_s = 100.0
        self.queue: AdmissionQueue | None = None
        self.held: list[tuple[Lease, Waiter | None]] = []  # unreleased, with their waiter
        self.released: list[Lease] = []
        self.waiting: list[Waiter] = []  # the model of the queue, arrival order
        self.just_admitted: list[Waiter] = []  # filled by on_admit
        self.admitted_ids: list[int] = []  # every on_admit, in call order
        self.expired_up_to_now = True  # expire() ran since the clock last moved

    # --- set-up and helpers ----------------------------------------------------------------

    @initialize(budget_bytes=st.integers(1, 100), max_queue_len=st.integers(0, 6),
                max_queue_wait_s=st.sampled_from([0.25, 1.0, 2.5, 10.0, 60.0]))
    def build(self, budget_bytes: int, max_queue_len: int, max_queue_wait_s: float) -> None:
        clock = lambda: self.now_s  # noqa: E731
        self.queue = AdmissionQueue(MemoryBudget(budget_bytes), max_queue_len, max_queue_wait_s,
                                    clock=clock, drain=DrainRateEstimator(10.0, clock),
                                    on_admit=self.just_admitted.append)

    @property
    def budget(self) -> MemoryBudget:
        return self.queue.budget

    def reconcile(self, returned: list[Waiter] | None = None) -> None:
        """Fold what the last call did into the model: expired ones out, admitted ones in."""
        admitted, self.just_admitted[:] = list(self.just_admitted), []
        if returned is not None:
            assert returned == admitted, "the returned waiters are not those admitted"
        self.waiting = [w for w in self.waiting if not w.expired]
        # FIFO: whoever was admitted must be the head of the queue, in arrival order.
        assert self.waiting[:len(admitted)] == admitted, "admitted out of arrival order"
        del self.waiting[:len(admitted)]
        for waiter in admitted:
            assert waiter.lease is not None and not waiter.lease.released
            assert waiter.lease.nbytes == waiter.nbytes
            assert not waiter.expired
            self.held.append((waiter.lease, waiter))
            self.admitted_ids.append(waiter.waiter_id)

    def predict(self, nbytes: int) -> tuple[Outcome, Reason | None, int]:
        """The decision ``submit(nbytes)`` must return: expire, pump, then decide."""
        if nbytes > self.budget.budget_bytes:
            return Outcome.REJECTED, Reason.REQUEST_TOO_LARGE, 0
        alive = [w for w in self.waiting if w.deadline > self.now_s]
        free = self.budget.free_bytes
        while alive and alive[0].nbytes <= free:
            free -= alive.pop(0).nbytes
        if not alive and nbytes <= free:
            return Outcome.ADMITTED, None, 0
        if len(alive) >= self.queue.max_queue_len:
            return Outcome.REJECTED, Reason.QUEUE_FULL, len(alive)
        return Outcome.QUEUED, None, len(alive)

    # --- rules -----------------------------------------------------------------------------

    @rule(nbytes=st.integers(0, 40))
    def arrive_small(self, nbytes: int) -> None:
        self.arrive(nbytes)

    @rule(sizes=st.lists(st.integers(0, 60), min_size=2, max_size=6))
    def burst(self, sizes: list[int]) -> None:
        for nbytes in sizes:
            self.arrive(nbytes)

    @rule(nbytes=st.integers(0, 150))  # up to half again the largest budget: some never fit
    def arrive(self, nbytes: int) -> None:
        expected = self.predict(nbytes)
        decision = self.queue.submit(nbytes)
        assert (decision.outcome, decision.reason, decision.queue_position) == expected
        if decision.reason is not Reason.REQUEST_TOO_LARGE:
            self.expired_up_to_now = True  # submit expires before deciding
        self.reconcile()
        if decision.outcome is Outcome.ADMITTED:
            assert decision.lease.nbytes == nbytes
            self.held.append((decision.lease, None))
        elif decision.outcome is Outcome.QUEUED:
            waiter = decision.waiter
            assert waiter.deadline == self.now_s + self.queue.max_queue_wait_s
            assert all(w.waiter_id < waiter.waiter_id for w in self.waiting)
            self.waiting.append(waiter)
        elif decision.reason is Reason.QUEUE_FULL:
            assert 1 <= decision.retry_after_s <= 60
        else:
            assert decision.retry_after_s is None

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 10**6))
    def release(self, pick: int) -> None:
        lease, _ = self.held.pop(pick % len(self.held))
        self.released.append(lease)
        self.reconcile(self.queue.release(lease))
        assert lease.released

    @precondition(lambda self: self.released)
    @rule(pick=st.integers(0, 10**6))
    def release_again(self, pick: int) -> None:
        reserved = self.budget.reserved_bytes
        self.reconcile(self.queue.release(self.released[pick % len(self.released)]))
        assert self.budget.reserved_bytes == reserved  # no bytes come back twice

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 10**6))
    def cancel_waiter(self, pick: int) -> None:
        waiter = self.waiting.pop(pick % len(self.waiting))
        self.reconcile(self.queue.cancel(waiter))
        assert waiter.lease is None

    @precondition(lambda self: len(self.waiting) >= 2)
    @rule()
    def cancel_the_blocking_head(self) -> None:
        self.reconcile(self.queue.cancel(self.waiting.pop(0)))

    @precondition(lambda self: any(w is not None for _, w in self.held))
    @rule(pick=st.integers(0, 10**6))
    def cancel_admitted(self, pick: int) -> None:
        """The client left after admission but before running: the lease goes back."""
        with_waiter = [i for i, (_, w) in enumerate(self.held) if w is not None]
        lease, waiter = self.held.pop(with_waiter[pick % len(with_waiter)])
        self.released.append(lease)
        self.reconcile(self.queue.cancel(waiter))
        assert lease.released

    @rule(step_s=STEPS_S)
    def tick(self, step_s: float) -> None:
        self.now_s += step_s
        self.expired_up_to_now = self.expired_up_to_now and step_s == 0

    @rule(step_s=STEPS_S)
    def tick_and_expire(self, step_s: float) -> None:
        self.now_s += step_s
        self.check_expire()

    @precondition(lambda self: self.waiting)
    @rule()
    def expire_at_a_deadline(self) -> None:
        """Move the clock exactly onto the earliest deadline: it is due (``<=``), not later."""
        self.now_s = max(self.now_s, min(w.deadline for w in self.waiting))
        self.check_expire()

    def check_expire(self) -> None:
        due = [w for w in self.waiting if w.deadline <= self.now_s]
        gone = self.queue.expire()
        assert gone == due  # exactly the ones past their deadline, in arrival order
        assert all(w.expired for w in gone)
        self.expired_up_to_now = True
        self.reconcile()

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def bytes_add_up(self) -> None:
        if self.queue is None:
            return
        budget = self.budget
        assert 0 <= budget.reserved_bytes <= budget.budget_bytes
        assert budget.reserved_bytes == sum(lease.nbytes for lease, _ in self.held)
        assert budget.active_leases == len(self.held)
        assert budget.charged_bytes_total - budget.released_bytes_total == budget.reserved_bytes

    @invariant()
    def queue_matches_the_model(self) -> None:
        if self.queue is None:
            return
        assert self.queue.queue_depth == len(self.waiting) <= self.queue.max_queue_len
        assert self.queue.queued_bytes == sum(w.nbytes for w in self.waiting)
        for waiter in self.waiting:
            assert waiter.lease is None and not waiter.expired
            assert waiter.deadline == waiter.enqueued_at + self.queue.max_queue_wait_s

    @invariant()
    def a_waiting_head_does_not_fit(self) -> None:
        """Work-conserving: nobody waits while the head of the queue could run."""
        if self.waiting:
            assert self.waiting[0].nbytes > self.budget.free_bytes

    @invariant()
    def admission_follows_arrival(self) -> None:
        assert self.admitted_ids == sorted(self.admitted_ids)
        assert len(set(self.admitted_ids)) == len(self.admitted_ids)

    @invariant()
    def nobody_waits_past_the_deadline_once_expired(self) -> None:
        if self.expired_up_to_now:
            assert all(w.deadline > self.now_s for w in self.waiting)

    # --- end -------------------------------------------------------------------------------

    def teardown(self) -> None:
        if self.queue is None:
            return
        while self.held or self.waiting:
            while self.waiting:  # cancelling the head may admit those behind it
                self.reconcile(self.queue.cancel(self.waiting.pop(0)))
            while self.held:
                lease, _ = self.held.pop()
                self.reconcile(self.queue.release(lease))
        budget = self.budget
        assert budget.reserved_bytes == 0
        assert self.queue.queue_depth == 0 and self.queue.queued_bytes == 0
        assert budget.active_leases == 0
        assert budget.charged_bytes_total == budget.released_bytes_total


AdmissionMachine.TestCase.settings = SETTINGS
TestAdmissionMachine = AdmissionMachine.TestCase


# --- a plain property: without cancellations or timeouts, requests start in arrival order ----

OPS = st.lists(st.one_of(st.tuples(st.just("arrive"), st.integers(0, 100)),
                         st.tuples(st.just("release"), st.integers(0, 10**6))),
               max_size=60)


@SETTINGS
@given(budget_bytes=st.integers(1, 100), ops=OPS)
def test_requests_start_in_arrival_order_and_never_overcommit(budget_bytes: int,
                                                              ops: list[tuple[str, int]]) -> None:
    queue = AdmissionQueue(MemoryBudget(budget_bytes), max_queue_len=10**6,
                           max_queue_wait_s=float(10**9), clock=lambda: 0.0)
    started: list[int] = []  # arrival numbers, in the order they got their lease
    running: list[Lease] = []
    arrival_of: dict[int, int] = {}  # waiter_id -> arrival number

    def start(waiters: list[Waiter]) -> None:
        for waiter in waiters:
            started.append(arrival_of[waiter.waiter_id])
            running.append(waiter.lease)

    arrivals = 0
    for op, value in ops:
        if op == "arrive":
            nbytes = min(value, budget_bytes)  # all fit ever: none may be dropped
            decision = queue.submit(nbytes)
            if decision.outcome is Outcome.ADMITTED:
                started.append(arrivals)
                running.append(decision.lease)
            else:
                assert decision.outcome is Outcome.QUEUED
                arrival_of[decision.waiter.waiter_id] = arrivals
            arrivals += 1
        elif running:
            start(queue.release(running.pop(value % len(running))))
        assert queue.budget.reserved_bytes <= budget_bytes
    while running:
        start(queue.release(running.pop(0)))

    assert started == list(range(arrivals))  # every request ran, in arrival order
    assert queue.queue_depth == 0 and queue.budget.reserved_bytes == 0
    assert queue.budget.charged_bytes_total == queue.budget.released_bytes_total
