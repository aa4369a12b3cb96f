"""The CUDA probe's arithmetic, on CPU: which of the caching allocator's counters it reads
and where it caps the allocator, against a stand-in for ``torch.cuda`` that keeps the
counters as the caching allocator keeps them (a tensor's bytes rounded up into whole
segments; ``c10/cuda/CUDACachingAllocator.cpp``). What the counters read on a real card is
the GPU check's (``scripts/gpu_check``, docs/profiling.md)."""

from __future__ import annotations

import math

import pytest
import torch

from deployments.engines import devices
from serve_app.memory.probes import CudaMemoryProbe

MiB, GiB = 1 << 20, 1 << 30
SEGMENT_BYTES = 20 * MiB  # the segment of a block under 10 MiB (kLargeBuffer)


class StandInCuda:
    """``torch.cuda``'s memory functions over counters: ``allocate`` takes a tensor's bytes
    (allocated) and reserves whole segments for them (reserved), as the caching allocator
    does from an empty cache."""

    def __init__(self, total_bytes: int, free_bytes: int) -> None:
        self.total_bytes, self.free_bytes = total_bytes, free_bytes
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.fractions: list[tuple[float, int]] = []

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        grain = SEGMENT_BYTES if nbytes < 10 * MiB else 2 * MiB  # kMinLargeAlloc, kRoundLarge
        self.reserved += math.ceil(nbytes / grain) * grain
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int) -> None:  # the segment stays cached (reserved)
        self.allocated -= nbytes

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return self.free_bytes, self.total_bytes

    def get_device_name(self, index: int) -> str:
        return "stand-in"

    def set_per_process_memory_fraction(self, fraction: float, index: int) -> None:
        self.fractions.append((fraction, index))

    def synchronize(self, index: int) -> None:
        pass

    def reset_peak_memory_stats(self, index: int) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def memory_allocated(self, index: int) -> int:
        return self.allocated

    def memory_reserved(self, index: int) -> int:
        return self.reserved

    def max_memory_allocated(self, index: int) -> int:
        return self.peak_allocated

    def max_memory_reserved(self, index: int) -> int:
        return self.peak_reserved


def test_a_profiled_peak_is_what_the_tensors_held_not_the_segments_reserved() -> None:
    cuda = StandInCuda(total_bytes=80 * GiB, free_bytes=80 * GiB)
    probe = CudaMemoryProbe(share=0.5, cuda=cuda)
    cuda.allocate(2 * GiB)  # the weights: what the model holds is counted in reserved bytes
    assert probe.used_bytes() == 2 * GiB
    baseline = probe.start_peak()
    cuda.allocate(3 * MiB)  # a small request's activations: one 20 MiB segment reserved
    cuda.allocate(5 * MiB)
    cuda.free(8 * MiB)
    assert probe.peak_bytes() - baseline == 8 * MiB  # not 40 MiB of segments
    probe.begin_request()
    cuda.allocate(MiB)
    assert probe.request_peak_bytes() == MiB


def test_the_allocator_is_capped_at_the_replicas_share_of_the_card() -> None:
    cuda = StandInCuda(total_bytes=80 * GiB, free_bytes=70 * GiB)
    probe = CudaMemoryProbe(share=0.5, device_index=0, cuda=cuda)
    assert probe.capacity_bytes() == 40 * GiB
    assert probe.limit_to_capacity() == pytest.approx(0.5)
    assert probe.limit_to_capacity(10 * GiB) == pytest.approx(0.125)  # a smaller card
    assert probe.limit_to_capacity(100 * GiB) == 1.0  # never beyond the card
    assert [index for _, index in cuda.fractions] == [0, 0, 0]
    # A second replica finding 30 GiB free gets at most that much.
    second = CudaMemoryProbe(share=0.5, cuda=StandInCuda(80 * GiB, 30 * GiB))
    assert second.limit_to_capacity() == pytest.approx(30 / 80)


def test_a_replica_uses_expandable_segments_unless_its_environment_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert not torch.cuda.is_initialized()  # CPU torch: the setting would still be read
    for name in devices.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    devices.default_cuda_allocator()
    assert devices.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    devices.default_cuda_allocator()
    assert devices.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8")
    devices.default_cuda_allocator()  # the newer name counts as the operator's setting
    assert "PYTORCH_CUDA_ALLOC_CONF" not in devices.os.environ
