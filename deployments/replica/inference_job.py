"""One job for the replica's inference thread
(:class:`deployments.replica.inference.InferenceThread`): a forward pass, or a step of
continuous batching."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from deployments.replica.device_health import DeviceHealth
from serve_app.memory.cost_model import failed_allocation_bytes
from serve_app.memory.probes import DeviceProbe


class JobHost(Protocol):
    """What a job needs of the thread that runs it (an ``InferenceThread``)."""

    probe: DeviceProbe
    health: DeviceHealth

    def mark_running(self, started_at: float) -> None: ...


class InferenceJob:
    """One job for the thread: says when the thread took it up, is skipped if its callers
    left before that, and measures its time and peak bytes (the probe's per-request peak).
    After an out-of-memory error it records how many bytes the work needed at least (its
    peak so far + the allocation that failed) and the canary's verdict, then re-raises the
    error without the failed work's frames, so their tensors are freed before the cache is
    emptied."""

    def __init__(self, work: Callable[[], Any], loop: asyncio.AbstractEventLoop,
                 thread: JobHost, announce_start: bool = True) -> None:
        self._work, self._loop, self._thread = work, loop, thread
        self._announce_start = announce_start
        self.started = asyncio.Event()
        self.started_at: float | None = None
        self.abandoned = False
        self.refused: set[int] = set()  # members refused while it waited (their indexes)
        self.duration_s = 0.0
        self.peak_bytes: int | None = None  # None: not measured (the host probe samples)
        self.oom_needed_bytes = 0
        self.canary_ok: bool | None = None

    def abandon(self) -> None:
        """Its callers left: the thread skips it if it has not taken it up yet."""
        self.abandoned = True

    def __call__(self) -> Any:  # on the inference thread
        if self.abandoned:
            return None
        self.started_at = time.monotonic()
        self._thread.mark_running(self.started_at)
        if self._announce_start:  # a wake-up of the event loop: only for who waits on it
            self._loop.call_soon_threadsafe(self.started.set)
        probe = self._thread.probe
        probe.begin_request()
        try:
            return self._work()
        except torch.OutOfMemoryError as exc:
            message = str(exc)
            self.oom_needed_bytes = (probe.request_peak_bytes() or 0) \
                + failed_allocation_bytes(message)
        finally:
            self.peak_bytes = probe.request_peak_bytes()
            self.duration_s = time.monotonic() - self.started_at
        self.canary_ok = self._thread.health.recover_after_oom()
        raise torch.OutOfMemoryError(message)
