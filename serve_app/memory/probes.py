"""Device memory probes: how much the replica may use, and how much it holds.

Each probe says how it measured (``method``), so a profile never passes host memory off as
CUDA memory. torch is imported lazily, only by the CUDA probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import psutil


class DeviceProbe(Protocol):
    """What a replica needs to know about its device."""

    device: str
    method: str

    def capacity_bytes(self) -> int:
        """The replica's share of the device, bytes."""

    def used_bytes(self) -> int:
        """What this process holds on the device now, bytes."""


@dataclass
class HostMemoryProbe:
    """CPU: the "device" is host memory.

    Capacity is ``capacity_bytes`` if configured, else ``host_fraction`` of the RAM available
    when the probe is created (``psutil.virtual_memory().available``). Use is the process's
    resident set size (``psutil.Process().memory_info().rss``).
    """

    capacity_override_bytes: int | None = None
    host_fraction: float = 0.5
    device: str = "cpu"

    def __post_init__(self) -> None:
        self._available_at_start = psutil.virtual_memory().available
        self._process = psutil.Process()

    @property
    def method(self) -> str:
        source = ("memory.capacity_bytes" if self.capacity_override_bytes is not None
                  else f"{self.host_fraction:g} x available RAM")
        return f"host RSS (psutil); capacity from {source}"

    def capacity_bytes(self) -> int:
        if self.capacity_override_bytes is not None:
            return self.capacity_override_bytes
        return int(self._available_at_start * self.host_fraction)

    def used_bytes(self) -> int:
        return self._process.memory_info().rss


@dataclass
class CudaMemoryProbe:
    """CUDA: capacity is the replica's ``share`` of the card (its ``num_gpus``), capped by what
    was free when the probe was created (another process may already use part of the card).

    Use is ``torch.cuda.memory_reserved`` (what PyTorch's caching allocator holds), see
    https://pytorch.org/docs/stable/notes/cuda.html#memory-management.
    """

    share: float = 1.0
    device_index: int = 0
    capacity_override_bytes: int | None = None
    method: str = "torch.cuda.mem_get_info / memory_reserved"

    def __post_init__(self) -> None:
        import torch

        self._torch = torch
        free, total = torch.cuda.mem_get_info(self.device_index)
        self._free_at_start = free
        self._total = total
        self.device = f"cuda:{self.device_index} ({torch.cuda.get_device_name(self.device_index)})"

    def capacity_bytes(self) -> int:
        if self.capacity_override_bytes is not None:
            return self.capacity_override_bytes
        return int(min(self._total * self.share, self._free_at_start))

    def used_bytes(self) -> int:
        return self._torch.cuda.memory_reserved(self.device_index)
