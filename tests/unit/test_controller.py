"""AdmissionController: ``await acquire(nbytes)`` returns a lease or raises, and leaves nothing.

Waiting is driven by the event loop, not by sleeping: tasks are created and ``settle()`` yields
to the loop (``asyncio.sleep(0)``) so they run up to their next wait. Only the queue-timeout
tests wait on real time (a few tens of milliseconds, on ``time.monotonic``).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.admission.controller import Admission, AdmissionController
from serve_app.errors import OverloadedError, RequestTooLargeError


async def settle(rounds: int = 10) -> None:
    """Let every ready task run up to its next wait (a yield, not a wait)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def waiting(controller: AdmissionController, nbytes: int) -> asyncio.Task[Admission]:
    """Start ``acquire(nbytes)`` in a task and check that it is queued."""
    depth = controller.queue.queue_depth
    task = asyncio.create_task(controller.acquire(nbytes))
    await settle()
    assert not task.done(), "expected the acquire to wait"
    assert controller.queue.queue_depth == depth + 1
    return task


def test_acquire_admits_at_once_when_it_fits(make_controller) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        admission = await controller.acquire(40)
        assert admission.queue_wait_s == 0.0
        assert admission.queue_position == 0
        assert admission.lease.nbytes == 40
        assert controller.budget.reserved_bytes == 40
        controller.release(admission.lease)

    asyncio.run(main())


def test_a_queued_acquire_is_woken_when_a_lease_is_released(make_controller, clock) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        held = await controller.acquire(100)
        task = await waiting(controller, 50)
        clock.advance(2.5)
        controller.release(held.lease)
        admission = await task
        assert admission.lease.nbytes == 50
        assert admission.queue_wait_s == 2.5  # measured on the injected clock
        assert admission.queue_position == 0
        assert controller.budget.reserved_bytes == 50
        controller.release(admission.lease)

    asyncio.run(main())


def test_waiters_are_admitted_in_arrival_order(make_controller) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        held = await controller.acquire(100)
        large = await waiting(controller, 95)
        small = await waiting(controller, 10)
        controller.release(held.lease)
        first = await large
        await settle()
        assert not small.done()  # 10 does not fit beside 95, and it does not jump the queue
        controller.release(first.lease)
        second = await small
        assert second.queue_position == 1
        controller.release(second.lease)

    asyncio.run(main())


def test_a_newcomer_that_fits_waits_behind_a_waiter(make_controller) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        held = await controller.acquire(60)
        large = await waiting(controller, 50)
        small = await waiting(controller, 10)  # 40 bytes are free
        assert controller.budget.reserved_bytes == 60
        controller.release(held.lease)
        for task in (large, small):
            controller.release((await task).lease)

    asyncio.run(main())


def test_cancelling_a_waiting_acquire_leaves_nothing_and_unblocks_the_next(
        make_controller) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        held = await controller.acquire(50)
        blocker = await waiting(controller, 80)
        behind = await waiting(controller, 10)
        blocker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocker
        admission = await behind
        assert admission.queue_position == 1
        assert controller.budget.reserved_bytes == 60  # nothing of the cancelled 80
        assert controller.queue.queue_depth == 0
        controller.release(admission.lease)
        controller.release(held.lease)

    asyncio.run(main())


def test_a_cancel_just_before_admission_hands_the_lease_back(make_controller) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        held = await controller.acquire(100)
        cancelled = await waiting(controller, 60)
        behind = await waiting(controller, 50)
        cancelled.cancel()
        controller.release(held.lease)  # admits ``cancelled`` before its task sees the cancel
        rate = controller.queue.drain.bytes_per_s()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        admission = await behind  # the 60 went back, so the 50 behind got in
        assert controller.budget.reserved_bytes == 50
        assert controller.queue.drain.bytes_per_s() == rate  # handed back unused: no drain
        controller.release(admission.lease)

    asyncio.run(main())


def test_a_cancel_just_after_admission_still_cancels(make_controller) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        held = await controller.acquire(100)
        cancelled = await waiting(controller, 60)
        behind = await waiting(controller, 50)
        controller.release(held.lease)  # admits ``cancelled``...
        cancelled.cancel()  # ...and its client leaves in the same tick
        outcome = (await asyncio.gather(cancelled, return_exceptions=True))[0]
        if isinstance(outcome, Admission):  # the cancel was swallowed: clean up, then fail
            controller.release(outcome.lease)
        controller.release((await behind).lease)
        assert isinstance(outcome, asyncio.CancelledError), outcome

    asyncio.run(main())


def test_a_full_queue_raises_overloaded_queue_full(make_controller) -> None:
    controller = make_controller(budget_bytes=100, max_queue_len=1, max_queue_wait_s=1000.0)

    async def main() -> None:
        held = await controller.acquire(100)
        waiter = await waiting(controller, 10)
        with pytest.raises(OverloadedError) as refused:
            await controller.acquire(10)
        err = refused.value
        assert (err.status_code, err.type, err.code) == (503, "overloaded", "queue_full")
        assert err.retry_after_s == 60  # nothing measured: the wait limit, clamped to 60 s
        assert err.queue_position == 1
        assert controller.queue.queue_depth == 1
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        controller.release(held.lease)

    asyncio.run(main())


def test_a_request_larger_than_the_budget_raises_at_once(make_controller) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        with pytest.raises(RequestTooLargeError) as refused:
            await controller.acquire(101)
        err = refused.value
        assert (err.status_code, err.type, err.code) == (400, "invalid_request_error",
                                                         "request_too_large")
        assert "101 bytes" in err.message and "100 bytes" in err.message
        assert err.retry_after_s is None
        assert controller.queue.queue_depth == 0
        assert controller.budget.charged_bytes_total == 0

    asyncio.run(main())


def test_waiting_too_long_raises_overloaded_queue_timeout(make_controller) -> None:
    controller = make_controller(budget_bytes=100, max_queue_wait_s=0.05, clock=time.monotonic)

    async def main() -> None:
        held = await controller.acquire(100)
        started = time.monotonic()
        with pytest.raises(OverloadedError) as refused:
            await controller.acquire(50)
        waited_s = time.monotonic() - started
        err = refused.value
        assert (err.status_code, err.code) == (503, "queue_timeout")
        assert err.retry_after_s >= 1
        assert err.queue_position == 0
        assert 0.04 <= waited_s < 5.0
        assert controller.queue.queue_depth == 0  # the timed-out waiter is gone
        assert controller.budget.reserved_bytes == 100  # and took nothing
        controller.release(held.lease)

    asyncio.run(main())


def test_a_timed_out_head_unblocks_the_waiter_behind_it(make_controller) -> None:
    controller = make_controller(budget_bytes=100, max_queue_wait_s=0.1, clock=time.monotonic)

    async def main() -> None:
        held = await controller.acquire(60)
        head = asyncio.create_task(controller.acquire(50))
        await asyncio.sleep(0.04)  # real time: the one behind arrives 40 ms later
        behind = asyncio.create_task(controller.acquire(10))
        with pytest.raises(OverloadedError, match="waited"):
            await head
        admission = await behind
        assert admission.queue_position == 1
        assert admission.queue_wait_s > 0.0
        controller.release(admission.lease)
        controller.release(held.lease)

    asyncio.run(main())


def test_release_without_running_does_not_feed_the_drain_rate(make_controller, clock) -> None:
    controller = make_controller(budget_bytes=100)
    drain = controller.queue.drain

    async def main() -> None:
        unused = await controller.acquire(40)
        clock.advance(2)
        controller.release(unused.lease, ran=False)
        assert drain.bytes_per_s() is None
        assert controller.budget.reserved_bytes == 0
        ran = await controller.acquire(40)
        controller.release(ran.lease)
        assert drain.bytes_per_s() == pytest.approx(20.0)  # 40 B over the 2 s since start

    asyncio.run(main())


def test_release_without_running_still_admits_waiters(make_controller) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        held = await controller.acquire(100)
        task = await waiting(controller, 70)
        controller.release(held.lease, ran=False)
        controller.release((await task).lease)

    asyncio.run(main())


def test_release_is_idempotent(make_controller, clock) -> None:
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        clock.advance(10)
        admission = await controller.acquire(30)
        controller.release(admission.lease)
        controller.release(admission.lease)
        controller.release(admission.lease, ran=False)
        assert controller.budget.released_bytes_total == 30
        assert controller.queue.drain.bytes_per_s() == pytest.approx(3.0)  # 30 B / 10 s, once

    asyncio.run(main())


async def test_a_shrunk_budget_evicts_waiters_that_no_longer_fit_and_regrowth_admits(
        make_controller) -> None:
    import asyncio

    from serve_app.errors import OverloadedError, RequestTooLargeError

    controller = make_controller(budget_bytes=100, max_queue_len=4, max_queue_wait_s=60)
    held = await controller.acquire(60)
    big = asyncio.create_task(controller.acquire(80))
    small = asyncio.create_task(controller.acquire(30))
    await asyncio.sleep(0)
    controller.set_budget_bytes(50, retry_after_s=7)
    with pytest.raises(OverloadedError) as evicted:
        await big
    assert (evicted.value.code, evicted.value.retry_after_s) == ("oom", 7)
    # A newcomer larger than the shrunk budget is refused as transient (503), not as 400 ...
    with pytest.raises(OverloadedError) as refused:
        await controller.acquire(80)
    assert refused.value.code == "oom" and refused.value.retry_after_s >= 1
    # ... while one larger than the measured budget still can never run.
    with pytest.raises(RequestTooLargeError):
        await controller.acquire(101)
    controller.release(held.lease)  # 30 fits the shrunk budget once 60 are back
    admitted = await small
    controller.set_budget_bytes(1000, retry_after_s=1)  # regrowth is capped at the measured
    assert controller.budget.budget_bytes == 100
    controller.release(admitted.lease)


def test_a_refusal_for_want_of_time_waits_for_the_admitted_backlog(make_controller,
                                                                    clock) -> None:
    controller = make_controller(budget_bytes=1000, max_queue_len=4, max_queue_wait_s=1000.0)

    async def main() -> None:
        done = await controller.acquire(100)
        clock.advance(2.0)
        controller.release(done.lease)  # 100 bytes drained over 2 s: 50 bytes/s
        held = [await controller.acquire(200) for _ in range(2)]  # admitted, not yet run
        # Room in the budget (600 free): by bytes, a 100-byte request could go now (the
        # precise wait's floor, 1 ms; Retry-After rounds it up to 1 s)...
        assert controller.retry_after_s(100) == 0.001
        # ...but if it waited out its bound for the thread, 400 + 100 bytes must drain first.
        assert controller.backlog_retry_after_s(100) == 10
        for admission in held:
            controller.release(admission.lease)

    asyncio.run(main())


def test_time_spent_before_the_replica_counts_against_the_queue_wait(make_controller,
                                                                      clock) -> None:
    controller = make_controller(budget_bytes=100, max_queue_len=4, max_queue_wait_s=10.0)

    async def main() -> None:
        at_once = await controller.acquire(40, waited_s=3.0)
        assert at_once.queue_wait_s == 3.0  # admitted on arrival, after 3 s on the way
        held = await controller.acquire(60)
        waiter = asyncio.create_task(controller.acquire(50, waited_s=7.5))
        await settle()
        clock.advance(1.0)
        controller.release(held.lease)
        admission = await waiter
        assert admission.queue_wait_s == 8.5
        for granted in (at_once, admission):
            controller.release(granted.lease)

    asyncio.run(main())


def test_a_queued_request_keeps_only_what_is_left_of_its_wait(make_queue, clock) -> None:
    queue = make_queue(budget_bytes=100, max_queue_len=4, max_queue_wait_s=10.0)
    held = queue.submit(100).lease
    late = queue.submit(10, waited_s=7.5).waiter
    gone = queue.submit(10, waited_s=12.0).waiter  # already past its bound
    assert (late.deadline, gone.deadline) == (clock() + 2.5, clock())
    assert queue.expire() == [gone]
    clock.advance(2.5)
    assert queue.expire() == [late]
    queue.release(held)



def test_a_spare_lease_is_taken_only_when_nobody_waits_and_it_fits(make_controller) -> None:
    """A durable job's lease (``spare_lease``): granted at once when it fits and nobody
    waits; ``None`` (nothing reserved) while a request waits or it does not fit; refused
    with 400 when it exceeds the whole budget (it could never run)."""
    controller = make_controller(budget_bytes=100)

    async def main() -> None:
        spare = controller.spare_lease(40, "job-1")
        assert (spare.lease.nbytes, spare.queue_wait_s, spare.queue_position,
                spare.request_id) == (40, 0.0, 0, "job-1")
        assert controller.budget.reserved_bytes == 40
        assert controller.spare_lease(61) is None  # 40 + 61 > 100
        held = await controller.acquire(50)
        task = await waiting(controller, 30)  # a request waits: jobs yield to it
        assert not controller.has_spare_room()
        assert controller.spare_lease(10) is None  # it would fit, but a request waits
        assert controller.budget.reserved_bytes == 90
        controller.release(spare.lease)
        waited = await task  # the waiter got its lease
        assert controller.has_spare_room()
        last = controller.spare_lease(20)
        assert last is not None and controller.budget.reserved_bytes == 50 + 30 + 20
        with pytest.raises(RequestTooLargeError, match="the job needs an estimated 101 bytes "
                           "of device memory, more than the replica's whole budget of 100 "
                           "bytes"):
            controller.spare_lease(101)
        assert controller.budget.reserved_bytes == 100
        for admission in (held, waited, last):
            controller.release(admission.lease)

    asyncio.run(main())


def test_no_spare_lease_while_the_inference_thread_is_backed_up() -> None:
    """Jobs yield to requests answered at once: no spare room while the inference thread's
    backlog is half of ``max_queue_wait_s`` or more."""
    backlog_s = [0.0]
    controller = AdmissionController(100, 8, 10.0, thread_wait_s=lambda: backlog_s[0])
    assert controller.has_spare_room()
    backlog_s[0] = 5.0
    assert not controller.has_spare_room()
    assert controller.spare_lease(10) is None and controller.budget.reserved_bytes == 0
    backlog_s[0] = 4.9
    admission = controller.spare_lease(10)
    assert admission is not None and controller.budget.reserved_bytes == 10
    controller.release(admission.lease, ran=False)
    assert controller.budget.reserved_bytes == 0
