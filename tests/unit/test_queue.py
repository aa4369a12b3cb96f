"""AdmissionQueue: admit, queue in FIFO order, or refuse; deadlines fixed at arrival.

Budgets are 100 bytes unless said otherwise; the clock is the fake one from conftest.
"""

from __future__ import annotations

import pytest

from serve_app.admission.budget import MemoryBudget
from serve_app.admission.queue import AdmissionQueue, Decision, Outcome, Reason, Waiter


def admitted(queue: AdmissionQueue, nbytes: int) -> Decision:
    decision = queue.submit(nbytes)
    assert decision.outcome is Outcome.ADMITTED, decision
    return decision


def queued(queue: AdmissionQueue, nbytes: int) -> Waiter:
    decision = queue.submit(nbytes)
    assert decision.outcome is Outcome.QUEUED, decision
    return decision.waiter


def ids(waiters: list[Waiter]) -> list[int]:
    return [w.waiter_id for w in waiters]


# --- admit at once --------------------------------------------------------------------------


def test_a_request_that_fits_an_empty_queue_is_admitted_at_once(make_queue) -> None:
    queue = make_queue()
    decision = queue.submit(40)
    assert decision.outcome is Outcome.ADMITTED
    assert decision.nbytes == 40
    assert decision.lease.nbytes == 40
    assert (decision.waiter, decision.reason, decision.retry_after_s) == (None, None, None)
    assert decision.queue_position == 0
    assert queue.budget.reserved_bytes == 40
    assert queue.queue_depth == 0
    queue.release(decision.lease)


def test_a_request_of_exactly_the_whole_budget_is_admitted(make_queue) -> None:
    queue = make_queue()
    decision = admitted(queue, 100)
    queue.release(decision.lease)


def test_decision_is_a_frozen_value(make_queue) -> None:
    queue = make_queue()
    decision = admitted(queue, 1)
    with pytest.raises(AttributeError):
        decision.outcome = Outcome.REJECTED  # type: ignore[misc]
    queue.release(decision.lease)


# --- too large ------------------------------------------------------------------------------


def test_a_request_larger_than_the_whole_budget_is_refused_at_once(make_queue) -> None:
    queue = make_queue()
    decision = queue.submit(101)
    assert decision.outcome is Outcome.REJECTED
    assert decision.reason is Reason.REQUEST_TOO_LARGE
    assert decision.reason.value == "request_too_large"
    assert (decision.lease, decision.waiter, decision.retry_after_s) == (None, None, None)
    assert queue.queue_depth == 0
    assert queue.queued_bytes == 0
    assert queue.budget.charged_bytes_total == 0


def test_too_large_is_refused_even_behind_waiters_and_with_a_full_queue(make_queue) -> None:
    queue = make_queue(max_queue_len=1)
    held = admitted(queue, 90)
    waiter = queued(queue, 50)
    decision = queue.submit(10**12)
    assert decision.reason is Reason.REQUEST_TOO_LARGE  # not queue_full: it could never run
    assert queue.queue_depth == 1
    queue.cancel(waiter)
    queue.release(held.lease)


# --- FIFO -----------------------------------------------------------------------------------


def test_a_request_that_does_not_fit_now_waits(make_queue, clock) -> None:
    queue = make_queue(max_queue_wait_s=10.0)
    held = admitted(queue, 70)
    decision = queue.submit(50)
    assert decision.outcome is Outcome.QUEUED
    assert decision.lease is None and decision.reason is None
    waiter = decision.waiter
    assert waiter.nbytes == 50
    assert waiter.enqueued_at == clock()
    assert waiter.deadline == clock() + 10.0
    assert waiter.position == decision.queue_position == 0
    assert waiter.lease is None and waiter.expired is False
    assert queue.queue_depth == 1
    assert queue.queued_bytes == 50
    assert queue.budget.reserved_bytes == 70  # waiting reserves nothing

    assert ids(queue.release(held.lease)) == [waiter.waiter_id]
    assert waiter.lease is not None and waiter.lease.nbytes == 50
    assert queue.queue_depth == 0 and queue.queued_bytes == 0
    queue.release(waiter.lease)


def test_a_newcomer_that_fits_still_queues_behind_a_waiter(make_queue) -> None:
    queue = make_queue()
    held = admitted(queue, 60)
    big = queued(queue, 50)
    decision = queue.submit(10)  # 40 bytes are free, but someone is waiting
    assert decision.outcome is Outcome.QUEUED
    assert decision.queue_position == 1
    assert queue.budget.reserved_bytes == 60
    assert ids(queue.release(held.lease)) == [big.waiter_id, decision.waiter.waiter_id]
    queue.release(big.lease)
    queue.release(decision.waiter.lease)


def test_a_head_that_does_not_fit_blocks_smaller_ones_behind_it(make_queue) -> None:
    queue = make_queue()
    x, y = admitted(queue, 30), admitted(queue, 30)
    big = queued(queue, 80)
    small = queued(queue, 10)
    assert queue.release(x.lease) == []  # 70 free: big still does not fit, small must wait
    assert small.lease is None
    assert queue.queue_depth == 2
    assert ids(queue.release(y.lease)) == [big.waiter_id, small.waiter_id]
    assert queue.budget.reserved_bytes == 90
    queue.release(big.lease)
    queue.release(small.lease)


def test_a_stream_of_small_requests_never_overtakes_a_large_waiter(make_queue) -> None:
    queue = make_queue(max_queue_len=100)
    running = [admitted(queue, 10).lease for _ in range(10)]
    big = queued(queue, 100)
    smalls = []
    for _ in range(10):  # each small request finishes, another arrives: the naive gate
        smalls.append(queued(queue, 10))  # would admit each newcomer and starve ``big``
        admitted_now = queue.release(running.pop())
        if running:
            assert admitted_now == []
    assert big.lease is not None  # admitted the moment the last running lease was released
    assert all(s.lease is None for s in smalls)
    assert ids(queue.release(big.lease)) == ids(smalls)
    for small in smalls:
        queue.release(small.lease)


def test_pump_admits_from_the_head_while_the_head_fits(make_queue) -> None:
    queue = make_queue()
    held = admitted(queue, 100)
    w = [queued(queue, n) for n in (40, 40, 30, 10)]
    # 40 + 40 = 80; the 30 does not fit in the last 20, so the 10 behind it waits too.
    assert ids(queue.release(held.lease)) == ids(w[:2])
    assert queue.queue_depth == 2 and queue.queued_bytes == 40
    assert queue.pump() == []  # pumping again changes nothing
    assert ids(queue.release(w[0].lease)) == ids(w[2:])
    for waiter in w[1:]:
        queue.release(waiter.lease)


def test_a_budget_shrunk_below_its_leases_admits_nobody_until_they_return(make_queue) -> None:
    queue = make_queue()
    held = admitted(queue, 90)
    assert queue.set_budget_bytes(60) == []
    # Not even a request priced at 0 bytes: 90 + 0 > 60.
    zero = queued(queue, 0)
    assert queue.pump() == []
    assert ids(queue.release(held.lease)) == ids([zero])
    queue.release(zero.lease)


# --- cancel ---------------------------------------------------------------------------------


def test_a_cancelled_waiter_leaves_at_once_and_unblocks_those_behind(make_queue) -> None:
    queue = make_queue()
    held = admitted(queue, 50)
    big = queued(queue, 80)
    small_a, small_b = queued(queue, 20), queued(queue, 30)
    assert ids(queue.cancel(big)) == [small_a.waiter_id, small_b.waiter_id]
    assert big.lease is None
    assert queue.queue_depth == 0 and queue.queued_bytes == 0
    assert queue.budget.reserved_bytes == 100
    for lease in (held.lease, small_a.lease, small_b.lease):
        queue.release(lease)


def test_cancelling_a_waiter_in_the_middle_keeps_the_order_of_the_rest(make_queue) -> None:
    queue = make_queue()
    held = admitted(queue, 100)
    a, b, c = queued(queue, 30), queued(queue, 30), queued(queue, 30)
    assert queue.cancel(b) == []
    assert queue.queue_depth == 2 and queue.queued_bytes == 60
    assert ids(queue.release(held.lease)) == [a.waiter_id, c.waiter_id]
    queue.release(a.lease)
    queue.release(c.lease)


def test_cancelling_twice_or_after_expiry_is_harmless(make_queue, clock) -> None:
    queue = make_queue(max_queue_wait_s=5.0)
    held = admitted(queue, 100)
    waiter = queued(queue, 10)
    queue.cancel(waiter)
    assert queue.cancel(waiter) == []
    late = queued(queue, 10)
    clock.advance(5.0)
    assert queue.expire() == [late]
    assert queue.cancel(late) == []
    assert queue.queued_bytes == 0
    queue.release(held.lease)


def test_cancelling_an_admitted_waiter_returns_its_bytes_without_counting_drain(
        make_queue) -> None:
    queue = make_queue()
    held = admitted(queue, 100)
    waiter = queued(queue, 60)
    behind = queued(queue, 70)
    admitted_by_release = queue.release(held.lease)
    assert admitted_by_release == [waiter]
    rate_before = queue.drain.bytes_per_s()
    # The client left between admission and use: its lease goes back, the next one fits.
    assert queue.cancel(waiter) == [behind]
    assert waiter.lease.released is True
    assert queue.drain.bytes_per_s() == rate_before  # unused bytes say nothing about drain
    queue.release(behind.lease)


# --- full queue -----------------------------------------------------------------------------


def test_a_full_queue_refuses_with_retry_after(make_queue) -> None:
    queue = make_queue(max_queue_len=2, max_queue_wait_s=10.0)
    held = admitted(queue, 100)
    waiters = [queued(queue, 10), queued(queue, 10)]
    decision = queue.submit(10)
    assert decision.outcome is Outcome.REJECTED
    assert decision.reason is Reason.QUEUE_FULL
    assert decision.retry_after_s >= 1
    assert decision.retry_after_s == 10  # nothing measured yet: the wait limit
    assert decision.queue_position == 2
    assert decision.lease is None and decision.waiter is None
    assert queue.queue_depth == 2 and queue.queued_bytes == 20
    for waiter in waiters:
        queue.cancel(waiter)
    queue.release(held.lease)


def test_queue_full_retry_after_comes_from_the_measured_drain_rate(make_queue, clock) -> None:
    queue = make_queue(max_queue_len=1, drain_window_s=10.0)
    clock.advance(2)
    queue.release(admitted(queue, 40).lease)  # 40 B drained in 2 s: 20 B/s
    held = admitted(queue, 100)
    waiter = queued(queue, 50)
    decision = queue.submit(30)
    # 50 queued + 30 asked - 0 free = 80 bytes must drain, at 20 B/s: 4 s.
    assert decision.reason is Reason.QUEUE_FULL
    assert decision.retry_after_s == 4
    queue.cancel(waiter)
    queue.release(held.lease)


def test_a_zero_length_queue_admits_what_fits_and_refuses_the_rest(make_queue) -> None:
    queue = make_queue(max_queue_len=0)
    held = admitted(queue, 90)
    decision = queue.submit(20)
    assert decision.reason is Reason.QUEUE_FULL
    assert decision.retry_after_s >= 1
    assert decision.queue_position == 0
    small = admitted(queue, 10)
    queue.release(small.lease)
    queue.release(held.lease)


def test_negative_max_queue_len_is_refused() -> None:
    with pytest.raises(ValueError, match="max_queue_len must be >= 0, got -1"):
        AdmissionQueue(MemoryBudget(10), -1, 1.0)


# --- deadlines ------------------------------------------------------------------------------


def test_expire_removes_exactly_the_waiters_past_their_deadline(make_queue, clock) -> None:
    queue = make_queue(max_queue_wait_s=10.0)
    held = admitted(queue, 100)
    t0 = clock()
    first = queued(queue, 10)
    clock.advance(4)
    second = queued(queue, 20)
    assert (first.deadline, second.deadline) == (t0 + 10, t0 + 14)

    clock.advance(5.5)  # t0 + 9.5
    assert queue.expire() == []
    clock.advance(0.5)  # t0 + 10: the first's deadline
    assert queue.expire() == [first]
    assert first.expired is True and second.expired is False
    assert queue.queue_depth == 1 and queue.queued_bytes == 20
    clock.advance(3.75)
    assert queue.expire() == []
    clock.advance(0.25)  # t0 + 14: the second's deadline
    assert queue.expire() == [second]
    assert queue.queue_depth == 0 and queue.queued_bytes == 0
    queue.release(held.lease)


def test_a_wake_up_that_admits_nobody_does_not_restart_the_deadline(make_queue, clock) -> None:
    queue = make_queue(max_queue_wait_s=10.0)
    small, large = admitted(queue, 20), admitted(queue, 80)
    t0 = clock()
    waiter = queued(queue, 90)
    clock.advance(6)
    assert queue.release(small.lease) == []  # woken, still does not fit
    assert waiter.deadline == t0 + 10
    clock.advance(3.5)
    assert queue.expire() == []
    clock.advance(0.5)  # 10 s after arrival, not 10 s after the wake-up
    assert queue.expire() == [waiter]
    queue.release(large.lease)


def test_an_expired_head_unblocks_those_behind_it(make_queue, clock) -> None:
    seen: list[Waiter] = []
    queue = make_queue(max_queue_wait_s=10.0, on_admit=seen.append)
    held = admitted(queue, 50)
    big = queued(queue, 80)
    clock.advance(1)
    small = queued(queue, 20)
    clock.advance(9)
    assert queue.expire() == [big]  # returns the expired, not the admitted
    assert seen == [small]
    assert small.lease is not None and small.expired is False
    queue.release(small.lease)
    queue.release(held.lease)


def test_submit_drops_expired_waiters_before_deciding(make_queue, clock) -> None:
    queue = make_queue(max_queue_len=1, max_queue_wait_s=10.0)
    held = admitted(queue, 50)
    stale = queued(queue, 80)
    clock.advance(10)
    decision = queue.submit(30)  # the stale waiter is gone: the queue is empty, 30 fits
    assert stale.expired is True
    assert decision.outcome is Outcome.ADMITTED
    queue.release(decision.lease)
    queue.release(held.lease)


def test_timeout_retry_after_counts_the_whole_queue(make_queue, clock) -> None:
    queue = make_queue(max_queue_wait_s=30.0)
    clock.advance(10)
    queue.release(admitted(queue, 100).lease)  # 100 B in 10 s: 10 B/s
    held = admitted(queue, 90)
    a, b, c = queued(queue, 20), queued(queue, 30), queued(queue, 40)
    # Queued 20 + 30 + 40, free 10: 80 B at 10 B/s = 8 s, for the head as for the tail: the
    # head times out first, but everyone behind it will be retrying as well.
    assert queue.timeout_retry_after_s(a) == queue.timeout_retry_after_s(c) == 8
    queue.cancel(a)
    assert queue.timeout_retry_after_s(a) == 8  # once withdrawn, its own bytes still count
    for waiter in (b, c):
        queue.cancel(waiter)
    queue.release(held.lease)


# --- positions and callbacks ----------------------------------------------------------------


def test_queue_position_is_the_number_of_waiters_ahead_at_arrival(make_queue) -> None:
    queue = make_queue()
    held = admitted(queue, 100)
    waiters = [queued(queue, 10) for _ in range(3)]
    assert [w.position for w in waiters] == [0, 1, 2]  # running requests are not counted
    queue.cancel(waiters[0])
    late = queue.submit(10)
    assert late.queue_position == late.waiter.position == 2
    assert waiters[2].position == 2  # the position is a fact about arrival, never rewritten
    for waiter in (*waiters[1:], late.waiter):
        queue.cancel(waiter)
    queue.release(held.lease)


def test_on_admit_is_called_once_per_admitted_waiter_in_order(make_queue, clock) -> None:
    seen: list[Waiter] = []
    queue = make_queue(max_queue_wait_s=10.0, on_admit=seen.append)
    direct = admitted(queue, 60)
    a, b = queued(queue, 50), queued(queue, 50)
    clock.advance(1)
    c = queued(queue, 100)
    assert seen == []  # direct admissions and queueing call nothing

    queue.release(direct.lease)  # admits a and b
    assert seen == [a, b]
    assert all(w.lease is not None for w in seen)
    queue.release(a.lease)
    assert seen == [a, b]  # c needs 100, 50 still held
    queue.release(b.lease)  # admits c
    assert seen == [a, b, c]
    queue.release(c.lease)
    assert seen == [a, b, c]


def test_release_through_the_queue_is_idempotent_and_counts_drain_once(make_queue,
                                                                       clock) -> None:
    queue = make_queue(drain_window_s=10.0)
    clock.advance(10)
    lease = admitted(queue, 50).lease
    queue.release(lease)
    queue.release(lease)
    assert queue.budget.released_bytes_total == 50
    assert queue.drain.bytes_per_s() == pytest.approx(5.0)  # 50 B / 10 s, not 100 B


# --- regressions (found by review) ----------------------------------------------------------------


def test_negative_nbytes_is_refused_even_when_someone_waits(make_queue) -> None:
    queue = make_queue()
    held = admitted(queue, 100)
    waiter = queued(queue, 10)
    decision = None
    try:
        with pytest.raises(ValueError):
            decision = queue.submit(-5)
    finally:  # leave the queue idle either way
        if decision is not None and decision.waiter is not None:
            queue.cancel(decision.waiter)
        queue.cancel(waiter)
        queue.release(held.lease)
