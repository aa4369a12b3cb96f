"""A simulated accelerator for machines without one: a byte counter with a capacity.

Allocations beyond the capacity raise ``torch.OutOfMemoryError``, the type PyTorch raises for
CUDA out-of-memory (``torch.cuda.OutOfMemoryError is torch.OutOfMemoryError`` since torch 2.5),
so the replica's OOM handling is exercised on CPU exactly as on a GPU. Counting is exact: no
caching allocator, no fragmentation, no rounding to blocks.

The device lives in one process. Ray Serve replicas are separate processes, so two replicas
that each build a ``SimulatedDevice`` of 16 GiB get two independent 16 GiB counters, not one
shared card; :class:`SimulatedDeviceProbe` reports each its ``share``, and OOM fires only when
one replica's own allocations pass the whole capacity. To make a replica fail at its share,
build its device with ``capacity_bytes = card_bytes x share``.

No ray, fastapi or torch import at module level; torch is imported only to raise the error.
"""

from __future__ import annotations

import threading
from types import TracebackType

from serve_app.memory.probes import HostMemoryProbe

GIB = 1 << 30
MIB = 1 << 20


def format_bytes(nbytes: int) -> str:
    """``20.00 MiB`` below 1 GiB, ``16.00 GiB`` from 1 GiB up (the units CUDA's message uses)."""
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.2f} MiB"


class Allocation:
    """Bytes held on a :class:`SimulatedDevice` until :meth:`free` (idempotent) is called.

    Also a context manager: ``with device.allocate(n): ...`` frees on exit, on every path.
    """

    __slots__ = ("nbytes", "_device", "_freed")

    def __init__(self, device: SimulatedDevice, nbytes: int) -> None:
        self.nbytes = nbytes
        self._device = device
        self._freed = False

    @property
    def freed(self) -> bool:
        return self._freed

    def free(self) -> None:
        """Return the bytes to the device; later calls do nothing."""
        self._device._release(self)

    def __enter__(self) -> Allocation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else "held"
        return f"Allocation({self.nbytes} bytes, {state})"


class SimulatedDevice:
    """A device of ``capacity_bytes`` whose allocations are counted exactly. Thread-safe: the
    engine thread allocates while the event loop reads the counters.

    Args:
        capacity_bytes: total device memory, bytes (> 0).
        name: shown in probe descriptions and OOM messages.

    Raises:
        ValueError: ``capacity_bytes`` <= 0.
    """

    def __init__(self, capacity_bytes: int, name: str = "simulated") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.name = name
        self._lock = threading.Lock()
        self._allocated_bytes = 0
        self._peak_allocated_bytes = 0
        self._oom_count = 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by live allocations now."""
        with self._lock:
            return self._allocated_bytes

    @property
    def free_bytes(self) -> int:
        """``capacity_bytes - allocated_bytes``."""
        with self._lock:
            return self.capacity_bytes - self._allocated_bytes

    @property
    def peak_allocated_bytes(self) -> int:
        """Highest ``allocated_bytes`` since creation or the last :meth:`reset_peak`."""
        with self._lock:
            return self._peak_allocated_bytes

    @property
    def oom_count(self) -> int:
        """Allocations refused for lack of memory since creation."""
        with self._lock:
            return self._oom_count

    def reset_peak(self) -> int:
        """Set the peak to the current use (like ``torch.cuda.reset_peak_memory_stats``);
        returns it."""
        with self._lock:
            self._peak_allocated_bytes = self._allocated_bytes
            return self._allocated_bytes

    def allocate(self, nbytes: int) -> Allocation:
        """Hold ``nbytes`` (>= 0) until the returned allocation is freed.

        Raises:
            ValueError: ``nbytes`` < 0.
            torch.OutOfMemoryError: fewer than ``nbytes`` are free; nothing is allocated.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        with self._lock:
            allocated = self._allocated_bytes
            fits = allocated + nbytes <= self.capacity_bytes
            if fits:
                self._allocated_bytes = allocated + nbytes
                self._peak_allocated_bytes = max(self._peak_allocated_bytes,
                                                 self._allocated_bytes)
            else:
                self._oom_count += 1
        if not fits:
            raise _out_of_memory(self, nbytes, allocated)
        return Allocation(self, int(nbytes))

    def out_of_memory(self, nbytes: int) -> Exception:
        """The error an allocation of ``nbytes`` that does not fit raises (for injected
        faults: counted in ``oom_count`` like a real overrun)."""
        with self._lock:
            self._oom_count += 1
            allocated = self._allocated_bytes
        return _out_of_memory(self, nbytes, allocated)

    def _release(self, allocation: Allocation) -> None:
        with self._lock:
            if allocation._freed:
                return
            allocation._freed = True
            self._allocated_bytes -= allocation.nbytes

    def __repr__(self) -> str:
        return (f"SimulatedDevice({self.name!r}, capacity={format_bytes(self.capacity_bytes)}, "
                f"allocated={format_bytes(self.allocated_bytes)})")


def _out_of_memory(device: SimulatedDevice, nbytes: int, allocated_bytes: int) -> Exception:
    """The error CUDA would raise, worded like CUDA's message."""
    import torch

    where = "" if device.name == "simulated" else f" on {device.name!r}"
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {format_bytes(nbytes)}{where} (simulated "
        f"device: capacity {format_bytes(device.capacity_bytes)}, allocated "
        f"{format_bytes(allocated_bytes)})")


class SimulatedDeviceProbe:
    """:class:`serve_app.memory.probes.DeviceProbe` over a :class:`SimulatedDevice`.

    Capacity is the replica's ``share`` of the device (its ``num_gpus``: a replica holding 0.5
    of a card sees half). Use is every live allocation on the device object (all of this
    process's, since the device is in-process); peaks are exact, reset by :meth:`start_peak`.

    Args:
        device: the simulated device.
        share: fraction of the device this replica owns, in (0, 1].
        total_bytes: the whole simulated card's size, when ``device`` is built at a
            replica's share of it (default: the device's capacity); the ``profile`` command
            recommends ``num_gpus`` from it, as from a CUDA card's total.

    Raises:
        ValueError: ``share`` outside (0, 1].
    """

    method = "simulated device: allocations counted exactly"
    repeats = 1

    def __init__(self, device: SimulatedDevice, share: float = 1.0,
                 total_bytes: int | None = None) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self._device = device
        self.total_bytes = total_bytes or device.capacity_bytes
        self._share = share
        self.device = f"{device.name} ({device.capacity_bytes / GIB:.1f} GiB)"
        self._request_baseline = 0

    def capacity_bytes(self) -> int:
        return int(self._device.capacity_bytes * self._share)

    def used_bytes(self) -> int:
        return self._device.allocated_bytes

    def start_peak(self) -> int:
        return self._device.reset_peak()

    def peak_bytes(self) -> int:
        return self._device.peak_allocated_bytes

    def begin_request(self) -> None:
        self._request_baseline = self._device.reset_peak()

    def request_peak_bytes(self) -> int:
        return max(0, self._device.peak_allocated_bytes - self._request_baseline)

    def memory_snapshot(self) -> dict[str, int]:
        return {"device_allocated_bytes": self._device.allocated_bytes,
                "host_resident_bytes": HostMemoryProbe.resident_bytes()}
