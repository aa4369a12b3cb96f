"""Measured drain rate of a replica, and the ``Retry-After`` it implies."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

# Upper clamp of Retry-After, seconds: a stalled replica must not send clients away for hours.
MAX_RETRY_AFTER_S = 60
# Lower clamp of the precise wait (retry-after-ms): 1 ms, the header's resolution.
MIN_WAIT_S = 0.001
# Busy time below which the busy drain rate is not trusted (1 ms: a clock tick, not work).
MIN_BUSY_S = 0.001


class DrainRateEstimator:
    """Bytes of leases released per second over a sliding window.

    The rate is ``bytes released in the last window_s / min(window_s, time since start)``: the
    plain windowed average, so one early completion does not read as an infinite rate.

    Args:
        window_s: length of the window, seconds (> 0).
        clock: monotonic time source in seconds (injected for tests).
        prior_bytes_per_s: the rate to predict with before any lease was released in the
            window (a replica's profile: its fastest measured shape's price over its time,
            :meth:`serve_app.memory.profiler.MemoryProfile.drain_bytes_per_s`), so that a
            cold replica refuses what it cannot start in time instead of letting it wait its
            whole limit; ``None``: no prediction until something drained.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 prior_bytes_per_s: float | None = None):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.prior_bytes_per_s = prior_bytes_per_s or None
        self._window_s = window_s
        self._clock = clock
        self._started_at = clock()
        self._events: deque[tuple[float, int]] = deque()
        self._bytes_in_window = 0
        self._busy_since: float | None = None
        self._busy: deque[tuple[float, float]] = deque()  # finished busy periods

    def record(self, nbytes: int) -> None:
        """Record that a lease of ``nbytes`` was released now."""
        self._events.append((self._clock(), nbytes))
        self._bytes_in_window += nbytes

    def bytes_per_s(self) -> float | None:
        """Released bytes per second over the window, or ``None`` if nothing was released."""
        now = self._clock()
        while self._events and self._events[0][0] < now - self._window_s:
            self._bytes_in_window -= self._events.popleft()[1]
        if self._bytes_in_window <= 0:
            return None
        span_s = min(self._window_s, max(now - self._started_at, 1e-3))
        return self._bytes_in_window / span_s

    def set_busy(self, busy: bool) -> None:
        """The replica started (``True``: its first lease) or stopped (``False``: its last
        lease back) working now."""
        now = self._clock()
        if busy and self._busy_since is None:
            self._busy_since = now
        elif not busy and self._busy_since is not None:
            self._busy.append((self._busy_since, now))
            self._busy_since = None

    def busy_s(self, until: float | None = None) -> float:
        """Seconds of the window in which the replica held any lease, up to ``until`` (a
        clock reading; ``None``: now)."""
        now = self._clock()
        end_at = now if until is None else min(now, until)
        start = now - self._window_s
        while self._busy and self._busy[0][1] < start:
            self._busy.popleft()
        spans = [*self._busy, *(((self._busy_since, now),) if self._busy_since is not None
                                else ())]
        return sum(max(0.0, min(end, end_at) - max(begin, start)) for begin, end in spans)

    def busy_bytes_per_s(self) -> float | None:
        """Released bytes per second *of work* over the window: the bytes over the time the
        replica held leases, so an idle spell before a burst does not read as a slow drain
        (the plain windowed average would, and predictions made on it would refuse the
        burst). The busy time counts up to the last release only: work still running has
        released none of its bytes yet, and counting its time would read a long request in
        flight as a slow drain (measured: a 1.4 s completion read as 2.5 s of work, and the
        three behind it were predicted 11.6 s instead of 6 s). The windowed average
        (:meth:`bytes_per_s`) while the busy time is under ``MIN_BUSY_S`` (no busy time was
        reported); ``prior_bytes_per_s`` while nothing was released in the window."""
        rate = self.bytes_per_s()
        busy_s = self.busy_s(until=self._events[-1][0] if self._events else None)
        if rate is None:
            return self.prior_bytes_per_s
        if busy_s < MIN_BUSY_S:
            return rate
        return max(rate, self._bytes_in_window / busy_s)

    def drain_s(self, bytes_needed: int) -> float | None:
        """Seconds until ``bytes_needed`` more bytes should have drained at the busy rate
        (:meth:`busy_bytes_per_s`), unclamped; ``None`` while no rate is measured (a
        prediction needs a measurement)."""
        rate = self.busy_bytes_per_s()
        return None if not rate else max(bytes_needed, 0) / rate

    def retry_after_s(self, bytes_needed: int, fallback_s: float,
                      max_s: int = MAX_RETRY_AFTER_S) -> int:
        """:func:`retry_after_s` at this estimator's current rate."""
        return retry_after_s(bytes_needed, self.bytes_per_s(), fallback_s, max_s)

    def wait_s(self, bytes_needed: int, fallback_s: float,
               max_s: float = MAX_RETRY_AFTER_S) -> float:
        """:func:`wait_s` at this estimator's current rate."""
        return wait_s(bytes_needed, self.bytes_per_s(), fallback_s, max_s)



def predicted_wait_s(bytes_needed: int, bytes_per_s: float | None,
                     thread_wait_s: float = 0.0,
                     in_flight_bytes: int | None = None) -> float | None:
    """Seconds a request should wait before it starts, the longest of:

    - its wait for memory: ``bytes_needed`` (the bytes queued ahead of it, plus its own, less
      what is free) over the measured drain rate;
    - for work that runs after everything admitted before it (forward passes, which the one
      inference thread runs in order: embeddings, completions off continuous batching), the
      time to drain ``in_flight_bytes`` (leased now plus queued ahead of it) at that rate:
      its memory may be free long before the thread reaches it. ``None`` for work that
      starts as soon as its own bytes are free (a sequence joining continuous batching);
    - its wait for the inference thread (``thread_wait_s``, its backlog of passes).

    The longest, not a sum: these overlap (the thread works through its backlog while the
    request waits for memory). ``None`` while no rate is measured and the thread has no
    backlog: no prediction without a measurement (a replica's first one is its profile's,
    :attr:`DrainRateEstimator.prior_bytes_per_s`).
    """
    if not bytes_per_s:
        return thread_wait_s if thread_wait_s > 0 else None
    waits = [max(bytes_needed, 0) / bytes_per_s, thread_wait_s]
    if in_flight_bytes is not None:
        waits.append(max(in_flight_bytes, 0) / bytes_per_s)
    return max(waits)


def wait_s(bytes_needed: int, bytes_per_s: float | None, fallback_s: float,
           max_s: float = MAX_RETRY_AFTER_S) -> float:
    """Seconds until ``bytes_needed`` more bytes should have drained, in ``[0.001, max_s]``:
    the precise wait behind ``retry-after-ms`` (:class:`serve_app.errors.OverloadedError`
    rounds it up to whole seconds for ``Retry-After``).

    Args:
        bytes_needed: bytes that must be released before the request would be admitted.
        bytes_per_s: the measured drain rate, or ``None`` if nothing drained recently.
        fallback_s: the answer when no rate was measured (for example the queue's wait limit:
            nothing drains faster than work finishes).
        max_s: upper clamp, so a stalled replica does not send clients away for hours.
    """
    estimate_s = fallback_s if not bytes_per_s else max(bytes_needed, 0) / bytes_per_s
    return max(MIN_WAIT_S, min(float(max_s), estimate_s))


def retry_after_s(bytes_needed: int, bytes_per_s: float | None, fallback_s: float,
                  max_s: int = MAX_RETRY_AFTER_S) -> int:
    """:func:`wait_s` in whole seconds, rounded up: in ``[1, max_s]`` (``Retry-After``)."""
    return max(1, math.ceil(wait_s(bytes_needed, bytes_per_s, fallback_s, max_s)))
