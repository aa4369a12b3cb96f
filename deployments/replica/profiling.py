"""Load a model, measure its device memory, and fit its cost model: shared by every model
replica at start-up and by ``python -m serve_app profile``. Engine-agnostic: the engine class
(:mod:`deployments.engines.registry`) loads the model on its device, names its request kinds
(whose largest shapes bound the ladder) and runs each profiled shape."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deployments.engines.base import Engine, OpenedEngine
from deployments.engines.registry import engine_class
from serve_app.admission.policy import policy_class
from serve_app.config import AppArgs
from serve_app.kinds import largest_shape
from serve_app.memory.budget import InsufficientMemoryError, derive_budget_bytes
from serve_app.memory.cost_model import CostModel, Shape
from serve_app.memory.expected_output import ExpectedOutput, ExpectedOutputCostModel
from serve_app.memory.kv_pool import KVPool
from serve_app.memory.probes import DeviceProbe
from serve_app.memory.profiler import MemoryProfile, load_profile, profile_memory
from serve_app.memory.reuse import ExpectedProfile, device_kind_of, reuse_problems

logger = logging.getLogger("ray.serve")


@dataclass(kw_only=True)
class MeasuredReplica:
    """A loaded engine and everything measured about its memory.

    Attributes:
        engine: the loaded model.
        engine_class: its class (the registry's choice).
        probe: how the device was measured.
        profile: the memory profile (measured now, or loaded and re-checked).
        cost_model: what requests are charged (the profile's fitted model).
        largest: the largest request the limits allow over the engine's kinds
            (:func:`serve_app.kinds.largest_shape`), the top of the profile's ladder.
        max_request_bytes: its price (``cost_model`` at ``largest``).
        budget_bytes: the replica's byte budget.
        reused_profile: the profile came from ``memory.profile_path``.
    """

    engine: Engine
    engine_class: type[Engine]
    probe: DeviceProbe
    profile: MemoryProfile
    cost_model: CostModel
    largest: Shape
    max_request_bytes: int
    budget_bytes: int
    reused_profile: bool

    def memory_status(self, args: AppArgs) -> dict[str, Any]:
        """The memory part of ``/v1/status``."""
        return {
            "device": self.probe.device, "method": self.probe.method,
            "capacity_bytes": self.probe.capacity_bytes(), "held_bytes": self.profile.held_bytes,
            "reserve_bytes": args.memory.reserve_bytes,
            "safety_factor": args.memory.safety_factor, "budget_bytes": self.budget_bytes,
            "max_request_bytes": self.max_request_bytes,
            "profile": {**self.profile.summary(), "reused": self.reused_profile},
            **self.engine.runtime_status(),
        }


def measure_replica(args: AppArgs, on_progress: Callable[[str], None] = logger.info,
                    ) -> MeasuredReplica:
    """Load the model, measure what it holds, profile (or reuse a saved profile), derive the
    budget. Blocking: call it off the event loop.

    Raises:
        ConfigError: the engine cannot be resolved or refuses ``args``.
        InsufficientMemoryError: the budget cannot hold the largest allowed request (under
            the budget policy), or profiling ran out of device memory.
        OSError: the model directory is missing or incomplete.
    """
    cls = engine_class(args)
    opened = cls.open(args)
    largest = largest_shape(cls.kinds, args.limits, opened.engine.max_seq_tokens)
    if (pool := opened.engine.kv_pool()) is not None:
        return _pooled_replica(args, cls, opened, largest, pool)
    profile = _reusable_profile(args, cls, opened, largest)
    reused = profile is not None
    if profile is None:
        profile = _profile(args, cls, opened, largest, on_progress)
    # The largest shape of every kind at once (the ladder's top), priced as one request.
    max_request_bytes = profile.cost_model.request_bytes(*largest)
    must_fit = policy_class(args.admission.policy).budget_must_hold_largest
    budget_bytes = derive_budget_bytes(
        opened.probe.capacity_bytes(), opened.held_bytes, args.memory.reserve_bytes,
        args.memory.safety_factor, min_request_bytes=max_request_bytes if must_fit else 0,
        override_bytes=args.memory.budget_bytes)
    return MeasuredReplica(engine=opened.engine, engine_class=cls, probe=opened.probe,
                           profile=profile, cost_model=profile.cost_model, largest=largest,
                           max_request_bytes=max_request_bytes, budget_bytes=budget_bytes,
                           reused_profile=reused)


def _pooled_replica(args: AppArgs, cls: type[Engine], opened: OpenedEngine, largest: Shape,
                    pool: KVPool) -> MeasuredReplica:
    """A replica whose engine pages its own KV cache: the budget is the pool, prices are its
    blocks (:meth:`KVPool.cost_model`; under ``admission.kv_lease: expected``, for the new
    tokens expected: :class:`ExpectedOutputCostModel`), nothing is profiled (the engine's
    memory beyond the pool was sized by the engine itself).

    Raises:
        InsufficientMemoryError: the largest request the limits allow needs more blocks than
            the pool holds (under a policy whose budget must hold it).
    """
    cost_model = pool.cost_model()
    max_request_bytes = cost_model.request_bytes(*largest)  # guaranteed: it must fit whole
    if policy_class(args.admission.policy).budget_must_hold_largest \
            and max_request_bytes > pool.pool_bytes:
        raise InsufficientMemoryError(
            f"the KV cache holds {pool.blocks} blocks of {pool.block_tokens} tokens; the "
            f"largest request the limits allow needs {pool.request_blocks(*largest)}: lower "
            "limits.max_input_tokens / limits.max_tokens, or give the replica more memory")
    profile = MemoryProfile(
        device=opened.probe.device, method="the engine's KV pool", task=args.model.engine_name,
        model_path=cls.profile_identity(args), capacity_bytes=opened.probe.capacity_bytes(),
        held_bytes=opened.held_bytes, cost_model=cost_model, points=(), duration_s=0.0,
        shape_axes=cls.shape_axes)
    adm = args.admission
    leased: CostModel = cost_model if adm.kv_lease == "guaranteed" else \
        ExpectedOutputCostModel(cost_model, ExpectedOutput(adm.kv_lease_quantile))
    return MeasuredReplica(engine=opened.engine, engine_class=cls, probe=opened.probe,
                           profile=profile, cost_model=leased, largest=largest,
                           max_request_bytes=max_request_bytes,
                           budget_bytes=min(args.memory.budget_bytes or pool.pool_bytes,
                                              pool.pool_bytes),
                           reused_profile=False)


def _profile(args: AppArgs, cls: type[Engine], opened: OpenedEngine, largest: Shape,
             on_progress: Callable[[str], None]) -> MemoryProfile:
    engine, probe = opened.engine, opened.probe
    try:
        profile = profile_memory(
            engine.profile_run, probe, engine.analytic_model(), features=engine.fit_features,
            ladder=engine.profile_ladder(largest), task=args.model.engine_name,
            model_path=cls.profile_identity(args), held_bytes=opened.held_bytes,
            shape_axes=cls.shape_axes, on_progress=on_progress)
    except torch.OutOfMemoryError as exc:
        raise InsufficientMemoryError(
            f"profiling ran out of device memory (largest allowed request: "
            f"{dict(zip(cls.shape_axes, largest, strict=True))}; capacity "
            f"{probe.capacity_bytes()} bytes, model holds {opened.held_bytes}): {exc}. Lower "
            "limits.max_inputs / limits.max_input_tokens / limits.max_tokens, or give the "
            "replica more memory (num_gpus, memory.capacity_bytes).") from None
    # The replica's log; not a progress line: the profile command prints it in its report.
    logger.info("memory profile:\n%s", profile.table())
    return profile


def _reusable_profile(args: AppArgs, cls: type[Engine], opened: OpenedEngine,
                      largest: Shape) -> MemoryProfile | None:
    path = args.memory.profile_path
    if (saved := load_profile(path)) is None:
        return None
    probe = opened.probe
    expected = ExpectedProfile(
        args.model.engine_name, cls.profile_identity(args),
        device_kind_of(probe.method, probe.device), device=probe.device,
        capacity_bytes=probe.capacity_bytes(), held_bytes=opened.held_bytes, largest=largest)
    if problems := reuse_problems(saved, expected):
        logger.warning("profile %s does not match this device (%s); profiling again",
                       path, "; ".join(problems))
        return None
    return MemoryProfile(**{**saved.__dict__, "held_bytes": opened.held_bytes,
                            "capacity_bytes": probe.capacity_bytes()})
