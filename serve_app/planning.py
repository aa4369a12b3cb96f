"""Deployment options derived from the config, so no config hand-copies them.

Run where ``serve run`` builds the application, and by ``python -m serve_app profile`` to
recommend options from a fresh measurement. The number of requests a replica can run at once
is ``budget // price of one P95 request``, from, in order of preference:

1. a **measurement made on the cluster** before the deployment, with one replica's resources
   (:mod:`deployments.cluster.build_measurement`; GPU replicas, cached in
   ``memory.measurement_cache_dir``);
2. a **measured profile** (``memory.profile_path``, written by ``python -m serve_app
   profile``): the budget from its measured capacity and held bytes, the price from its
   fitted cost model;
3. the **analytic estimate**: the weights and the price from the model's ``config.json``
   through :class:`~serve_app.memory.cost_model.AnalyticCostModel` (for the fake engine: its
   configured, exact costs).

Ray Serve's per-replica cap, ``max_ongoing_requests``, is what a replica may hold admitted
at once plus its FIFO (``admission.max_queue_len``); under the budget policy the former is
``budget // price of the smallest request``, so that the cap never binds before the budget
does. Either way each replica still measures its own device at start-up and is the authority
on admission; these figures only size Ray Serve's per-replica cap.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import psutil

from serve_app.admission.policy import policy_class
from serve_app.config import AppArgs
from serve_app.kinds import KINDS
from serve_app.measurement import Measurement
from serve_app.memory.budget import budget_formula_bytes, derive_budget_bytes
from serve_app.memory.cost_model import CostModel, NoAnalyticCostModelError, Shape
from serve_app.memory.profiler import MemoryProfile, load_profile
from serve_app.memory.reuse import ExpectedProfile, profile_device_kind, reuse_problems
from serve_app.pricing import shape_bytes

logger = logging.getLogger(__name__)

# Concurrent requests assumed per replica when the device size is unknown where the app is
# built (a GPU replica planned on a CPU-only head node, without memory.capacity_bytes).
FALLBACK_MAX_RUNNING = 32
MAX_ONGOING_REQUESTS_CAP = 1024
OVERRIDE = "deployment.max_ongoing_requests"
SMALLEST_SHAPE = Shape(1, 1, 0)
"""The smallest request of any kind (one input of one token, or one audio frame; nothing
generated): its price bounds how many requests the budget admits at once."""
# A recommended num_gpus is a whole number of these steps of one card (1/20 = 0.05).
GPU_SHARE_STEPS_PER_CARD = 20


class EngineSpec(Protocol):
    """What planning reads of an engine class without loading it (implemented by
    :class:`deployments.engines.base.Engine`'s class methods)."""

    kinds: tuple[str, ...]

    def profile_identity(self, args: AppArgs) -> str:
        """What its profiles record as ``model_path``."""

    def device_kind(self, args: AppArgs) -> str:
        """``simulated``, ``cpu`` or ``cuda``: the device a replica of ``args`` gets."""

    def planned_capacity(self, args: AppArgs) -> tuple[int | None, str]:
        """A replica's device capacity as far as it is known where the app is built (bytes,
        ``None``: unknown here), and where the figure comes from."""

    def analytic_costs(self, args: AppArgs) -> tuple[CostModel, int]:
        """The analytic cost model and the bytes the weights hold.

        Raises:
            OSError, KeyError, ValueError: the model's config cannot be read.
        """

    def planned_context(self, args: AppArgs) -> tuple[int, str] | None:
        """The model's context (tokens) and where it was read, without loading the model;
        ``None``: unknown here (or not a token context)."""

    def planned_budget_bytes(self, args: AppArgs, budget_bytes: int) -> int:
        """The budget a replica has where the formula gives ``budget_bytes``."""


def planned_host_capacity(args: AppArgs) -> tuple[int, str]:
    """A CPU replica's capacity where the app is built: ``memory.host_fraction`` of the RAM
    available here (a replica measures its own node's at start-up)."""
    available = psutil.virtual_memory().available
    return (int(available * args.memory.host_fraction),
            "memory.host_fraction x available RAM")


@dataclass(frozen=True, kw_only=True)
class DeploymentPlan:
    """Ray Serve options of the model deployment, and the figures they came from.

    Attributes:
        num_gpus: GPU share per replica (``deployment.num_gpus``).
        max_ongoing_requests: Ray Serve's per-replica cap:
            ``min(MAX_ONGOING_REQUESTS_CAP, max_admitted_estimate + admission.max_queue_len)``
            (or ``deployment.max_ongoing_requests`` when set), so waiting happens in the
            replica's FIFO (which prices, tells positions and refuses at once what would
            wait in vain) rather than unseen at the caller.
        max_queued_requests: Ray Serve's bound on requests waiting at each caller (the
            ingress) for a free slot: ``admission.max_queue_len x num_replicas`` (``x
            max_replicas`` when autoscaling: the queue the grown deployment holds, so a burst
            waits at the handle while replicas are added instead of being refused). Beyond it the
            caller gets Ray's back-pressure error, answered as 503 ``queue_full``; without it
            such requests would wait unbounded and unseen.
        max_running_estimate: requests a replica runs at once: ``admission.semaphore_permits``
            under the semaphore policy, else ``max(1, budget_bytes // request_bytes)``.
        max_admitted_estimate: requests a replica may hold admitted at once (leased:
            running or waiting for their pass): under the budget policy ``budget_bytes //``
            the price of the smallest request (:data:`SMALLEST_SHAPE`), at least
            ``max_running_estimate``; the permits under the semaphore policy;
            ``max_running_estimate`` without a gate.
        admitted_set_by: what sets ``max_admitted_estimate``, in words.
        how: one line saying where the estimate came from.
        budget_bytes: the replica budget the estimate assumed, bytes (``None``: unknown here).
        request_bytes: the price of one P95 request (:func:`p95_request_shapes`), bytes
            (``None``: unknown here).
        running_set_by: what sets ``max_running_estimate``: ``budget // P95 request``, or
            the policy's knob (``admission.semaphore_permits``).
        min_num_gpus: the smallest multiple of 0.05 of one card whose budget holds
            ``max_running_estimate`` P95 requests (see :func:`gpu_share_for`); ``0.0`` for a
            CPU device; ``None`` where the card's size is unknown (planning at build time
            without a measurement). May exceed 1.0: then no single card holds them.
        measurement: the summary of the measurement it came from
            (:meth:`serve_app.measurement.Measurement.summary`), or ``None``.
    """

    num_gpus: float
    max_ongoing_requests: int
    max_queued_requests: int
    max_running_estimate: int
    how: str
    max_admitted_estimate: int = 1
    admitted_set_by: str = "running at once"
    budget_bytes: int | None = None
    request_bytes: int | None = None
    min_num_gpus: float | None = None
    running_set_by: str = "budget // P95 request"
    measurement: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        """What ``/v1/status`` shows of the plan: the options Ray Serve was given and where
        they came from."""
        return {"num_gpus": self.num_gpus, "max_ongoing_requests": self.max_ongoing_requests,
                "max_queued_requests": self.max_queued_requests,
                "max_running_estimate": self.max_running_estimate,
                "max_admitted_estimate": self.max_admitted_estimate,
                "budget_bytes": self.budget_bytes, "request_bytes": self.request_bytes,
                "recommended_num_gpus": self.min_num_gpus, "how": self.how,
                "measurement": self.measurement}

    def ongoing_text(self, queue: int) -> str:
        """Where ``max_ongoing_requests`` came from, in words (``vramgate plan`` and
        ``profile``); ``queue``: ``admission.max_queue_len``."""
        if self.how == OVERRIDE:
            return OVERRIDE
        capped = (f", capped at {MAX_ONGOING_REQUESTS_CAP}"
                  if self.max_ongoing_requests < self.max_admitted_estimate + queue else "")
        return (f"{self.max_admitted_estimate} admitted ({self.admitted_set_by}) + {queue} "
                f"queued (admission.max_queue_len){capped}")


def plan_deployment(args: AppArgs, engine: EngineSpec,
                    measurement: Measurement | None = None) -> DeploymentPlan:
    """Derive the model deployment's options from ``args`` for ``engine`` (its class).

    With a ``measurement`` made on the cluster before the deployment
    (:func:`deployments.cluster.build_measurement.measure_before_deploy`), the plan is
    :func:`plan_from_profile`'s of it, on the card it was made on. Else, with a readable
    profile at ``memory.profile_path`` made for this engine and model on this kind of device
    (:func:`serve_app.memory.reuse.reuse_problems`), the plan is
    :func:`plan_from_profile`'s. Otherwise it is the analytic estimate:
    ``budget = (capacity - weights - reserve) * safety`` (or ``memory.budget_bytes``) and
    ``max_running = max(1, budget // price)``, with the capacity from
    ``memory.capacity_bytes`` or the engine (:meth:`EngineSpec.planned_capacity`: for a CPU
    replica ``memory.host_fraction`` of the RAM available here; the fake engine's share of
    its simulated card), the weights' bytes and the price of one P95 request
    (:func:`p95_request_bytes`) from the engine's analytic cost model (a model's
    ``config.json``; the fake engine's configured, exact costs). A replica whose device size
    is unknown here (a GPU replica planned on a CPU-only head node) gets
    ``FALLBACK_MAX_RUNNING``. Under the semaphore policy the replica runs
    ``admission.semaphore_permits`` requests whatever the memory.
    ``deployment.max_ongoing_requests`` overrides the result.

    Raises:
        InsufficientMemoryError: the profile leaves no budget (or less than
            ``memory.budget_bytes``) on its device; the message says what to change.
    """
    plan = (_measured_plan(args, engine, measurement) or _profile_plan(args, engine)
            or _analytic_plan(args, engine))
    if args.deployment.max_ongoing_requests is not None:
        plan = replace(plan, max_ongoing_requests=args.deployment.max_ongoing_requests,
                       how=OVERRIDE)
    return plan


def plan_from_profile(args: AppArgs, profile: MemoryProfile, kinds: Sequence[str], *,
                      card_bytes: int | None = None, min_budget_bytes: int = 0,
                      source: str = "measured profile",
                      context: int | None = None) -> DeploymentPlan:
    """The options a measured ``profile`` yields under ``args`` for an engine serving
    ``kinds``: the one computation shared by build-time planning and the ``profile``
    command's recommendation.

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
        kinds: the request kinds the engine serves (:mod:`serve_app.kinds`).
        card_bytes: total bytes of the GPU the profile was measured on, to compute
            ``min_num_gpus``; ``None`` leaves it unknown (``0.0`` anyway for a CPU profile).
        min_budget_bytes: the budget must also hold this (the largest request the limits
            allow, under the budget policy); it raises the recommended GPU share, and
            :func:`~serve_app.memory.budget.derive_budget_bytes` refuses a smaller budget.
        source: the start of ``how``, e.g. ``measured profile profiles/vramgate.json``.
        context: the model's context, tokens (``None``: unknown): the P95 request fits it.

    Raises:
        InsufficientMemoryError: the derived budget would be <= 0 or below
            ``min_budget_bytes``, or ``memory.budget_bytes`` exceeds what the device has left.
    """
    mem = args.memory
    budget = derive_budget_bytes(mem.capacity_bytes or profile.capacity_bytes,
                                 profile.held_bytes, mem.reserve_bytes, mem.safety_factor,
                                 min_request_bytes=min_budget_bytes,
                                 override_bytes=mem.budget_bytes)
    price = p95_request_bytes(args, kinds, profile.cost_model, context)
    plan = _plan(args, max_running_requests(budget, price), source, budget, price,
                 max_running_requests(budget, shape_bytes(profile.cost_model, SMALLEST_SHAPE)))
    if profile_device_kind(profile) == "cpu":
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


def p95_request_shapes(args: AppArgs, kinds: Sequence[str],
                       context: int | None = None) -> list[Shape]:
    """The shape of a P95-sized request of each of ``kinds``
    (:meth:`serve_app.kinds.RequestKind.p95_shape`) on a model of ``context`` tokens
    (``None``: unknown), with ``tokens = min(deployment.p95_input_tokens,
    limits.max_input_tokens)``:

    - embeddings: ``min(deployment.p95_inputs, limits.max_inputs)`` inputs of ``tokens``
      (at most ``context``);
    - completions: one prompt of ``tokens`` asking for ``limits.max_tokens`` new tokens (a
      completion is charged for the ``max_tokens`` it asks for, and no knob says what your
      traffic asks; this is the most it may ask), both cut to fit ``context`` together: at
      most ``context - 1`` new tokens, the prompt at most what they leave.
    """
    return [KINDS[kind].p95_shape(args, context) for kind in kinds]


def p95_request_bytes(args: AppArgs, kinds: Sequence[str], cost_model: CostModel,
                      context: int | None = None) -> int:
    """The price of a P95 request: the largest ``cost_model`` price
    (:func:`serve_app.pricing.shape_bytes`) over :func:`p95_request_shapes`, bytes."""
    return max(shape_bytes(cost_model, shape)
               for shape in p95_request_shapes(args, kinds, context))


def model_context(args: AppArgs, engine: EngineSpec) -> int | None:
    """The model's context in tokens as known without loading it
    (:meth:`EngineSpec.planned_context`), ``None``: unknown."""
    found = engine.planned_context(args)
    return found[0] if found else None


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
          request_bytes: int | None = None,
          smallest_by_memory: int | None = None) -> DeploymentPlan:
    queue = args.admission.max_queue_len
    policy = policy_class(args.admission.policy)
    running, set_by = policy.running_estimate(args.admission, running_by_memory)
    admitted, admitted_by = policy.admitted_estimate(args.admission, running,
                                                     smallest_by_memory)
    return DeploymentPlan(
        num_gpus=args.deployment.num_gpus,
        max_ongoing_requests=max(1, min(MAX_ONGOING_REQUESTS_CAP, admitted + queue)),
        max_admitted_estimate=admitted, admitted_set_by=admitted_by,
        max_queued_requests=max(1, queue * (args.deployment.max_replicas
                                            or args.deployment.num_replicas)),
        max_running_estimate=running, how=set_by or how, budget_bytes=budget_bytes,
        request_bytes=request_bytes,
        running_set_by=set_by or ("budget // P95 request" if budget_bytes is not None else how))


def _measured_plan(args: AppArgs, engine: EngineSpec,
                   measurement: Measurement | None) -> DeploymentPlan | None:
    if measurement is None:
        return None
    must_fit = policy_class(args.admission.policy).budget_must_hold_largest
    return plan_from_profile(args, measurement.profile, engine.kinds,
                             card_bytes=measurement.card_bytes,
                             min_budget_bytes=measurement.max_request_bytes if must_fit else 0,
                             source=measurement.describe(),
                             context=model_context(args, engine))


def _profile_plan(args: AppArgs, engine: EngineSpec) -> DeploymentPlan | None:
    """:func:`plan_from_profile` of ``memory.profile_path``, or ``None`` when it is unset,
    unreadable, or made for another engine, model or kind of device; the replica will
    profile again then."""
    path = args.memory.profile_path
    if (profile := load_profile(path)) is None:
        return None
    expected = ExpectedProfile(args.model.engine_name, engine.profile_identity(args),
                               engine.device_kind(args))
    if problems := reuse_problems(profile, expected):
        logger.warning("profile %s does not match (%s); planning from the analytic estimate",
                       path, "; ".join(problems))
        return None
    return plan_from_profile(args, profile, engine.kinds, source=f"measured profile {path}",
                             context=model_context(args, engine))


def _unpriced_plan(args: AppArgs, engine: str) -> DeploymentPlan:
    """The plan of an engine that prices nothing before a replica measures it. Under a policy
    that admits by the budget, Ray's cap must not bind before the budget (see
    :meth:`~serve_app.admission.policy.BudgetPolicy.admitted_estimate`), which only the
    replica knows: the cap is :data:`MAX_ONGOING_REQUESTS_CAP`, the replica's FIFO bounding
    what waits (a guess of :data:`FALLBACK_MAX_RUNNING` would bind first wherever the budget
    holds more, and the rest would wait unseen in Ray Serve's handle queue)."""
    plan = _plan(args, FALLBACK_MAX_RUNNING, f"no analytic cost model ({engine}): each "
                 "replica measures its requests' prices at start-up")
    if not policy_class(args.admission.policy).budget_must_hold_largest:
        return plan
    return replace(plan, max_ongoing_requests=MAX_ONGOING_REQUESTS_CAP,
                   max_admitted_estimate=MAX_ONGOING_REQUESTS_CAP,
                   admitted_set_by="the replica's budget, unknown here")


def _analytic_plan(args: AppArgs, engine: EngineSpec) -> DeploymentPlan:
    mem = args.memory
    if mem.capacity_bytes is not None:
        capacity, source = mem.capacity_bytes, "memory.capacity_bytes"
    else:
        capacity, source = engine.planned_capacity(args)
    if capacity is None:
        if mem.budget_bytes is None:
            return _plan(args, FALLBACK_MAX_RUNNING,
                         "fallback (GPU size unknown where the app is built)")
        capacity, source = 0, "memory.budget_bytes"
    try:
        cost_model, weights_bytes = engine.analytic_costs(args)
    except NoAnalyticCostModelError as exc:
        return _unpriced_plan(args, str(exc))
    except (OSError, KeyError, ValueError) as exc:
        logger.warning("cannot read the model config to plan the deployment: %s", exc)
        return _plan(args, FALLBACK_MAX_RUNNING, "fallback (model config unreadable)")
    source = "memory.budget_bytes" if mem.budget_bytes is not None else source
    budget = engine.planned_budget_bytes(args, mem.budget_bytes or budget_formula_bytes(
        capacity, weights_bytes, mem.reserve_bytes, mem.safety_factor))
    price = p95_request_bytes(args, engine.kinds, cost_model, model_context(args, engine))
    return _plan(args, max_running_requests(budget, price), f"analytic estimate from {source}",
                 budget, price,
                 max_running_requests(budget, shape_bytes(cost_model, SMALLEST_SHAPE)))
