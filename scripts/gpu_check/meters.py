"""The device's own counters, read beside the replica's probe: what the check compares the
profile, the gate and the OOM handling against.

- :class:`CudaMeter`: ``torch.cuda.max_memory_reserved`` / ``max_memory_allocated``.
- :class:`SimulatedMeter`: the simulated device's exact byte counter.

Both give peaks as ``(reserved, allocated)`` (equal on the simulated device, which has no
cache). The replica's own probe resets the device's peak counters before every job
(``begin_request``), so a burst's peak is folded up job by job:
:class:`PeakTrackingProbe` wraps the replica's probe and reads the meter before each reset.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Pair = tuple[int, int]  # (reserved, allocated) bytes
BALLAST_GRAIN = 2 << 20  # the caching allocator's rounding of large blocks


class _Meter:
    """Running maxima over the device's resettable peak counters."""

    card_bytes: int
    left_free_bytes = 0  # what the last ballast left free

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._folded: Pair = (0, 0)

    def now(self) -> Pair:
        raise NotImplementedError

    def _device_peak(self) -> Pair:
        raise NotImplementedError

    def _reset_device_peak(self) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """Let the device finish and return cached blocks (nothing on the simulated one)."""

    def synchronize(self) -> None:
        """Let the device finish what it was given (nothing on the simulated one)."""

    def reset_peak(self) -> Pair:
        """Start a measurement; returns what is in use now."""
        self.settle()
        with self._lock:
            self._reset_device_peak()
            self._folded = self.now()
        return self._folded

    def fold(self) -> None:
        """Keep the device's peak so far before something resets it."""
        peak = self._device_peak()
        with self._lock:
            self._folded = (max(self._folded[0], peak[0]), max(self._folded[1], peak[1]))

    def peak(self) -> Pair:
        """Highest use since :meth:`reset_peak` (absolute)."""
        self.fold()
        return self._folded


class CudaMeter(_Meter):
    """CUDA's caching allocator counters for device ``index``."""

    def __init__(self, index: int = 0) -> None:
        import torch

        super().__init__()
        self._cuda, self._index = torch.cuda, index
        self.card_bytes = torch.cuda.get_device_properties(index).total_memory

    def now(self) -> Pair:
        cuda = self._cuda
        return cuda.memory_reserved(self._index), cuda.memory_allocated(self._index)

    def _device_peak(self) -> Pair:
        cuda = self._cuda
        cuda.synchronize(self._index)
        return cuda.max_memory_reserved(self._index), cuda.max_memory_allocated(self._index)

    def _reset_device_peak(self) -> None:
        self._cuda.reset_peak_memory_stats(self._index)

    def settle(self) -> None:
        self._cuda.synchronize(self._index)
        self._cuda.empty_cache()

    def synchronize(self) -> None:
        self._cuda.synchronize(self._index)

    def ballast(self, leave_free_bytes: int) -> Callable[[], None]:
        """Take all of the card but ``leave_free_bytes`` with plain allocations (as another
        process would): one piece, or, where the driver will not give that much at once,
        halves of it until what is left free is filled; returns what gives it back."""
        import torch

        self.settle()
        holder: list = []
        piece = None
        for _ in range(64):
            wanted = self._cuda.mem_get_info(self._index)[0] - leave_free_bytes
            size = wanted if piece is None else min(piece, wanted)
            if size < BALLAST_GRAIN:
                break
            try:
                holder.append(torch.empty(size, dtype=torch.uint8, device=f"cuda:{self._index}"))
            except torch.OutOfMemoryError:
                piece = size // 2
        self.left_free_bytes = self._cuda.mem_get_info(self._index)[0]

        def release() -> None:
            holder.clear()
            self.settle()

        return release


class SimulatedMeter(_Meter):
    """A :class:`~serve_app.memory.simulated.SimulatedDevice`'s exact counter."""

    def __init__(self, device: Any) -> None:
        super().__init__()
        self._device = device
        self.card_bytes = device.capacity_bytes

    def now(self) -> Pair:
        used = self._device.allocated_bytes
        return used, used

    def _device_peak(self) -> Pair:
        peak = self._device.peak_allocated_bytes
        return peak, peak

    def _reset_device_peak(self) -> None:
        self._device.reset_peak()

    def ballast(self, leave_free_bytes: int) -> Callable[[], None]:
        """Allocate all of the device but ``leave_free_bytes``; returns what frees it."""
        allocation = self._device.allocate(max(0, self._device.free_bytes - leave_free_bytes))
        self.left_free_bytes = self._device.free_bytes
        return allocation.free


class PeakTrackingProbe:
    """The replica's probe, unchanged, except that the meter folds the device's peak into
    its running maximum before each per-request reset (``begin_request``)."""

    def __init__(self, probe: Any, meter: _Meter) -> None:
        self._probe, self._meter = probe, meter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._probe, name)

    def begin_request(self) -> None:
        self._meter.fold()
        self._probe.begin_request()


def make_meter(kind: str, engine: Any) -> _Meter | None:
    """The meter for a plan's ``meter`` kind (``None`` for ``host``: RSS is not exact)."""
    if kind == "cuda":
        return CudaMeter()
    if kind == "simulated":
        return SimulatedMeter(engine.device)
    return None
