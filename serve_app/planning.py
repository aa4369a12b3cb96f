"""Deployment options derived from the config, so no config hand-copies them.

Run where ``serve run`` builds the application, and by ``python -m serve_app profile`` to
recommend options from a fresh measurement. The number of requests a replica can run at once
is ``budget // price of one P95 request``, from, in order of preference:

1. a **measured profile** (``memory.profile_path``, written by ``python -m serve_app
   profile``): the budget from its measured capacity and held bytes, the price from its
   fitted cost model;
2. the **analytic estimate**: the weights and the price from the model's ``config.json``
   through :class:`~serve_app.memory.cost_model.AnalyticCostModel` (for the fake engine: its
   configured, exact costs).

Either way each replica still measures its own device at start-up and is the authority on
admission; these figures only size Ray Serve's per-replica cap.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace

import psutil

from serve_app.config import AppArgs
from serve_app.memory.budget import derive_budget_bytes
from serve_app.memory.cost_model import (
    DTYPE_BYTES,
    AnalyticCostModel,
    CostModel,
    FittedCostModel,
    TransformerShape,
)
from serve_app.memory.profiler import MemoryProfile, load_profile

logger = logging.getLogger(__name__)

# Concurrent requests assumed per replica when the device size is unknown where the app is
# built (a GPU replica planned on a CPU-only head node, without memory.capacity_bytes).
FALLBACK_MAX_RUNNING = 32
MAX_ONGOING_REQUESTS_CAP = 1024
# A recommended num_gpus is a whole number of these steps of one card (1/20 = 0.05).
GPU_SHARE_STEPS_PER_CARD = 20


@dataclass(frozen=True)
class DeploymentPlan:
    """Ray Serve options of the model deployment, and the figures they came from.

    Attributes:
        num_gpus: GPU share per replica (``deployment.num_gpus``).
        max_ongoing_requests: Ray Serve's per-replica cap:
            ``min(MAX_ONGOING_REQUESTS_CAP, max_running_estimate + admission.max_queue_len)``
            (or ``deployment.max_ongoing_requests`` when set), so waiting happens in the
            replica's FIFO (which prices and times out) rather than unseen at the caller.
        max_queued_requests: Ray Serve's bound on requests waiting at each caller (the
            ingress) for a free slot: ``admission.max_queue_len x num_replicas`` (``x
            max_replicas`` when autoscaling: the queue the grown deployment holds, so a burst
            waits at the handle while replicas are added instead of being refused). Beyond it the
            caller gets Ray's back-pressure error, answered as 503 ``queue_full``; without it
            such requests would wait unbounded and unseen.
        max_running_estimate: requests a replica runs at once: ``admission.semaphore_permits``
            under the semaphore policy, else ``max(1, budget_bytes // request_bytes)``.
        how: one line saying where the estimate came from.
        budget_bytes: the replica budget the estimate assumed, bytes (``None``: unknown here).
        request_bytes: the price of one P95 request (:func:`p95_request_shapes`), bytes
            (``None``: unknown here).
        min_num_gpus: the smallest multiple of 0.05 of one card whose budget holds
            ``max_running_estimate`` P95 requests (see :func:`gpu_share_for`); ``0.0`` for a
            CPU device; ``None`` where the card's size is unknown (always when planning at
            build time). May exceed 1.0: then no single card holds them.
    """

    num_gpus: float
    max_ongoing_requests: int
    max_queued_requests: int
    max_running_estimate: int
    how: str
    budget_bytes: int | None = None
    request_bytes: int | None = None
    min_num_gpus: float | None = None


def plan_deployment(args: AppArgs) -> DeploymentPlan:
    """Derive the model deployment's options from ``args``.

    With a readable profile at ``memory.profile_path`` (made for this task and model on this
    kind of device), the plan is :func:`plan_from_profile`'s. Otherwise it is the analytic
    estimate: ``budget = (capacity - weights - reserve) * safety`` (or
    ``memory.budget_bytes``) and ``max_running = max(1, budget // price)``, with the capacity
    from ``memory.capacity_bytes`` (or, for a CPU replica, ``memory.host_fraction`` of the RAM
    available here), the weights' bytes and the price of one P95 request
    (:func:`p95_request_bytes`) from the model's ``config.json`` through
    :class:`~serve_app.memory.cost_model.AnalyticCostModel`. For ``model.task: fake`` the
    capacity is its share of ``fake.device_capacity_bytes`` and weights and price are the
    configured ``fake.*`` costs, which are exact. A GPU replica whose size is unknown here
    gets ``FALLBACK_MAX_RUNNING``. Under the semaphore policy the replica runs
    ``admission.semaphore_permits`` requests whatever the memory.
    ``deployment.max_ongoing_requests`` overrides the result.

    Raises:
        InsufficientMemoryError: the profile leaves no budget (or less than
            ``memory.budget_bytes``) on its device; the message says what to change.
    """
    plan = _profile_plan(args) or _analytic_plan(args)
    if args.deployment.max_ongoing_requests is not None:
        plan = replace(plan, max_ongoing_requests=args.deployment.max_ongoing_requests,
                       how="deployment.max_ongoing_requests")
    return plan


def plan_from_profile(args: AppArgs, profile: MemoryProfile, *, card_bytes: int | None = None,
                      min_budget_bytes: int = 0,
                      source: str = "measured profile") -> DeploymentPlan:
    """The options a measured ``profile`` yields under ``args``: the one computation shared
    by build-time planning and the ``profile`` command's recommendation.

    ``budget_bytes`` is :func:`~serve_app.memory.budget.derive_budget_bytes` of the capacity
    (``memory.capacity_bytes``, else the profile's), the profile's held bytes,
    ``memory.reserve_bytes``, ``memory.safety_factor`` and ``memory.budget_bytes``;
    ``request_bytes`` is the profile's fitted cost model at :func:`p95_request_shapes`;
    ``max_running = max(1, budget // request)`` (permits under the semaphore policy).
    ``deployment.max_ongoing_requests`` is *not* applied here (the plan is what the
    measurement yields); :func:`plan_deployment` applies it.

    Args:
        args: the validated config.
        profile: what a replica (or the ``profile`` command) measured.
        card_bytes: total bytes of the GPU the profile was measured on, to compute
            ``min_num_gpus``; ``None`` leaves it unknown (``0.0`` anyway for a CPU profile).
        min_budget_bytes: the budget must also hold this (the largest request the limits
            allow, under the budget policy); it raises the recommended GPU share, and
            :func:`~serve_app.memory.budget.derive_budget_bytes` refuses a smaller budget.
        source: the start of ``how``, e.g. ``measured profile profiles/vramgate.json``.

    Raises:
        InsufficientMemoryError: the derived budget would be <= 0 or below
            ``min_budget_bytes``, or ``memory.budget_bytes`` exceeds what the device has left.
    """
    mem = args.memory
    budget = derive_budget_bytes(mem.capacity_bytes or profile.capacity_bytes,
                                 profile.held_bytes, mem.reserve_bytes, mem.safety_factor,
                                 min_request_bytes=min_budget_bytes,
                                 override_bytes=mem.budget_bytes)
    price = p95_request_bytes(args, profile.cost_model)
    plan = _plan(args, max_running_requests(budget, price), source, budget, price)
    if profile.device == "cpu":
        share = 0.0
    elif card_bytes is None:
        share = None
    else:
        needed = max(plan.max_running_estimate * price, min_budget_bytes)
        share = gpu_share_for(needed, profile.held_bytes, args, card_bytes)
    return replace(plan, min_num_gpus=share)


def max_running_requests(budget_bytes: int, request_bytes: int) -> int:
    """Requests of ``request_bytes`` that fit in ``budget_bytes`` at once:
    ``max(1, budget // request)`` (a zero price counts as one byte)."""
    return max(1, budget_bytes // max(1, request_bytes))


def p95_request_shapes(args: AppArgs) -> list[tuple[int, int, int]]:
    """``(batch, prompt_tokens, new_tokens)`` of a P95-sized request of each route the task
    serves, with ``tokens = min(deployment.p95_input_tokens, limits.max_input_tokens)``:

    - embeddings: ``min(deployment.p95_inputs, limits.max_inputs)`` inputs of ``tokens``;
    - completions: one prompt of ``tokens`` asking for ``limits.max_tokens`` new tokens (a
      completion is charged for the ``max_tokens`` it asks for, and no knob says what your
      traffic asks; this is the most it may ask).

    ``embed`` -> ``[embeddings]``, ``generate`` -> ``[completions]``, ``fake`` -> both.
    """
    tokens = min(args.deployment.p95_input_tokens, args.limits.max_input_tokens)
    embed = (min(args.deployment.p95_inputs, args.limits.max_inputs), tokens, 0)
    complete = (1, tokens, args.limits.max_tokens)
    return {"embed": [embed], "generate": [complete], "fake": [embed, complete]}[
        args.model.task]


def p95_request_bytes(args: AppArgs, cost_model: CostModel) -> int:
    """The price of a P95 request: the largest ``cost_model`` price over
    :func:`p95_request_shapes`, bytes."""
    return max(cost_model.request_bytes(*shape) for shape in p95_request_shapes(args))


def gpu_share_for(budget_bytes: int, held_bytes: int, args: AppArgs, card_bytes: int) -> float:
    """The smallest multiple of ``1 / GPU_SHARE_STEPS_PER_CARD`` of a card of ``card_bytes``
    whose derived budget holds ``budget_bytes``.

    Inverts ``budget = (share x card - held - reserve) x safety``: the share must cover
    ``held + reserve + ceil(budget / safety)`` bytes; with ``memory.budget_bytes`` set, the
    budget is that figure and the share must cover ``held + reserve + memory.budget_bytes``.
    The result may exceed 1.0 (no single card is enough).
    """
    mem = args.memory
    if mem.budget_bytes is not None:
        available = max(budget_bytes, mem.budget_bytes)
    else:
        available = math.ceil(budget_bytes / mem.safety_factor)
    needed = held_bytes + mem.reserve_bytes + available
    steps = -(-needed * GPU_SHARE_STEPS_PER_CARD // card_bytes)  # ceiling division
    return max(1, steps) / GPU_SHARE_STEPS_PER_CARD


def _plan(args: AppArgs, running_by_memory: int, how: str, budget_bytes: int | None = None,
          request_bytes: int | None = None) -> DeploymentPlan:
    queue = args.admission.max_queue_len
    running = running_by_memory
    if args.admission.policy == "semaphore":
        running, how = args.admission.semaphore_permits, "admission.semaphore_permits"
    return DeploymentPlan(
        num_gpus=args.deployment.num_gpus,
        max_ongoing_requests=max(1, min(MAX_ONGOING_REQUESTS_CAP, running + queue)),
        max_queued_requests=max(1, queue * (args.deployment.max_replicas
                                            or args.deployment.num_replicas)),
        max_running_estimate=running, how=how, budget_bytes=budget_bytes,
        request_bytes=request_bytes)


def _profile_plan(args: AppArgs) -> DeploymentPlan | None:
    """:func:`plan_from_profile` of ``memory.profile_path``, or ``None`` when it is unset,
    unreadable, or made for another task, model or kind of device (``cpu`` / ``cuda``); the
    replica will profile again then."""
    path = args.memory.profile_path
    if (profile := load_profile(path)) is None:
        return None
    model_path = "fake" if args.model.task == "fake" else str(args.model.resolved_path())
    wanted = (args.model.task, model_path, _device_kind(args))
    measured = (profile.task, profile.model_path, _profile_device_kind(profile))
    if measured != wanted:
        logger.warning("profile %s was measured for %s %s on a %s device, not %s %s on a %s "
                       "device; planning from the analytic estimate", path, *measured, *wanted)
        return None
    return plan_from_profile(args, profile, source=f"measured profile {path}")


def _device_kind(args: AppArgs) -> str:
    """``cpu``, ``cuda`` or ``simulated``: the kind of device a replica of ``args`` gets."""
    if args.model.task == "fake":
        return "simulated"
    return "cpu" if args.deployment.num_gpus == 0 or args.model.device == "cpu" else "cuda"


def _profile_device_kind(profile: MemoryProfile) -> str:
    if profile.method.startswith("simulated"):
        return "simulated"
    return "cpu" if profile.device == "cpu" else "cuda"


def _analytic_plan(args: AppArgs) -> DeploymentPlan:
    mem = args.memory
    if args.model.task == "fake":  # its costs are configured, so the estimate is exact
        fake = args.fake
        capacity = mem.capacity_bytes or int(fake.device_capacity_bytes
                                             * (args.deployment.num_gpus or 1.0))
        source = ("memory.capacity_bytes" if mem.capacity_bytes
                  else "fake.device_capacity_bytes x num_gpus")
        cost_model: CostModel = FittedCostModel(
            ("const", "batch_tokens"), (float(fake.bytes_per_request), float(fake.bytes_per_token)))
        weights_bytes = fake.weights_bytes
    else:
        if mem.capacity_bytes is not None:
            capacity, source = mem.capacity_bytes, "memory.capacity_bytes"
        elif args.deployment.num_gpus == 0:
            capacity = int(psutil.virtual_memory().available * mem.host_fraction)
            source = "memory.host_fraction x available RAM"
        elif mem.budget_bytes is None:
            return _plan(args, FALLBACK_MAX_RUNNING,
                         "fallback (GPU size unknown where the app is built)")
        else:
            capacity, source = 0, "memory.budget_bytes"
        try:
            cost_model = _cost_model(args)
        except (OSError, KeyError, ValueError) as exc:
            logger.warning("cannot read the model config to plan the deployment: %s", exc)
            return _plan(args, FALLBACK_MAX_RUNNING, "fallback (model config unreadable)")
        weights_bytes = cost_model.weights_bytes()
    if mem.budget_bytes is not None:
        budget, source = mem.budget_bytes, "memory.budget_bytes"
    else:
        budget = int((capacity - weights_bytes - mem.reserve_bytes) * mem.safety_factor)
    price = p95_request_bytes(args, cost_model)
    return _plan(args, max_running_requests(budget, price), f"analytic estimate from {source}",
                 budget, price)


def _cost_model(args: AppArgs) -> AnalyticCostModel:
    config = json.loads((args.model.resolved_path() / "config.json").read_text())
    dtype = args.model.dtype
    if dtype == "auto":
        dtype = "float16" if args.deployment.num_gpus > 0 else "float32"
    return AnalyticCostModel(TransformerShape.from_hf_config(config, DTYPE_BYTES[dtype]))
