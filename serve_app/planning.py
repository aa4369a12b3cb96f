"""Deployment options derived from the config, so no config hand-copies them.

Run where ``serve run`` builds the application. The figures here are the analytic estimate
(model ``config.json`` + :class:`~serve_app.memory.cost_model.AnalyticCostModel`); each
replica still measures its own device at start-up and is the authority on admission.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import psutil

from serve_app.config import AppArgs
from serve_app.memory.cost_model import DTYPE_BYTES, AnalyticCostModel, TransformerShape

logger = logging.getLogger(__name__)

# Concurrent requests assumed per replica when the device size is unknown where the app is
# built (a GPU replica planned on a CPU-only head node, without memory.capacity_bytes).
FALLBACK_MAX_RUNNING = 32
MAX_ONGOING_REQUESTS_CAP = 1024


@dataclass(frozen=True)
class DeploymentPlan:
    """Ray Serve options of the model deployment.

    Attributes:
        num_gpus: GPU share per replica (``deployment.num_gpus``).
        max_ongoing_requests: Ray Serve's per-replica cap: requests the budget can run at once
            plus the admission queue, so waiting happens in the replica's FIFO (which prices and
            times out) rather than unseen at the caller.
        max_queued_requests: Ray Serve's bound on requests waiting at each caller (the
            ingress) for a free slot: ``admission.max_queue_len x num_replicas``. Beyond it the
            caller gets Ray's back-pressure error, answered as 503 ``queue_full``; without it
            such requests would wait unbounded and unseen.
        max_running_estimate: the first term of ``max_ongoing_requests``.
        how: one line saying where the estimate came from.
    """

    num_gpus: float
    max_ongoing_requests: int
    max_queued_requests: int
    max_running_estimate: int
    how: str


def plan_deployment(args: AppArgs) -> DeploymentPlan:
    """Derive the model deployment's options from ``args``.

    ``max_running = budget_estimate // bytes(one input of limits.max_input_tokens)``, where the
    budget estimate is ``(capacity - weights - reserve) * safety`` with the capacity from
    ``memory.capacity_bytes`` (or, for a CPU replica, ``memory.host_fraction`` of the RAM
    available here) and the weights from the model config. ``deployment.max_ongoing_requests``
    overrides the result.
    """
    queue = args.admission.max_queue_len
    if args.admission.policy == "semaphore":
        running, how = args.admission.semaphore_permits, "admission.semaphore_permits"
    else:
        running, how = _estimate_max_running(args)
    derived = min(MAX_ONGOING_REQUESTS_CAP, running + queue)
    if args.deployment.max_ongoing_requests is not None:
        derived, how = args.deployment.max_ongoing_requests, "deployment.max_ongoing_requests"
    return DeploymentPlan(args.deployment.num_gpus, max(1, derived),
                          max(1, queue * args.deployment.num_replicas), running, how)


def _estimate_max_running(args: AppArgs) -> tuple[int, str]:
    if args.memory.budget_bytes is not None:
        budget, source = args.memory.budget_bytes, "memory.budget_bytes"
    elif args.memory.capacity_bytes is not None:
        budget, source = None, "memory.capacity_bytes"
        capacity = args.memory.capacity_bytes
    elif args.deployment.num_gpus == 0:
        capacity = int(psutil.virtual_memory().available * args.memory.host_fraction)
        budget, source = None, "memory.host_fraction x available RAM"
    else:
        return FALLBACK_MAX_RUNNING, "fallback (GPU size unknown where the app is built)"
    try:
        cost_model = _cost_model(args)
    except (OSError, KeyError, ValueError) as exc:
        logger.warning("cannot read the model config to plan the deployment: %s", exc)
        return FALLBACK_MAX_RUNNING, "fallback (model config unreadable)"
    if budget is None:
        budget = int((capacity - cost_model.weights_bytes() - args.memory.reserve_bytes)
                     * args.memory.safety_factor)
    one_request = cost_model.request_bytes(1, args.limits.max_input_tokens)
    return max(1, budget // one_request), f"analytic estimate from {source}"


def _cost_model(args: AppArgs) -> AnalyticCostModel:
    config = json.loads((args.model.resolved_path() / "config.json").read_text())
    dtype = args.model.dtype
    if dtype == "auto":
        dtype = "float16" if args.deployment.num_gpus > 0 else "float32"
    return AnalyticCostModel(TransformerShape.from_hf_config(config, DTYPE_BYTES[dtype]))
