"""Refusing early what cannot be served in time, clients' wait limits, live positions, and the
precise wait behind ``retry-after-ms``."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from deployments.http.http_errors import error_response
from serve_app.admission.budget import MemoryBudget
from serve_app.admission.calibration import MIN_ERRORS, WaitCalibration
from serve_app.admission.controller import AdmissionController
from serve_app.admission.drain import DrainRateEstimator, predicted_wait_s
from serve_app.admission.queue import AdmissionQueue, Outcome, Reason
from serve_app.client_wait import client_wait_limit_s, prefers_async
from serve_app.errors import OverloadedError
from serve_app.memory.cost_model import FittedCostModel
from serve_app.memory.profiler import MemoryProfile, ProfilePoint
from tests.unit.conftest import assert_idle
from tests.unit.test_queue import admitted, queued


def _drain_at_20_bytes_per_s(queue, clock) -> None:
    clock.advance(2)
    queue.release(admitted(queue, 40).lease)  # 40 B over 2 s


def test_nothing_is_refused_by_prediction_before_a_rate_is_measured(make_queue) -> None:
    queue = make_queue(budget_bytes=100, max_queue_wait_s=1.0)
    held = admitted(queue, 100)
    waiter = queued(queue, 90)  # would need ages: but nothing measured, so it waits
    assert waiter.predicted_wait_s is None
    queue.cancel(waiter)
    queue.release(held.lease)


def test_a_request_whose_predicted_wait_exceeds_its_time_is_refused_at_once(make_queue,
                                                                           clock) -> None:
    queue = make_queue(budget_bytes=100, max_queue_wait_s=10.0)
    _drain_at_20_bytes_per_s(queue, clock)
    held = admitted(queue, 100)
    first = queued(queue, 60)  # (60 + 0 free) / 20 = 3 s: within 10 s
    assert first.predicted_wait_s == pytest.approx(3.0)
    second = queued(queue, 100)  # (60 + 100) / 20 = 8 s
    assert second.predicted_wait_s == pytest.approx(8.0)
    refused = queue.submit(80)  # (160 + 80) / 20 = 12 s > 10 s
    assert (refused.outcome, refused.reason) == (Outcome.REJECTED, Reason.PREDICTED_TIMEOUT)
    assert refused.predicted_wait_s == pytest.approx(12.0)
    assert refused.retry_after_s == pytest.approx(2.0)  # the wait must get 2 s shorter
    assert refused.queue_position == 2
    # A client that will wait 5 s only: the 8 s wait is refused, a 3 s one is not.
    short = queue.submit(100, wait_limit_s=5.0)
    assert short.reason is Reason.PREDICTED_TIMEOUT
    for waiter in (second, first):
        queue.cancel(waiter)
    queue.release(held.lease)


def test_a_client_limit_sets_the_waiter_deadline(make_queue, clock) -> None:
    queue = make_queue(budget_bytes=100, max_queue_wait_s=10.0)
    held = admitted(queue, 100)
    waiter = queue.submit(50, waited_s=0.5, wait_limit_s=2.0).waiter
    assert waiter.deadline == pytest.approx(clock() + 1.5)
    assert queue.time_left_s(0.5, 20.0) == pytest.approx(9.5)  # the replica's bound wins
    queue.cancel(waiter)
    queue.release(held.lease)


def test_the_thread_backlog_counts_when_memory_is_free(make_queue) -> None:
    queue = make_queue(budget_bytes=100, max_queue_wait_s=2.0)
    queue.thread_wait_s = lambda: 3.0  # three passes of a second ahead on the thread
    refused = queue.submit(10)
    assert (refused.reason, refused.predicted_wait_s) == (Reason.PREDICTED_TIMEOUT, 3.0)
    queue.thread_wait_s = lambda: 0.5
    ok = queue.submit(10)
    assert (ok.outcome, ok.predicted_wait_s) == (Outcome.ADMITTED, 0.5)
    queue.release(ok.lease)


def test_predicted_wait_is_the_longer_of_memory_and_thread() -> None:
    assert predicted_wait_s(100, 50.0, 1.0) == 2.0
    assert predicted_wait_s(100, 50.0, 5.0) == 5.0
    assert predicted_wait_s(-30, 50.0) == 0.0  # fits now
    assert predicted_wait_s(100, None) is None
    assert predicted_wait_s(100, None, 0.7) == 0.7


def test_positions_and_etas_of_every_waiter(make_queue, clock) -> None:
    queue = make_queue(budget_bytes=100, max_queue_wait_s=100.0)
    _drain_at_20_bytes_per_s(queue, clock)
    held = admitted(queue, 80)  # 20 free
    waiters = [queued(queue, 40) for _ in range(3)]
    positions = queue.positions()
    assert [positions[w.waiter_id][0] for w in waiters] == [0, 1, 2]
    # bytes up to and including each, less 20 free, over 20 B/s: 1, 3, 5 s
    assert [positions[w.waiter_id][1] for w in waiters] == pytest.approx([1.0, 3.0, 5.0])
    queue.cancel(waiters[0])
    assert [queue.positions()[w.waiter_id][0] for w in waiters[1:]] == [0, 1]
    for waiter in waiters[1:]:
        queue.cancel(waiter)
    queue.release(held.lease)


def test_a_watched_waiter_hears_every_move_up(make_controller) -> None:
    controller = make_controller(budget_bytes=100)
    heard: list[int] = []

    async def main() -> None:
        held = await controller.acquire(100)
        ahead = [asyncio.ensure_future(controller.acquire(100)) for _ in range(3)]
        await asyncio.sleep(0)
        watched = asyncio.ensure_future(controller.acquire(
            100, on_queued=lambda position, eta_s: heard.append(position)))
        await asyncio.sleep(0)
        lease = held.lease
        for task in ahead:
            controller.release(lease)
            lease = (await task).lease
        controller.release(lease)
        controller.release((await watched).lease)

    asyncio.run(main())
    assert heard == [3, 2, 1, 0]


def test_retry_after_ms_keeps_the_fraction_and_survives_pickling() -> None:
    err = OverloadedError("busy", retry_after_s=2.3456)
    assert (err.retry_after_s, err.retry_after_ms) == (3, 2346)
    again = pickle.loads(pickle.dumps(err))
    assert (again.retry_after_s, again.retry_after_ms) == (3, 2346)
    headers = error_response(OverloadedError("busy", retry_after_s=0.25)).headers
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("1", "250")
    assert OverloadedError("busy").retry_after_ms == 1000


@pytest.mark.parametrize(("headers", "limit"), [
    ({}, None),
    ({"prefer": "wait=5"}, 5.0),
    ({"prefer": "respond-async, wait=10"}, 10.0),
    ({"x-stainless-read-timeout": "2.0"}, 2.0),
    ({"prefer": "wait=5", "x-stainless-read-timeout": "600"}, 5.0),
    ({"prefer": "wait=abc", "x-stainless-read-timeout": "-1"}, None),
    ({"x-stainless-read-timeout": "inf"}, None),
    ({"prefer": "wait=0"}, 0.0),  # do not wait: not "no limit"
    ({"prefer": "wait=5", "x-stainless-read-timeout": "0.05"}, 0.0),  # under NO_WAIT_BELOW_S
    ({"x-stainless-read-timeout": "0.1"}, 0.1),
])
def test_client_wait_limit_from_headers(headers, limit) -> None:
    assert client_wait_limit_s(headers) == limit


def test_respond_async_preference() -> None:
    assert prefers_async({"prefer": "respond-async, wait=5"})
    assert prefers_async({"prefer": "Respond-Async"})
    assert not prefers_async({"prefer": "wait=5"}) and not prefers_async({})


def test_an_idle_spell_does_not_read_as_a_slow_drain(make_queue, clock) -> None:
    queue = make_queue(budget_bytes=100, max_queue_wait_s=10.0)
    clock.advance(8)  # idle since the replica started
    lease = admitted(queue, 50).lease
    clock.advance(1)
    queue.release(lease)  # 50 B drained in 1 s of work
    assert queue.drain.bytes_per_s() == pytest.approx(50 / 9)  # the windowed average
    assert queue.drain.busy_bytes_per_s() == pytest.approx(50.0)  # what predictions use
    held = admitted(queue, 100)
    waiter = queued(queue, 100)
    assert waiter.predicted_wait_s == pytest.approx(2.0)  # 100 B at 50 B/s, not 18 s
    queue.cancel(waiter)
    queue.release(held.lease)


def test_work_still_running_does_not_read_as_a_slow_drain(make_queue, clock) -> None:
    # Requests run one at a time, 1 s each: the drain rate is 50 B/s however far the one now
    # running has got (counting its time before it released anything read 50 B over 1.9 s,
    # and the queue behind it was predicted nearly twice its wait; seen in the queue-position
    # test after another module's app).
    queue = make_queue(budget_bytes=60, max_queue_wait_s=10.0)
    first = admitted(queue, 50)
    second = queued(queue, 50)
    clock.advance(1)
    queue.release(first.lease)  # the second is admitted at once: the replica stays busy
    clock.advance(0.9)
    assert queue.drain.busy_bytes_per_s() == pytest.approx(50.0)
    third = queue.submit(50, after_in_flight=True)
    assert third.outcome is Outcome.QUEUED
    assert third.predicted_wait_s == pytest.approx(1.0)  # 50 B in flight at 50 B/s, not 1.9 s
    queue.cancel(third.waiter)
    queue.release(second.lease)


def test_the_margin_is_the_recent_errors_quantile() -> None:
    calibration = WaitCalibration(window=100, quantile=0.9)
    for error_s in range(MIN_ERRORS - 1):
        calibration.record(float(error_s))
    assert calibration.margin_s() == 0.0  # too few errors to trust
    calibration = WaitCalibration(window=100, quantile=0.9)
    for error_s in range(-50, 50):  # -50 .. 49 s
        calibration.record(float(error_s))
    assert calibration.margin_s() == 39.0  # the 90th of 100 (nearest rank)
    for _ in range(100):
        calibration.record(-1.0)  # predictions too long: never a negative margin
    assert calibration.margin_s() == 0.0


def test_requests_are_refused_on_the_prediction_plus_the_margin(make_queue, clock) -> None:
    queue = make_queue(budget_bytes=100, max_queue_wait_s=10.0)
    _drain_at_20_bytes_per_s(queue, clock)
    held = admitted(queue, 100)
    for _ in range(MIN_ERRORS):
        queue.calibration.record(3.0)  # admitted requests waited 3 s longer than predicted
    first = queued(queue, 100)  # predicted 5 s + 3 s margin: within 10 s
    refused = queue.submit(60)  # predicted 8 s + 3 s > 10 s
    assert (refused.reason, refused.predicted_wait_s) == (Reason.PREDICTED_TIMEOUT,
                                                          pytest.approx(8.0))
    assert (refused.retry_after_s, refused.margin_s) == (pytest.approx(1.0), 3.0)
    queue.cancel(first)
    queue.release(held.lease)


def test_a_refusal_by_prediction_names_its_margin(make_controller, clock) -> None:
    controller = make_controller(budget_bytes=100, max_queue_wait_s=10.0)
    queue = controller.queue
    _drain_at_20_bytes_per_s(queue, clock)
    held = admitted(queue, 100)
    for _ in range(MIN_ERRORS):
        queue.calibration.record(3.0)
    first = queued(queue, 100)

    async def scenario() -> OverloadedError:
        with pytest.raises(OverloadedError) as refused:
            await controller.acquire(60)  # predicted 8 s + 3 s margin > 10 s
        return refused.value

    error = asyncio.run(scenario())
    queue.cancel(first)
    assert error.code == "predicted_timeout"
    assert str(error) == ("refused at once: the predicted wait of 8 s plus 3 s by which "
                          "recent predictions fell short exceeds the 10 s this request may "
                          "wait")
    queue.release(held.lease)


def test_a_forward_pass_is_predicted_behind_the_work_leased_before_it(make_queue,
                                                                       clock) -> None:
    # Memory is free, but the thread runs passes in order: a pass request starts only once
    # the 60 B leased before it have drained (3 s at 20 B/s); a sequence joining continuous
    # batching needs only its own bytes free.
    queue = make_queue(budget_bytes=100, max_queue_wait_s=10.0)
    _drain_at_20_bytes_per_s(queue, clock)
    running = admitted(queue, 60)
    assert queue.predicted_wait_s(30) == pytest.approx(0.0)
    assert queue.predicted_wait_s(30, after_in_flight=True) == pytest.approx(3.0)
    refused = queue.submit(30, wait_limit_s=2.0, after_in_flight=True)
    assert (refused.reason, refused.predicted_wait_s) == (Reason.PREDICTED_TIMEOUT,
                                                          pytest.approx(3.0))
    joins = queue.submit(30, wait_limit_s=2.0)  # continuous batching: it starts now
    assert joins.outcome is Outcome.ADMITTED
    queue.release(joins.lease)
    queue.release(running.lease)


def test_a_cold_replica_predicts_from_its_profile(clock) -> None:
    # Nothing drained yet: the profile's rate (20 B/s) stands in, so the third maximal
    # request, 2 x 4 s behind the two leased before it, is refused at once, not after
    # waiting its whole 6 s for nothing.
    queue = AdmissionQueue(MemoryBudget(1000), 8, 6.0, clock=clock,
                           drain=DrainRateEstimator(10.0, clock, prior_bytes_per_s=20.0))
    first, second = admitted(queue, 80), queue.submit(80, after_in_flight=True)
    assert second.outcome is Outcome.ADMITTED
    assert second.predicted_wait_s == pytest.approx(4.0)
    third = queue.submit(80, after_in_flight=True)
    assert (third.reason, third.predicted_wait_s) == (Reason.PREDICTED_TIMEOUT,
                                                      pytest.approx(8.0))
    for decision in (first, second):
        clock.advance(4)
        queue.release(decision.lease)
    assert queue.drain.busy_bytes_per_s() == pytest.approx(20.0)  # measured from now on
    assert_idle(queue)


def test_requests_that_waited_their_whole_limit_raise_the_margin() -> None:
    # A prediction that let a request wait its whole limit in vain is the costly miss: it
    # counts with the errors of admitted requests, else timeouts could never raise the
    # margin. Real timers of 50 ms (the controller waits on asyncio's clock).
    controller = AdmissionController(100, MIN_ERRORS + 1, 0.05,
                                     prior_drain_bytes_per_s=1e6)

    async def scenario() -> list[str]:
        held = await controller.acquire(100)
        outcomes = await asyncio.gather(*(controller.acquire(10) for _ in range(MIN_ERRORS)),
                                        return_exceptions=True)
        controller.release(held.lease)
        return [getattr(outcome, "code", "admitted") for outcome in outcomes]

    assert asyncio.run(scenario()) == ["queue_timeout"] * MIN_ERRORS
    # Each was predicted ~0.1 ms (110 B at 1 MB/s) and waited 50 ms.
    assert 0.04 <= controller.queue.calibration.margin_s() <= 0.5
    assert_idle(controller.queue)


def test_the_profile_gives_its_fastest_measured_drain() -> None:
    def point(price: int, seconds: float) -> ProfilePoint:
        return ProfilePoint(1, 8, 0, measured_bytes=price, predicted_bytes=price,
                            analytic_bytes=0, held_out=False, seconds=seconds)

    fitted = FittedCostModel(("const",), (1.0,))
    profile = MemoryProfile(device="cpu", method="test", task="fake", model_path="fake",
                            capacity_bytes=1 << 30, held_bytes=0, cost_model=fitted,
                            points=(point(100, 2.0), point(900, 3.0), point(50, 0.0)),
                            duration_s=1.0)
    assert profile.drain_bytes_per_s == pytest.approx(300.0)  # the largest: 900 B in 3 s
    faster_small = MemoryProfile(**{**profile.__dict__,
                                    "points": (*profile.points, point(600, 0.5))})
    assert faster_small.drain_bytes_per_s == pytest.approx(300.0)  # not 1200 B/s
    saved_before_times = MemoryProfile.from_dict(
        {**profile.to_dict(), "points": [{**p, "seconds": 0.0} for p in
                                         profile.to_dict()["points"]]})
    assert saved_before_times.drain_bytes_per_s is None  # no prior: predict once measured


def test_a_request_that_will_not_wait_runs_at_once_or_is_refused_at_once(make_queue,
                                                                         clock) -> None:
    queue = make_queue(budget_bytes=100, max_queue_wait_s=10.0)
    now = queue.submit(40, waited_s=0.5, wait_limit_s=0.0)  # nothing ahead: runs
    assert (now.outcome, now.predicted_wait_s) == (Outcome.ADMITTED, 0.0)
    # A pass behind the 40 B leased before it would wait for them: refused, not queued,
    # even before any drain rate is measured (Retry-After: the queue's wait limit).
    behind = queue.submit(40, wait_limit_s=0.0, after_in_flight=True)
    assert (behind.outcome, behind.reason, behind.retry_after_s) == (
        Outcome.REJECTED, Reason.PREDICTED_TIMEOUT, pytest.approx(10.0))
    # A sequence joining continuous batching needs only its own bytes free: it runs.
    joins = queue.submit(40, wait_limit_s=0.0)
    assert joins.outcome is Outcome.ADMITTED
    for decision in (now, joins):
        queue.release(decision.lease)
    _drain_at_20_bytes_per_s(queue, clock)
    held = admitted(queue, 90)  # the budget all but full: 30 B would wait for memory
    full = queue.submit(30, wait_limit_s=0.0)
    assert full.reason is Reason.PREDICTED_TIMEOUT and full.predicted_wait_s > 0
    assert full.retry_after_s == pytest.approx(full.predicted_wait_s)  # the wait it had
    assert queue.queue_depth == 0
    queue.release(held.lease)


def test_a_refusal_of_a_request_that_will_not_wait_says_why(make_controller) -> None:
    controller = make_controller(budget_bytes=100)
    queue = controller.queue
    held = admitted(queue, 100)

    async def scenario() -> OverloadedError:
        with pytest.raises(OverloadedError) as refused:
            await controller.acquire(10, wait_limit_s=0.0)
        return refused.value

    error = asyncio.run(scenario())
    queue.release(held.lease)
    assert error.code == "predicted_timeout" and error.retry_after_s > 0
    assert str(error) == ("refused at once: the client asked not to wait (Prefer: wait=0, or a "
                          "limit under 0.1 s) and the request cannot start now")
