"""Device memory probes: the replica's share of its device, what it holds, and peaks.

Each probe says how it measured (``method``), so a profile never passes host memory off as
CUDA memory. torch is imported lazily, only by the CUDA probe.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psutil


class DeviceProbe(Protocol):
    """What a replica needs to know about its device."""

    device: str
    method: str
    #: How many times the profiler measures each shape (it keeps the median): 1 where peaks
    #: are exact, more where they are noisy.
    repeats: int

    def capacity_bytes(self) -> int:
        """The replica's share of the device, bytes."""

    def used_bytes(self) -> int:
        """What this process holds on the device now, bytes."""

    def start_peak(self) -> int:
        """Start measuring a peak; return the baseline (bytes in use now)."""

    def peak_bytes(self) -> int:
        """Highest use since :meth:`start_peak`, bytes (absolute, not above the baseline)."""

    def begin_request(self) -> None:
        """Start measuring one request's peak (cheap: called before every inference)."""

    def request_peak_bytes(self) -> int | None:
        """Peak bytes above the use at :meth:`begin_request`, or ``None`` where this request
        was not measured (the host probe samples, see :class:`HostMemoryProbe`)."""

    def memory_snapshot(self) -> dict[str, int]:
        """Memory now, keyed by metric name (``device_allocated_bytes``,
        ``device_reserved_bytes``, ``host_resident_bytes``: those the device has)."""


def _proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise OSError(f"/proc/self/status has no {field}")


class HostMemoryProbe:
    """CPU: the "device" is host memory.

    Capacity is ``capacity_override_bytes`` if given, else ``host_fraction`` of the RAM
    available when the probe is created (``psutil.virtual_memory().available``). Use is the
    process's resident set (``VmRSS``).

    Peaks are the resident-set high-water mark (``VmHWM`` of ``/proc/self/status``), reset
    before each measurement by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0, see
    ``man 5 proc``), after ``malloc_trim(0)`` returns freed heap pages to the kernel so that
    pages cached by glibc from an earlier run do not hide this run's growth. Where
    ``/proc/self/clear_refs`` cannot be written, the probe says so in ``method`` and the peak
    is the high-water mark since process start (an over-estimate).

    These peaks are noisy: the same shape measured 8 times in a row on the 2-core dev machine
    read 1.7-3.6 MiB (batch 2 x 32 tokens, MiniLM) and 18-26 MiB (8 x 96), as glibc arenas
    and oneDNN's per-shape caches come and go. Hence :attr:`repeats` = 3 and the median.
    """

    repeats = 3
    #: Per-request peaks are measured on at most one inference per this many seconds: a
    #: measurement returns freed heap pages to the kernel (``malloc_trim``), which the next
    #: inference faults back in. Measured on the 2-core dev machine (MiniLM, batches of 9
    #: sentences, 1 torch thread): 46.5 ms per pass measured every time vs 43.5 ms unmeasured.
    peak_sample_interval_s = 1.0

    def __init__(self, capacity_override_bytes: int | None = None,
                 host_fraction: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self.device = "cpu"
        self._capacity_override_bytes = capacity_override_bytes
        self._host_fraction = host_fraction
        self._available_at_start = psutil.virtual_memory().available
        libc_name = ctypes.util.find_library("c")
        self._libc = ctypes.CDLL(libc_name) if libc_name else None
        self._request_baseline: int | None = None
        self._clock = clock
        self._last_sample_s = -math.inf
        self._can_reset_peak = self._reset_peak()
        source = ("memory.capacity_bytes" if capacity_override_bytes is not None
                  else f"{host_fraction:g} x available RAM")
        peak = ("VmHWM after malloc_trim + clear_refs" if self._can_reset_peak
                else "VmHWM since process start (clear_refs not writable)")
        self.method = f"host RSS; peaks: {peak}; capacity from {source}"

    def capacity_bytes(self) -> int:
        if self._capacity_override_bytes is not None:
            return self._capacity_override_bytes
        return int(self._available_at_start * self._host_fraction)

    def used_bytes(self) -> int:
        return self.resident_bytes()

    @staticmethod
    def resident_bytes() -> int:
        """This process's resident set (``VmRSS``), bytes."""
        return _proc_status_bytes("VmRSS")

    def start_peak(self) -> int:
        self._reset_peak()
        return self.used_bytes()

    def peak_bytes(self) -> int:
        return _proc_status_bytes("VmHWM")

    def begin_request(self) -> None:
        # malloc_trim + clear_refs + two /proc reads: 0.09 ms with 200 MB resident (measured
        # on the dev machine), plus the pages the next inference faults back in.
        now_s = self._clock()
        if now_s - self._last_sample_s < self.peak_sample_interval_s:
            self._request_baseline = None
            return
        self._last_sample_s = now_s
        self._request_baseline = self.start_peak()

    def request_peak_bytes(self) -> int | None:
        if self._request_baseline is None:
            return None
        return max(0, self.peak_bytes() - self._request_baseline)

    def memory_snapshot(self) -> dict[str, int]:
        return {"host_resident_bytes": self.used_bytes()}

    def _reset_peak(self) -> bool:
        if self._libc is not None and hasattr(self._libc, "malloc_trim"):
            self._libc.malloc_trim(0)
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False


class CudaMemoryProbe:
    """CUDA: capacity is the replica's ``share`` of the card (its ``num_gpus``), capped by what
    was free when the probe was created (another process may already use part of the card).

    Use is ``torch.cuda.memory_reserved`` (what PyTorch's caching allocator holds, which other
    processes cannot use): what the loaded model holds is counted in it. Peaks, of a profiled
    shape and of each request, are ``max_memory_allocated`` after ``reset_peak_memory_stats``
    (https://pytorch.org/docs/stable/notes/cuda.html#memory-management): the bytes the
    request's tensors held at most, exact and the same on every run. Not reserved bytes: the
    allocator reserves whole segments (2 MiB for small blocks, 20 MiB for blocks under 10 MiB,
    and 20 MiB pages of an expandable segment), so a request's reserved peak measured from an
    empty cache is its tensors rounded up to segments, a step function of the shape that no
    smooth cost model fits (measured on an H200, see docs/profiling.md: held-out errors of
    19.5-61.0 % against reserved peaks). What the allocator caches beyond the leased bytes is
    bounded instead by :meth:`limit_to_capacity` and the budget's margin.
    """

    repeats = 1  # the caching allocator's counters are exact byte counts
    method = "torch.cuda: capacity mem_get_info x share (the allocator capped there); use " \
             "memory_reserved; peaks max_memory_allocated"

    def __init__(self, share: float = 1.0, device_index: int = 0,
                 capacity_override_bytes: int | None = None, cuda: Any = None) -> None:
        if cuda is None:  # ``cuda``: torch.cuda, or a stand-in with its functions (tests)
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._index = device_index
        self._share = share
        self._capacity_override_bytes = capacity_override_bytes
        free, total = cuda.mem_get_info(device_index)
        self.free_at_start_bytes, self.total_bytes = free, total
        self.device = f"cuda:{device_index} ({cuda.get_device_name(device_index)})"
        self._request_baseline = 0

    def capacity_bytes(self) -> int:
        if self._capacity_override_bytes is not None:
            return self._capacity_override_bytes
        return int(min(self.total_bytes * self._share, self.free_at_start_bytes))

    def limit_to_capacity(self, limit_bytes: int | None = None) -> float:
        """Cap what this process's caching allocator may reserve at ``limit_bytes`` (default
        :meth:`capacity_bytes`) with ``torch.cuda.set_per_process_memory_fraction``; returns
        the fraction of the card set. Past the cap the allocator first frees the blocks it
        caches and tries again, and raises ``torch.OutOfMemoryError`` only when the live
        tensors themselves do not fit (``c10/cuda/CUDACachingAllocator.cpp``, ``malloc`` and
        ``alloc_block``): cached blocks can then never push a replica past its share of the
        card into its neighbour's (Ray's fractional ``num_gpus`` limits no memory)."""
        limit = self.capacity_bytes() if limit_bytes is None else limit_bytes
        fraction = min(1.0, max(0.0, limit / self.total_bytes))
        self._cuda.set_per_process_memory_fraction(fraction, self._index)
        return fraction

    def used_bytes(self) -> int:
        return self._cuda.memory_reserved(self._index)

    def start_peak(self) -> int:
        self._cuda.synchronize(self._index)
        self._cuda.reset_peak_memory_stats(self._index)
        return self._cuda.memory_allocated(self._index)

    def peak_bytes(self) -> int:
        self._cuda.synchronize(self._index)
        return self._cuda.max_memory_allocated(self._index)

    def begin_request(self) -> None:
        # No synchronize per request: the allocator's counters are host-side and updated at
        # allocation time.
        self._cuda.reset_peak_memory_stats(self._index)
        self._request_baseline = self._cuda.memory_allocated(self._index)

    def request_peak_bytes(self) -> int:
        peak = self._cuda.max_memory_allocated(self._index)
        return max(0, peak - self._request_baseline)

    def memory_snapshot(self) -> dict[str, int]:
        cuda = self._cuda
        return {"device_allocated_bytes": cuda.memory_allocated(self._index),
                "device_reserved_bytes": cuda.memory_reserved(self._index),
                "host_resident_bytes": HostMemoryProbe.resident_bytes()}
