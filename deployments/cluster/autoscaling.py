"""Ray Serve autoscaling policy for the model replicas: scale on the admission queues.

A thin adapter: it reads Ray's ``AutoscalingContext``, builds an
:class:`serve_app.autoscaling.AutoscalingSnapshot`, calls :func:`serve_app.autoscaling.decide`
and hands the decision and the state to carry back to Ray. The formula and the rules are in
``serve_app/autoscaling.py``.

Where the figures come from (Ray Serve 2.60)
--------------------------------------------
Each model replica's ``record_autoscaling_stats()`` returns
:meth:`serve_app.replica_state.ReplicaState.to_autoscaling_stats` (the ``AUTOSCALING_*`` keys
declared there, numbers only: a first return that is not ``dict[str, int | float]`` turns
custom metrics off for that replica for good). The replica samples it every
``min(look_back_period_s x 0.2, metrics_interval_s)`` s and pushes the samples of the last
``look_back_period_s`` to the controller every ``metrics_interval_s`` s; only deployments with
an ``autoscaling_config`` do either. ``ctx.aggregated_metrics`` is then
``{metric: {ReplicaID: value}}`` with **one value per running replica that has reported**,
its samples over the window reduced by ``autoscaling_config.aggregation_function`` (``mean``,
the default, is time-weighted; ``max`` / ``min``); Ray does **not** sum across replicas: this
adapter does. ``ctx.total_queued_requests`` (requests held at the handles, same window and
reduction) joins the queue. So "idle" means idle for the whole look-back window, and the
``downscale_delay_s`` of this policy runs on top of it.

Delays and tunables
-------------------
Ray wraps every custom policy (``_apply_autoscaling_config``) in its own ``upscale_delay_s`` /
``downscale_delay_s`` (timer against ``target_num_replicas``), ``upscaling_factor`` /
``downscaling_factor`` and the min/max bounds. This policy keeps its own delays (it needs them
for the one-step downscale and the idle-to-min rule), so the deployment must set Ray's
``autoscaling_config.upscale_delay_s`` and ``downscale_delay_s`` to 0, or both delays apply one
after the other (a warning is logged once). In 2.60 ``policy.policy_kwargs`` reach only a policy
*class* (instantiated once with them); a plain function gets none. Hence two entry points:

* ``deployments.cluster.autoscaling:QueueAutoscalingPolicy`` with ``policy_kwargs`` = the fields of
  :class:`serve_app.autoscaling.AutoscalingPolicyConfig` (the recommended one);
* ``deployments.cluster.autoscaling:queue_autoscaling_policy``, a function with the module defaults
  (:data:`DEFAULT_CONFIG`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from serve_app.autoscaling import (
    AutoscalingPolicyConfig,
    AutoscalingSnapshot,
    Decision,
    ReplicaLoad,
    ScalingState,
    decide,
)
from serve_app.replica_state import (
    AUTOSCALING_BUDGET_BYTES_KEY,
    AUTOSCALING_JOBS_QUEUED_KEY,
    AUTOSCALING_QUEUE_DEPTH_KEY,
    AUTOSCALING_QUEUED_BYTES_KEY,
    AUTOSCALING_REFUSED_KEY,
    AUTOSCALING_RESERVED_BYTES_KEY,
    AUTOSCALING_RUNNING_REQUESTS_KEY,
)

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

logger = logging.getLogger("ray.serve")

QUEUE_POLICY_CLASS_PATH = "deployments.cluster.autoscaling:QueueAutoscalingPolicy"
"""``autoscaling_config.policy.policy_function`` of the model deployment."""

#: Tunables of :func:`queue_autoscaling_policy` (a plain function gets no ``policy_kwargs``).
DEFAULT_CONFIG = AutoscalingPolicyConfig()

_warned_ray_delays = False


def snapshot_from_context(ctx: AutoscalingContext) -> AutoscalingSnapshot:
    """The :class:`AutoscalingSnapshot` of Ray's context: bounds are the capacity-adjusted
    ones, a replica counts as reported once it has an ``AUTOSCALING_BUDGET_BYTES_KEY`` value
    (missing figures of a reported replica read 0), the clock is ``ctx.current_time``
    (``time.time()``, the clock the carried state was written with)."""
    metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
    budgets = metrics.get(AUTOSCALING_BUDGET_BYTES_KEY) or {}
    running = set(ctx.running_replicas or ())

    def value(key: str, replica: Any) -> float:
        number = (metrics.get(key) or {}).get(replica, 0.0)
        return float(number) if number is not None and math.isfinite(number) else 0.0

    loads = tuple(ReplicaLoad(queue_depth=value(AUTOSCALING_QUEUE_DEPTH_KEY, r),
                              queued_bytes=value(AUTOSCALING_QUEUED_BYTES_KEY, r),
                              reserved_bytes=value(AUTOSCALING_RESERVED_BYTES_KEY, r),
                              budget_bytes=value(AUTOSCALING_BUDGET_BYTES_KEY, r),
                              running_requests=value(AUTOSCALING_RUNNING_REQUESTS_KEY, r),
                              jobs_queued=value(AUTOSCALING_JOBS_QUEUED_KEY, r),
                              refused_by_prediction=value(AUTOSCALING_REFUSED_KEY, r))
                  for r in budgets if not running or r in running)
    queued_at_handles = ctx.total_queued_requests
    now = ctx.current_time
    return AutoscalingSnapshot(
        now_s=float(now) if now is not None else time.time(),
        current_replicas=ctx.current_num_replicas,
        target_replicas=ctx.target_num_replicas,
        min_replicas=ctx.capacity_adjusted_min_replicas,
        max_replicas=ctx.capacity_adjusted_max_replicas,
        replicas=loads,
        handle_queued_requests=float(queued_at_handles or 0.0),
        state=ScalingState.from_dict(ctx.policy_state))


def apply_policy(ctx: AutoscalingContext,
                 config: AutoscalingPolicyConfig) -> tuple[int, dict[str, Any]]:
    """Decide for ``ctx`` with ``config``; returns ``(replicas, state to carry)`` and logs a
    change of target (or the start of a wait) at INFO."""
    _warn_if_ray_delays(ctx)
    decision: Decision = decide(snapshot_from_context(ctx), config)
    if (decision.desired_replicas != ctx.target_num_replicas
            or decision.state.direction != ScalingState.from_dict(ctx.policy_state).direction):
        logger.info("autoscaling %s: %s", getattr(ctx, "deployment_name", "?"), decision.reason)
    return decision.desired_replicas, decision.state.to_dict()


def queue_autoscaling_policy(ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
    """Ray Serve custom autoscaling policy (``policy_function``) with :data:`DEFAULT_CONFIG`."""
    return apply_policy(ctx, DEFAULT_CONFIG)


class QueueAutoscalingPolicy:
    """Ray Serve custom autoscaling policy class: Ray 2.60 instantiates it once with
    ``policy.policy_kwargs`` (the fields of :class:`AutoscalingPolicyConfig`, plus optionally
    ``max_queue_len`` and ``queue_fraction`` to derive the target queue as
    :meth:`AutoscalingPolicyConfig.from_admission` does) and calls it on every tick.

    Raises:
        ValueError: an unknown keyword or an invalid value (named in the message).
    """

    def __init__(self, **policy_kwargs: Any) -> None:
        allowed = {f.name for f in fields(AutoscalingPolicyConfig)}
        unknown = set(policy_kwargs) - allowed - {"max_queue_len", "queue_fraction"}
        if unknown:
            raise ValueError(f"unknown autoscaling policy_kwargs {sorted(unknown)}; use "
                             f"{sorted(allowed | {'max_queue_len', 'queue_fraction'})}")
        if "max_queue_len" in policy_kwargs:
            if "target_queue_per_replica" in policy_kwargs:
                raise ValueError("give target_queue_per_replica or max_queue_len, not both")
            kwargs = dict(policy_kwargs)
            max_queue_len = int(kwargs.pop("max_queue_len"))
            self.config = AutoscalingPolicyConfig.from_admission(max_queue_len, **kwargs)
        elif "queue_fraction" in policy_kwargs:
            raise ValueError("queue_fraction needs max_queue_len")
        else:
            self.config = AutoscalingPolicyConfig(**policy_kwargs)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        return apply_policy(ctx, self.config)


def _warn_if_ray_delays(ctx: AutoscalingContext) -> None:
    global _warned_ray_delays
    config = getattr(ctx, "config", None)
    if _warned_ray_delays or config is None:
        return
    ray_delays = (getattr(config, "upscale_delay_s", 0) or 0,
                  getattr(config, "downscale_delay_s", 0) or 0)
    if any(ray_delays):
        _warned_ray_delays = True
        logger.warning("autoscaling_config.upscale_delay_s/downscale_delay_s = %s/%s s apply "
                       "after this policy's own delays; set both to 0 and give the delays in "
                       "policy.policy_kwargs", *ray_delays)
