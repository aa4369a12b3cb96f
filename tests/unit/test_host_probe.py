"""The host (CPU) memory probe: per-request peaks, measured at most once per
``peak_sample_interval_s`` (a measurement costs the next inference its freed pages)."""

from __future__ import annotations

import numpy as np

from serve_app.memory.probes import HostMemoryProbe
from tests.unit.conftest import FakeClock

MiB = 1 << 20


def test_per_request_peaks_are_sampled_once_per_interval(clock: FakeClock) -> None:
    probe = HostMemoryProbe(capacity_override_bytes=1 << 30, clock=clock)
    probe.begin_request()
    block = np.ones(64 * MiB // 8)  # 64 MiB touched while "the request" runs
    first = probe.request_peak_bytes()
    del block
    clock.advance(probe.peak_sample_interval_s / 2)
    probe.begin_request()
    assert probe.request_peak_bytes() is None  # within the interval: not measured
    clock.advance(probe.peak_sample_interval_s / 2)
    probe.begin_request()
    again = probe.request_peak_bytes()
    assert first is not None and first >= 60 * MiB
    assert again is not None and again < first
