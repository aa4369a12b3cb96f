"""Properties of AdmissionQueue under random arrivals, releases, cancellations, time, and
budget changes: shrinking after an out-of-memory error (AIMD), regrowth, and direct settings.

The state machine keeps its own model of who holds what and who waits in which order, predicts
every ``submit`` decision and every budget change (who is evicted, who is admitted) from it, and
checks the queue against it after every step. Time is a fake clock the machine owns; it moves
in quarter seconds so deadlines and quiet periods are hit exactly.
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

from serve_app.admission.aimd import AimdBudget
from serve_app.admission.budget import Lease, MemoryBudget
from serve_app.admission.drain import DrainRateEstimator
from serve_app.admission.queue import AdmissionQueue, Outcome, Reason, Waiter

# Small and fast: the whole unit suite must stay well under a minute. ``database=None`` keeps
# Hypothesis from writing ``.hypothesis/`` into the repository root.
SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

STEPS_S = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.5, 10.0])
QUIET_S = st.sampled_from([0.25, 0.5, 1.0, 2.5, 10.0])  # the non-zero steps


class _Failing:
    """A request whose inference hit an out-of-memory error. Two things follow: the budget
    shrinks to ``aimd.on_oom()`` and the lease is released. The replica now does both in one
    callback, shrink first (``finished`` in deployments/replica/inference.py); the machine also
    plays
    them in the other order and with other events between them (as an earlier replica did,
    shrinking only when the error reached the caller), since the queue must hold up either way.
    """

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.released = False
        self.shrunk = False


class AdmissionMachine(RuleBasedStateMachine):
    """AdmissionQueue against a model: ``held`` leases, ``waiting`` waiters in arrival order,
    ``failing`` requests hit by an OOM, and the AIMD budget (``aimd_bytes``) after OOMs."""

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
        self.failing: list[_Failing] = []  # hit by an OOM: lease not yet released or no shrink
        self.evicted: list[Waiter] = []  # removed by a budget change
        self.aimd: AimdBudget | None = None
        self.aimd_bytes = 0  # the model of aimd.current_bytes
        self.aimd_changed_at = 0.0  # the model of the AIMD's last change
        self.budget_from_aimd = True  # the last budget change (if any) came from the AIMD
        self.reserved_cap = 0  # max(budget, reserved) at the last budget change

    # --- set-up and helpers ----------------------------------------------------------------

    @initialize(budget_bytes=st.integers(1, 100), max_queue_len=st.integers(0, 6),
                max_queue_wait_s=st.sampled_from([0.25, 1.0, 2.5, 10.0, 60.0]),
                decrease_factor=st.sampled_from([0.5, 0.75]),
                increase_fraction=st.sampled_from([0.1, 0.25, 0.5]),
                floor_fraction=st.sampled_from([0.1, 0.25]), quiet_s=QUIET_S)
    def build(self, budget_bytes: int, max_queue_len: int, max_queue_wait_s: float,
              decrease_factor: float, increase_fraction: float, floor_fraction: float,
              quiet_s: float) -> None:
        clock = lambda: self.now_s  # noqa: E731
        self.queue = AdmissionQueue(MemoryBudget(budget_bytes), max_queue_len, max_queue_wait_s,
                                    clock=clock, drain=DrainRateEstimator(10.0, clock),
                                    on_admit=self.on_admit)
        self.aimd = AimdBudget(budget_bytes, decrease_factor=decrease_factor,
                               increase_fraction=increase_fraction, quiet_s=quiet_s,
                               floor_fraction=floor_fraction, clock=clock)
        self.aimd_bytes, self.aimd_changed_at = budget_bytes, self.now_s
        self.reserved_cap = budget_bytes

    def on_admit(self, waiter: Waiter) -> None:
        # Called right after the lease was taken: it must fit the budget, whatever was leased
        # before a shrink (a shrunk budget admits nobody until enough leases are back).
        budget = self.queue.budget
        assert budget.reserved_bytes <= budget.budget_bytes, "admitted into an over-full budget"
        self.just_admitted.append(waiter)

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

    def fits_now(self, reserved: int, nbytes: int) -> bool:
        """The model's admission test: leased plus asked within the budget."""
        return reserved + nbytes <= self.budget.budget_bytes

    def predict(self, nbytes: int) -> tuple[Outcome, Reason | None, int]:
        """The decision ``submit(nbytes)`` must return: expire, pump, then decide."""
        if nbytes > self.queue.max_budget_bytes:
            return Outcome.REJECTED, Reason.REQUEST_TOO_LARGE, 0
        if nbytes > self.budget.budget_bytes:  # fits the measured budget, not the shrunk one
            return Outcome.REJECTED, Reason.OOM, 0
        alive = [w for w in self.waiting if w.deadline > self.now_s]
        reserved = self.budget.reserved_bytes
        while alive and self.fits_now(reserved, alive[0].nbytes):
            reserved += alive.pop(0).nbytes
        rate = self.queue.drain.busy_bytes_per_s()
        queued = sum(w.nbytes for w in alive)
        free = max(0, self.budget.budget_bytes - reserved)
        if rate and (queued + nbytes - free) / rate \
                > self.queue.max_queue_wait_s:  # waits in vain: refused by prediction
            return Outcome.REJECTED, Reason.PREDICTED_TIMEOUT, len(alive)
        if not alive and self.fits_now(reserved, nbytes):
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
        if decision.reason not in (Reason.REQUEST_TOO_LARGE, Reason.OOM):
            self.expired_up_to_now = True  # submit expires before deciding
        self.reconcile()
        if decision.outcome is Outcome.ADMITTED:
            assert decision.lease.nbytes == nbytes
            assert self.budget.reserved_bytes <= self.budget.budget_bytes
            self.held.append((decision.lease, None))
        elif decision.outcome is Outcome.QUEUED:
            waiter = decision.waiter
            assert waiter.deadline == self.now_s + self.queue.max_queue_wait_s
            assert all(w.waiter_id < waiter.waiter_id for w in self.waiting)
            self.waiting.append(waiter)
        elif decision.reason in (Reason.QUEUE_FULL, Reason.OOM, Reason.PREDICTED_TIMEOUT):
            assert 0.001 <= decision.retry_after_s <= 60
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

    # --- budget changes: direct, AIMD shrink after an OOM, AIMD regrowth -----------------

    def change_budget(self, budget_bytes: int, *, from_aimd: bool) -> None:
        """``queue.set_budget_bytes`` against the model: capped at the measured budget, exactly
        the waiters that can never fit are evicted (in arrival order), then whoever now fits is
        admitted from the head, in order, while leased + head fits."""
        expected_budget = min(budget_bytes, self.queue.max_budget_bytes)
        stay = [w for w in self.waiting if w.nbytes <= expected_budget]
        expected_evicted = [w for w in self.waiting if w.nbytes > expected_budget]
        reserved_before = self.budget.reserved_bytes
        evicted = self.queue.set_budget_bytes(budget_bytes)
        assert self.budget.budget_bytes == expected_budget
        assert evicted == expected_evicted, "evicted other than those that can never fit"
        for waiter in evicted:
            assert waiter.evicted and waiter.lease is None and not waiter.expired
        self.evicted.extend(evicted)
        self.waiting = stay
        reserved, expected_admitted = reserved_before, []
        for waiter in stay:
            if not self.fits_now(reserved, waiter.nbytes):
                break
            reserved += waiter.nbytes
            expected_admitted.append(waiter)
        assert self.just_admitted == expected_admitted
        self.reconcile()
        assert self.budget.reserved_bytes == reserved
        self.budget_from_aimd = from_aimd
        self.reserved_cap = max(expected_budget, reserved_before)

    @rule(to=st.integers(1, 100))
    def shrink(self, to: int) -> None:
        """Set the budget directly (usually down; up too when ``to`` is above it)."""
        self.change_budget(to, from_aimd=False)

    @rule(extra=st.integers(0, 150))
    def grow(self, extra: int) -> None:
        """Set the budget directly upwards, often past the measured budget (capped)."""
        self.change_budget(self.budget.budget_bytes + extra, from_aimd=False)

    @precondition(lambda self: any(w.nbytes >= 2 for w in self.waiting))
    @rule(pick=st.integers(0, 10**6))
    def shrink_below_a_waiter(self, pick: int) -> None:
        """Shrink just below one waiter: it and every larger one are evicted, and those
        behind an evicted head may be admitted."""
        candidates = [w for w in self.waiting if w.nbytes >= 2]
        self.change_budget(candidates[pick % len(candidates)].nbytes - 1, from_aimd=False)

    @precondition(lambda self: self.waiting)
    @rule()
    def grow_for_the_head(self) -> None:
        """Grow just enough for the head to fit next to what is leased (capped, so it may
        still not fit)."""
        self.change_budget(self.budget.reserved_bytes + self.waiting[0].nbytes,
                           from_aimd=False)

    @rule(to=st.integers(-3, 0))
    def set_an_empty_budget(self, to: int) -> None:
        """A budget of no bytes is refused and changes nothing."""
        before = (self.budget.budget_bytes, self.budget.reserved_bytes, self.queue.queue_depth)
        try:
            self.queue.set_budget_bytes(to)
        except ValueError:
            pass
        else:
            raise AssertionError(f"set_budget_bytes({to}) was accepted")
        assert (self.budget.budget_bytes, self.budget.reserved_bytes,
                self.queue.queue_depth) == before
        assert self.just_admitted == []

    def shrink_after_oom(self) -> None:
        """The replica's ``_after_oom``: the budget becomes ``aimd.on_oom()``."""
        expected = max(self.aimd.floor_bytes, int(self.aimd_bytes * self.aimd.decrease_factor))
        budget_bytes = self.aimd.on_oom()
        assert budget_bytes == expected
        self.aimd_bytes, self.aimd_changed_at = expected, self.now_s
        self.change_budget(budget_bytes, from_aimd=True)

    def release_after_oom(self, lease: Lease) -> None:
        """The inference thread returned (``finished``): the lease goes back."""
        self.released.append(lease)
        self.reconcile(self.queue.release(lease))
        assert lease.released

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 10**6), release_first=st.booleans())
    def oom(self, pick: int, release_first: bool) -> None:
        """A running request fails with an OOM: the budget shrinks and its lease is released,
        back to back, in the replica's order (shrink first) or the other."""
        lease, _ = self.held.pop(pick % len(self.held))
        if release_first:
            self.release_after_oom(lease)
            self.shrink_after_oom()
        else:
            self.shrink_after_oom()
            assert not lease.released
            self.release_after_oom(lease)

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 10**6))
    def oom_hits(self, pick: int) -> None:
        """A running request fails with an OOM; its release and its shrink come later, each
        on its own, with any other events between them."""
        lease, _ = self.held.pop(pick % len(self.held))
        self.failing.append(_Failing(lease))

    @precondition(lambda self: any(not f.released for f in self.failing))
    @rule(pick=st.integers(0, 10**6))
    def oom_thread_returns(self, pick: int) -> None:
        pending = [f for f in self.failing if not f.released]
        failing = pending[pick % len(pending)]
        failing.released = True
        self.release_after_oom(failing.lease)
        self.failing = [f for f in self.failing if not (f.released and f.shrunk)]

    @precondition(lambda self: any(not f.shrunk for f in self.failing))
    @rule(pick=st.integers(0, 10**6))
    def oom_reaches_the_caller(self, pick: int) -> None:
        pending = [f for f in self.failing if not f.shrunk]
        failing = pending[pick % len(pending)]
        failing.shrunk = True
        assert failing.lease.released is failing.released
        self.shrink_after_oom()
        self.failing = [f for f in self.failing if not (f.released and f.shrunk)]

    @rule(periods=st.integers(0, 3))
    def regrow(self, periods: int) -> None:
        """``_regrow_budget`` (called every publish period) after ``periods`` quiet periods:
        one additive step per full quiet period since the last change, up to the measured
        budget; the budget is set only if the AIMD changed."""
        self.now_s += periods * self.aimd.quiet_s
        self.expired_up_to_now = self.expired_up_to_now and periods == 0
        expected = None
        steps = int((self.now_s - self.aimd_changed_at) // self.aimd.quiet_s)
        if self.aimd_bytes < self.aimd.measured_bytes and steps > 0:
            step_bytes = max(1, int(self.aimd.measured_bytes * self.aimd.increase_fraction))
            expected = min(self.aimd.measured_bytes, self.aimd_bytes + steps * step_bytes)
        budget_bytes = self.aimd.regrow()
        assert budget_bytes == expected
        if budget_bytes is not None:
            self.aimd_bytes = budget_bytes
            self.aimd_changed_at += steps * self.aimd.quiet_s
            self.change_budget(budget_bytes, from_aimd=True)

    @precondition(lambda self: self.evicted)
    @rule(pick=st.integers(0, 10**6))
    def cancel_evicted(self, pick: int) -> None:
        """A late cancel of an evicted waiter changes nothing."""
        waiter = self.evicted[pick % len(self.evicted)]
        reserved, depth = self.budget.reserved_bytes, self.queue.queue_depth
        self.reconcile(self.queue.cancel(waiter))
        assert (self.budget.reserved_bytes, self.queue.queue_depth) == (reserved, depth)
        assert waiter.lease is None

    # --- invariants ------------------------------------------------------------------------

    def leased(self) -> list[Lease]:
        """Every lease the model says is unreleased."""
        return [lease for lease, _ in self.held] + [f.lease for f in self.failing
                                                    if not f.released]

    @invariant()
    def bytes_add_up(self) -> None:
        if self.queue is None:
            return
        budget = self.budget
        # Leases above the budget only when it shrank below them, and never more than then.
        assert 0 <= budget.reserved_bytes <= self.reserved_cap
        assert self.reserved_cap >= budget.budget_bytes
        assert budget.reserved_bytes == sum(lease.nbytes for lease in self.leased())
        assert budget.active_leases == len(self.leased())
        assert all(not lease.released for lease in self.leased())
        assert budget.charged_bytes_total == budget.released_bytes_total + budget.reserved_bytes

    @invariant()
    def budget_within_bounds(self) -> None:
        if self.queue is None:
            return
        budget = self.budget.budget_bytes
        assert 1 <= budget <= self.queue.max_budget_bytes == self.aimd.measured_bytes
        assert self.aimd.floor_bytes <= self.aimd.current_bytes == self.aimd_bytes
        assert self.aimd_bytes <= self.aimd.measured_bytes
        if self.budget_from_aimd:
            assert budget == self.aimd.current_bytes >= self.aimd.floor_bytes

    @invariant()
    def every_waiter_fits_ever(self) -> None:
        if self.queue is None:
            return
        assert all(self.budget.fits_ever(w.nbytes) for w in self.waiting)
        assert all(w.evicted and w.lease is None for w in self.evicted)
        assert not {id(w) for w in self.evicted} & {id(w) for w in self.waiting}

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
        """Work-conserving: nobody waits while the head of the queue could run, i.e. while
        leased + head fit the budget (which a shrunk budget may be below: then the head waits
        whatever its size; ``on_admit`` checks the other side, that no admission overfills)."""
        if self.waiting:
            assert not self.fits_now(self.budget.reserved_bytes, self.waiting[0].nbytes)

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
        for failing in self.failing:
            if not failing.released:
                self.held.append((failing.lease, None))
        self.failing = []
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
