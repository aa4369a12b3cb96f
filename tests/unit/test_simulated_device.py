"""The simulated device counts bytes exactly, refuses overruns with CUDA's OOM type, and its
probe reports the replica's share."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from serve_app.memory.profiler import measure_peaks
from serve_app.memory.simulated import GIB, MIB, SimulatedDevice, SimulatedDeviceProbe


def test_oom_type_is_the_one_cuda_raises() -> None:
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError


def test_two_half_shares_of_a_16_gib_card_each_see_8_gib() -> None:
    device = SimulatedDevice(16 * GIB)
    probes = [SimulatedDeviceProbe(device, share=0.5) for _ in range(2)]
    assert [p.capacity_bytes() for p in probes] == [8 * GIB, 8 * GIB]
    assert SimulatedDeviceProbe(device).capacity_bytes() == 16 * GIB
    assert probes[0].device == "simulated (16.0 GiB)"
    assert probes[0].method == "simulated device: allocations counted exactly"


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="share"):
        SimulatedDeviceProbe(SimulatedDevice(GIB), share=share)


def test_capacity_and_size_must_be_sensible() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        SimulatedDevice(0)
    with pytest.raises(ValueError, match="negative"):
        SimulatedDevice(100).allocate(-1)


def test_allocations_are_counted_and_freed() -> None:
    device = SimulatedDevice(1000)
    a, b = device.allocate(300), device.allocate(700)  # exactly full is allowed
    assert (device.allocated_bytes, device.free_bytes) == (1000, 0)
    a.free()
    assert device.allocated_bytes == 700 and a.freed and not b.freed
    with device.allocate(200):
        assert device.allocated_bytes == 900
    assert device.allocated_bytes == 700
    b.free()
    assert device.allocated_bytes == 0


def test_free_is_idempotent() -> None:
    device = SimulatedDevice(1000)
    keep, twice = device.allocate(100), device.allocate(250)
    twice.free()
    twice.free()
    with twice:  # exiting a context frees once more: still nothing
        pass
    assert device.allocated_bytes == 100
    keep.free()
    assert device.allocated_bytes == 0


def test_overrun_raises_cuda_oom_and_allocates_nothing() -> None:
    device = SimulatedDevice(16 * GIB)
    held = device.allocate(16 * GIB - 10 * MIB)
    peak = device.peak_allocated_bytes
    with pytest.raises(torch.OutOfMemoryError) as caught:
        device.allocate(20 * MIB)
    assert isinstance(caught.value, torch.cuda.OutOfMemoryError)
    assert str(caught.value) == ("CUDA out of memory. Tried to allocate 20.00 MiB (simulated "
                                 "device: capacity 16.00 GiB, allocated 15.99 GiB)")
    assert device.allocated_bytes == 16 * GIB - 10 * MIB
    assert device.peak_allocated_bytes == peak
    assert device.oom_count == 1
    held.free()
    assert device.allocated_bytes == 0


def test_a_named_device_says_which_in_its_oom_message() -> None:
    with pytest.raises(torch.OutOfMemoryError, match=r"2\.00 MiB on 'gpu1' \(simulated"):
        SimulatedDevice(MIB, name="gpu1").allocate(2 * MIB)


def test_peak_tracks_the_highest_use_and_resets_to_current_use() -> None:
    device = SimulatedDevice(1000)
    base = device.allocate(100)
    burst = device.allocate(600)
    burst.free()
    assert (device.allocated_bytes, device.peak_allocated_bytes) == (100, 700)
    assert device.reset_peak() == 100
    assert device.peak_allocated_bytes == 100
    device.allocate(50).free()
    assert device.peak_allocated_bytes == 150
    base.free()


def test_probe_measures_a_peak_above_its_baseline() -> None:
    device = SimulatedDevice(10_000)
    probe = SimulatedDeviceProbe(device, share=0.5)
    weights = device.allocate(1_000)
    device.allocate(3_000).free()  # before start_peak: must not count
    baseline = probe.start_peak()
    assert baseline == probe.used_bytes() == 1_000
    with device.allocate(400):
        device.allocate(200).free()
    assert probe.peak_bytes() - baseline == 600
    assert probe.used_bytes() == 1_000
    weights.free()


def test_concurrent_allocate_and_free_keep_the_counter_exact() -> None:
    device = SimulatedDevice(10**9)
    threads, rounds = 8, 2_000
    kept: list[list[object]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        start.wait()
        for r in range(rounds):
            allocation = device.allocate(i + 1)
            if r % 2:
                kept[i].append(allocation)
            else:
                allocation.free()
                allocation.free()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as much as the interpreter allows
    try:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(switch)
    expected = sum((i + 1) * (rounds // 2) for i in range(threads))
    assert device.allocated_bytes == expected
    assert expected <= device.peak_allocated_bytes <= expected + sum(range(1, threads + 1))
    for allocations in kept:
        for allocation in allocations:
            allocation.free()
    assert device.allocated_bytes == 0


def test_a_noisy_probe_is_read_several_times_and_the_median_kept() -> None:
    device = SimulatedDevice(GIB)
    probe = SimulatedDeviceProbe(device)
    probe.repeats = 3  # as a noisy probe declares (host RSS)
    readings = iter([5 * MIB, 1 * MIB, 3 * MIB, 2 * MIB, 2 * MIB, 2 * MIB])
    durations = iter([0.5, 0.1, 0.3, 0.2, 0.2, 0.4])
    now = [0.0]

    def run(batch: int, prompt_tokens: int, new_tokens: int) -> None:
        now[0] += next(durations)  # the inference's own time, on a fake clock
        with device.allocate(next(readings)):
            pass

    assert measure_peaks(run, probe, [(1, 8, 0), (2, 8, 0)], on_progress=lambda _: None,
                         clock=lambda: now[0]) == [
        (3 * MIB, 4 * MIB, pytest.approx(0.3)), (2 * MIB, 0, pytest.approx(0.2))]
