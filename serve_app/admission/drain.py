"""Measured drain rate of a replica, and the ``Retry-After`` it implies."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

# Upper clamp of Retry-After, seconds: a stalled replica must not send clients away for hours.
MAX_RETRY_AFTER_S = 60


class DrainRateEstimator:
    """Bytes of leases released per second over a sliding window.

    The rate is ``bytes released in the last window_s / min(window_s, time since start)``: the
    plain windowed average, so one early completion does not read as an infinite rate.

    Args:
        window_s: length of the window, seconds (> 0).
        clock: monotonic time source in seconds (injected for tests).
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._clock = clock
        self._started_at = clock()
        self._events: deque[tuple[float, int]] = deque()
        self._bytes_in_window = 0

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

    def retry_after_s(self, bytes_needed: int, fallback_s: float,
                      max_s: int = MAX_RETRY_AFTER_S) -> int:
        """:func:`retry_after_s` at this estimator's current rate."""
        return retry_after_s(bytes_needed, self.bytes_per_s(), fallback_s, max_s)



def retry_after_s(bytes_needed: int, bytes_per_s: float | None, fallback_s: float,
                  max_s: int = MAX_RETRY_AFTER_S) -> int:
    """Whole seconds until ``bytes_needed`` more bytes should have drained, in ``[1, max_s]``.

    Args:
        bytes_needed: bytes that must be released before the request would be admitted.
        bytes_per_s: the measured drain rate, or ``None`` if nothing drained recently.
        fallback_s: the answer when no rate was measured (for example the queue's wait limit:
            nothing drains faster than work finishes).
        max_s: upper clamp, so a stalled replica does not send clients away for hours.
    """
    estimate_s = fallback_s if not bytes_per_s else max(bytes_needed, 0) / bytes_per_s
    return max(1, math.ceil(min(float(max_s), estimate_s)))
