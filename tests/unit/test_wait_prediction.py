"""Refusing early what cannot be served in time, clients' wait limits, live positions, and the
precise wait behind ``retry-after-ms``."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from deployments.http_errors import error_response
from serve_app.admission.calibration import MIN_ERRORS, WaitCalibration
from serve_app.admission.drain import predicted_wait_s
from serve_app.admission.queue import Outcome, Reason
from serve_app.client_wait import client_wait_limit_s, prefers_async
from serve_app.errors import OverloadedError
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
