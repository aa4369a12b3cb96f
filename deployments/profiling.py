"""Load a model, measure its device memory, and fit its cost model: shared by every model
replica at start-up and by ``python -m serve_app profile``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deployments.engines.base import Engine
from deployments.engines.embeddings import EmbeddingEngine
from deployments.engines.fake import FakeEngine
from deployments.engines.generation import GenerationEngine
from deployments.engines.hf import resolve_device, resolve_dtype
from serve_app.config import AppArgs
from serve_app.memory.budget import InsufficientMemoryError, derive_budget_bytes
from serve_app.memory.cost_model import AnalyticCostModel, CostModel
from serve_app.memory.probes import CudaMemoryProbe, DeviceProbe, HostMemoryProbe
from serve_app.memory.profiler import MemoryProfile, load_profile, profile_memory
from serve_app.memory.simulated import SimulatedDevice, SimulatedDeviceProbe

logger = logging.getLogger("ray.serve")

# A saved profile is reused only while the device still offers at least this share of the
# capacity it was measured with, and the loaded model holds about what it held then.
REUSE_MIN_CAPACITY_RATIO = 0.95
REUSE_HELD_TOLERANCE = 0.25


def make_probe(device: str, args: AppArgs) -> DeviceProbe:
    """The probe for ``device`` (``cpu`` or ``cuda``), sized by the config."""
    if device == "cuda":
        return CudaMemoryProbe(share=args.deployment.num_gpus or 1.0,
                               capacity_override_bytes=args.memory.capacity_bytes)
    return HostMemoryProbe(args.memory.capacity_bytes, args.memory.host_fraction)


@dataclass
class MeasuredReplica:
    """A loaded engine and everything measured about its memory.

    Attributes:
        engine: the loaded model.
        probe: how the device was measured.
        profile: the memory profile (measured now, or loaded and re-checked).
        cost_model: what requests are charged (the profile's fitted model).
        max_request_bytes: the price of the largest request the limits allow.
        budget_bytes: the replica's byte budget.
        reused_profile: the profile came from ``memory.profile_path``.
    """

    engine: Engine
    probe: DeviceProbe
    profile: MemoryProfile
    cost_model: CostModel
    max_request_bytes: int
    budget_bytes: int
    reused_profile: bool

    def status(self, args: AppArgs) -> dict:
        """The memory part of ``/v1/status``."""
        return {
            "device": self.probe.device, "method": self.probe.method,
            "capacity_bytes": self.probe.capacity_bytes(), "held_bytes": self.profile.held_bytes,
            "reserve_bytes": args.memory.reserve_bytes,
            "safety_factor": args.memory.safety_factor, "budget_bytes": self.budget_bytes,
            "max_request_bytes": self.max_request_bytes,
            "profile": {**self.profile.summary(), "reused": self.reused_profile},
        }


def measure_replica(args: AppArgs, on_progress: Callable[[str], None] = logger.info,
                    ) -> MeasuredReplica:
    """Load the model, measure what it holds, profile (or reuse a saved profile), derive the
    budget. Blocking: call it off the event loop.

    Raises:
        InsufficientMemoryError: the budget cannot hold the largest allowed request.
        OSError: the model directory is missing or incomplete.
    """
    probe, engine, held_bytes = _load(args)
    path = "fake" if args.model.task == "fake" else args.model.resolved_path()
    largest = largest_request(args, engine)
    profile = _reusable_profile(args, probe, engine, str(path), held_bytes)
    reused = profile is not None
    if profile is None:
        try:
            profile = profile_memory(
                engine.profile_run, probe, AnalyticCostModel(engine.shape),
                task=args.model.task, model_path=str(path), held_bytes=held_bytes,
                max_batch=largest[0], max_prompt_tokens=largest[1],
                max_new_tokens=largest[2], on_progress=on_progress)
        except torch.OutOfMemoryError as exc:
            raise InsufficientMemoryError(
                f"profiling ran out of device memory (largest allowed request: "
                f"{largest[0]} x ({largest[1]} + {largest[2]}) tokens; capacity "
                f"{probe.capacity_bytes()} bytes, model holds {held_bytes}): {exc}. Lower "
                "limits.max_inputs / limits.max_input_tokens / limits.max_tokens, or give the "
                "replica more memory (num_gpus, memory.capacity_bytes).") from None
        on_progress("memory profile:\n" + profile.table())
    max_request_bytes = profile.cost_model.request_bytes(*largest)
    budget_bytes = derive_budget_bytes(
        probe.capacity_bytes(), held_bytes, args.memory.reserve_bytes, args.memory.safety_factor,
        min_request_bytes=max_request_bytes if args.admission.policy == "budget" else 0,
        override_bytes=args.memory.budget_bytes)
    if args.model.task == "fake":  # faults only once measured: profile the model, not them
        fake = args.fake
        engine.oom_probability = fake.oom_probability
        engine.cuda_error_probability = fake.cuda_error_probability
        engine.hang_probability, engine.hang_s = fake.hang_probability, fake.hang_s
        engine.nan_after_oom = fake.nan_after_oom
    return MeasuredReplica(engine, probe, profile, profile.cost_model, max_request_bytes,
                           budget_bytes, reused)


def _load(args: AppArgs) -> tuple[DeviceProbe, Engine, int]:
    """Probe the device, load the engine, and measure what loading it took (bytes)."""
    if args.model.task == "fake":
        share = args.deployment.num_gpus or 1.0
        fake = args.fake
        # One replica's share of the card: the simulated device is per process, so it is
        # built at the share's size and overruns exactly where the replica's share ends.
        device = SimulatedDevice(int(fake.device_capacity_bytes * share),
                                 name=f"{share:g} of a simulated {fake.device_capacity_bytes} "
                                      "byte card")
        probe: DeviceProbe = SimulatedDeviceProbe(device)
        engine: Engine = FakeEngine(device, fake.weights_bytes, fake.bytes_per_token,
                                    fake.bytes_per_request, fake.latency_per_token_s,
                                    fake.dimensions, fake.max_seq_tokens,
                                    fault_seed=fake.fault_seed,
                                    latency_per_pass_s=fake.latency_per_pass_s)
        return probe, engine, device.allocated_bytes
    device_kind = resolve_device(args.model.device)
    probe = make_probe(device_kind, args)
    used_before = probe.used_bytes()
    engine_class = GenerationEngine if args.model.task == "generate" else EmbeddingEngine
    engine = engine_class(args.model.resolved_path(), device_kind,
                          resolve_dtype(args.model.dtype, device_kind),
                          args.model.num_threads or max(1, int(args.deployment.num_cpus)))
    return probe, engine, max(0, probe.used_bytes() - used_before)


def largest_request(args: AppArgs, engine: Engine) -> tuple[int, int, int]:
    """``(batch, prompt_tokens, new_tokens)`` of the largest request the limits allow: for
    embeddings ``limits.max_inputs`` inputs of ``limits.max_input_tokens``; for generation one
    prompt of ``limits.max_input_tokens`` plus ``limits.max_tokens`` new tokens (capped at the
    model's context length)."""
    max_prompt = min(args.limits.max_input_tokens, engine.max_seq_tokens)
    if engine.task == "fake":  # serves both: the larger of the two shapes in each dimension
        max_prompt = min(max_prompt, engine.max_seq_tokens - 1)
        return (args.limits.max_inputs, max_prompt,
                min(args.limits.max_tokens, engine.max_seq_tokens - max_prompt))
    if engine.task == "generate":
        max_prompt = min(max_prompt, engine.max_seq_tokens - 1)
        return 1, max_prompt, min(args.limits.max_tokens, engine.max_seq_tokens - max_prompt)
    return args.limits.max_inputs, max_prompt, 0


def _reusable_profile(args: AppArgs, probe: DeviceProbe, engine: Engine, model_path: str,
                      held_bytes: int) -> MemoryProfile | None:
    path = args.memory.profile_path
    if (saved := load_profile(path)) is None:
        return None
    problems = []
    largest = largest_request(args, engine)
    measured_up_to = tuple(max(getattr(p, f) for p in saved.points)
                           for f in ("batch", "prompt_tokens", "new_tokens"))
    if any(want > have for want, have in zip(largest, measured_up_to, strict=True)):
        problems.append(f"it was measured up to {measured_up_to} (batch, prompt, new tokens), "
                        f"the limits now allow {largest}")
    if (saved.device, saved.task, saved.model_path) != (probe.device, args.model.task,
                                                        model_path):
        problems.append(f"measured on {saved.device} for {saved.task} {saved.model_path}, "
                        f"this replica has {probe.device} for {args.model.task} {model_path}")
    if probe.capacity_bytes() < REUSE_MIN_CAPACITY_RATIO * saved.capacity_bytes:
        problems.append(f"capacity now {probe.capacity_bytes()} bytes, measured with "
                        f"{saved.capacity_bytes}")
    if abs(held_bytes - saved.held_bytes) > REUSE_HELD_TOLERANCE * max(saved.held_bytes, 1):
        problems.append(f"the model holds {held_bytes} bytes now, {saved.held_bytes} then")
    if problems:
        logger.warning("profile %s does not match this device (%s); profiling again",
                       path, "; ".join(problems))
        return None
    return MemoryProfile(**{**saved.__dict__, "held_bytes": held_bytes,
                            "capacity_bytes": probe.capacity_bytes()})
