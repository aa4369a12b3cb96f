"""DrainRateEstimator: windowed bytes/s of released leases, and the Retry-After it implies."""

from __future__ import annotations

import pytest

from serve_app.admission.drain import DrainRateEstimator


def test_nothing_released_means_no_rate(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    assert drain.bytes_per_s() is None
    clock.advance(5)
    assert drain.bytes_per_s() is None


def test_zero_bytes_released_means_no_rate(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    drain.record(0)
    clock.advance(1)
    assert drain.bytes_per_s() is None


def test_rate_is_bytes_over_time_since_start_before_a_full_window(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    clock.advance(2)
    drain.record(100)
    assert drain.bytes_per_s() == pytest.approx(50.0)  # 100 B / 2 s
    clock.advance(2)
    drain.record(300)
    assert drain.bytes_per_s() == pytest.approx(100.0)  # 400 B / 4 s


def test_rate_is_bytes_over_the_window_once_the_window_is_full(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    clock.advance(30)
    drain.record(500)
    assert drain.bytes_per_s() == pytest.approx(50.0)  # 500 B / 10 s, not / 30 s


def test_one_early_release_is_not_an_infinite_rate(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    drain.record(1)  # at the very start: the span is floored at 1 ms
    assert drain.bytes_per_s() == pytest.approx(1000.0)


def test_releases_older_than_the_window_drop_out(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    clock.advance(10)
    drain.record(1000)  # at t0 + 10
    clock.advance(5)
    drain.record(200)  # at t0 + 15
    clock.advance(5)  # t0 + 20: the first is exactly window_s old, still inside
    assert drain.bytes_per_s() == pytest.approx(120.0)  # 1200 B / 10 s
    clock.advance(0.5)  # t0 + 20.5: the first is out
    assert drain.bytes_per_s() == pytest.approx(20.0)  # 200 B / 10 s
    clock.advance(10)  # everything is out
    assert drain.bytes_per_s() is None


@pytest.mark.parametrize("window_s", [0, -1.0])
def test_window_must_be_positive(window_s: float, clock) -> None:
    with pytest.raises(ValueError, match="window_s must be > 0"):
        DrainRateEstimator(window_s, clock)


def test_retry_after_is_bytes_needed_over_the_rate_rounded_up(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    clock.advance(10)
    drain.record(1000)  # 100 B/s
    assert drain.retry_after_s(500, fallback_s=30) == 5
    assert drain.retry_after_s(501, fallback_s=30) == 6
    assert drain.retry_after_s(2_000, fallback_s=30) == 20


def test_retry_after_is_at_least_one_second(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    clock.advance(10)
    drain.record(1000)
    assert drain.retry_after_s(1, fallback_s=30) == 1
    assert drain.retry_after_s(0, fallback_s=30) == 1
    assert drain.retry_after_s(-500, fallback_s=30) == 1  # already fits: still >= 1


def test_retry_after_is_clamped_to_max_s(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    clock.advance(10)
    drain.record(10)  # 1 B/s
    assert drain.retry_after_s(10_000, fallback_s=5) == 60
    assert drain.retry_after_s(10_000, fallback_s=5, max_s=7) == 7


@pytest.mark.parametrize(("fallback_s", "expected"),
                         [(10.0, 10), (2.2, 3), (0.05, 1), (0.0, 1), (600.0, 60)])
def test_retry_after_falls_back_when_nothing_was_measured(fallback_s: float, expected: int,
                                                          clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    assert drain.retry_after_s(10**9, fallback_s=fallback_s) == expected


def test_retry_after_falls_back_once_releases_leave_the_window(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    drain.record(1_000_000)
    clock.advance(11)
    assert drain.retry_after_s(1, fallback_s=4) == 4


def test_retry_after_with_an_infinite_fallback_is_max_s(clock) -> None:
    drain = DrainRateEstimator(10.0, clock)
    assert drain.retry_after_s(100, fallback_s=float("inf")) == 60
