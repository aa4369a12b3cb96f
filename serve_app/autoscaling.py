"""The autoscaling decision: how many model replicas the admission queues ask for (pure).

Ray Serve's default policy scales on request *counts* (``total_num_requests /
target_ongoing_requests``). A byte-budget replica is full when its *bytes* are, not its request
count: one long prompt can hold the whole budget while ten short ones hold a tenth of it. This
module scales on what the admission gates measure, per replica:

* ``reserved_bytes`` (leases held by admitted work) + ``queued_bytes`` (what the FIFO waiters
  will need) against ``budget_bytes``: the **bytes pressure**;
* ``queue_depth`` (FIFO waiters) plus the requests Ray holds at the handles against a target
  queue per replica: the **queue pressure**.

The formula (a target-tracking rule, the byte analogue of Ray's default policy)::

    n              = running replicas (the ones whose load the metrics describe)
    bytes_pressure = sum(reserved + queued bytes) / (target_utilisation x mean(budget) x n)
    queue_pressure = (sum(queue_depth) + handle_queued) / (target_queue_per_replica x n)
    pressure       = max(bytes_pressure, queue_pressure)
    raw            = ceil(n x pressure)

``n x bytes_pressure`` is "how many replicas of the average budget it takes to hold the demand at
the target utilisation" and ``n x queue_pressure`` "how many replicas it takes to keep each queue
at its target length", so ``raw`` does not depend on ``n`` for a steady demand: after a scale
step the pressure drops by the same factor and the decision is stable (no oscillation). The
larger of the two wins because either one alone running out means 503s: bytes when few requests
are huge, queue slots when many are small. Replicas that have not reported yet count as empty
replicas of the mean budget (the router can send them work), which keeps a scale-up from
overshooting while new replicas start.

Moving from the current target:

* ``pressure > 1``: up to ``raw`` (never down while over target); ``pressure < 1``: down (never
  up while under target); a desire must persist ``upscale_delay_s`` / ``downscale_delay_s``
  before it is acted on, and a change of direction restarts the timer.
* Upscaling goes straight to ``raw``: a new replica takes minutes to start (load + profile), so
  adding them one at a time would leave 503s for many delays in a row.
* Downscaling with load goes **one replica per step**, each step after its own full
  ``downscale_delay_s``: a removed replica drains gracefully (running work finishes, queued work
  is admitted or times out), the router moves its share onto the others, and the pressure is
  measured again on the smaller set before the next removal, so a wrong estimate costs one
  replica, not several.
* An idle deployment (every reporting replica with no queue, no queued or reserved bytes, no
  admitted request, and nothing queued at the handles) that stays idle for
  ``downscale_delay_s`` goes straight to ``min_replicas``: idle replicas have nothing to drain.
* The result is always within ``[min_replicas, max_replicas]``; a target outside them (bounds
  changed) is brought back at once.

Imports nothing from Ray: ``deployments/cluster/autoscaling.py`` builds the snapshot from Ray's
``AutoscalingContext``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

Direction = Literal["up", "down"]

#: Keys of the policy's carried state inside Ray's ``policy_state`` dict (prefixed so they never
#: meet Ray's own ``__decision_counters`` / ``__decision_timestamp``).
STATE_DIRECTION_KEY = "vramgate_direction"
STATE_SINCE_KEY = "vramgate_since_s"
STATE_IDLE_SINCE_KEY = "vramgate_idle_since_s"

#: Slack for float comparisons (elapsed time vs a delay, ``n x pressure`` near an integer).
_EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class ReplicaLoad:
    """What one replica reported (each figure aggregated over Ray's look-back window).

    Attributes:
        queue_depth: requests waiting in the admission FIFO.
        queued_bytes: bytes those waiters will lease.
        reserved_bytes: bytes leased by admitted work.
        budget_bytes: the replica's budget now (after any OOM shrink).
        running_requests: requests holding a lease (running or waiting for the thread).
        jobs_queued: durable jobs waiting for a replica (the app's one queue in Redis; each
            replica reports the same count, so it is counted once: the largest report).
        refused_by_prediction: requests refused at once because they would have waited too
            long: counted as waiting, or refusing early would hide the demand.
    """

    queue_depth: float = 0.0
    queued_bytes: float = 0.0
    reserved_bytes: float = 0.0
    budget_bytes: float = 0.0
    running_requests: float = 0.0
    jobs_queued: float = 0.0
    refused_by_prediction: float = 0.0

    @property
    def idle(self) -> bool:
        return max(self.queue_depth, self.queued_bytes, self.reserved_bytes,
                   self.running_requests, self.jobs_queued) <= 0


@dataclass(frozen=True)
class ScalingState:
    """What the policy carries between calls.

    Attributes:
        direction: the scale direction wanted at the last call (``None``: no change wanted).
        since_s: when that direction was first wanted, without interruption.
        idle_since_s: when the deployment was first seen idle, without interruption.
    """

    direction: Direction | None = None
    since_s: float | None = None
    idle_since_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {STATE_DIRECTION_KEY: self.direction, STATE_SINCE_KEY: self.since_s,
                STATE_IDLE_SINCE_KEY: self.idle_since_s}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> ScalingState:
        """Read the keys of :meth:`to_dict`; anything missing or malformed reads as "none"."""
        raw = raw or {}
        direction = raw.get(STATE_DIRECTION_KEY)
        return cls(direction if direction in ("up", "down") else None,
                   _float_or_none(raw.get(STATE_SINCE_KEY)),
                   _float_or_none(raw.get(STATE_IDLE_SINCE_KEY)))


@dataclass(frozen=True, kw_only=True)
class AutoscalingSnapshot:
    """Everything :func:`decide` looks at.

    Attributes:
        now_s: the current time in seconds (any clock, as long as it is the one ``state`` used).
        current_replicas: running replicas, the ones whose load ``replicas`` describes.
        target_replicas: the replica count the autoscaler aims at now (above
            ``current_replicas`` while new replicas start).
        min_replicas / max_replicas: the bounds (Ray's capacity-adjusted ones).
        replicas: one :class:`ReplicaLoad` per running replica that has reported.
        handle_queued_requests: requests held at the deployment handles (no replica took them).
        state: what the previous call returned.
    """

    now_s: float
    current_replicas: int
    target_replicas: int
    min_replicas: int
    max_replicas: int
    replicas: tuple[ReplicaLoad, ...] = ()
    handle_queued_requests: float = 0.0
    state: ScalingState = ScalingState()

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas ({self.min_replicas}) <= max_replicas "
                             f"({self.max_replicas})")
        if self.current_replicas < 0 or self.target_replicas < 0:
            raise ValueError("replica counts cannot be negative")

    @property
    def idle(self) -> bool:
        """Some replica reported, none holds or awaits anything, and no handle holds a request."""
        return (bool(self.replicas) and all(r.idle for r in self.replicas)
                and self.handle_queued_requests <= 0)


@dataclass(frozen=True)
class AutoscalingPolicyConfig:
    """The policy's tunables.

    Attributes:
        target_queue_per_replica: FIFO waiters per replica that count as "full" (queue pressure
            1.0). :meth:`from_admission` derives it from ``admission.max_queue_len``.
        target_utilisation: (reserved + queued bytes) / budget that counts as "full" (bytes
            pressure 1.0). 1.0 = scale when the demand exceeds what the budgets hold; below 1
            scales earlier, leaving headroom for bursts while a replica starts.
        upscale_delay_s: how long a wish to scale up must last before it is acted on.
        downscale_delay_s: how long a wish to scale down (one step, or to ``min_replicas`` when
            idle) must last before it is acted on.
    """

    target_queue_per_replica: float = 32.0
    target_utilisation: float = 1.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("target_queue_per_replica", "target_utilisation"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"autoscaling {name} must be a finite number > 0, got {value}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"autoscaling {name} must be a finite number >= 0, got {value}")

    @classmethod
    def from_admission(cls, max_queue_len: int, queue_fraction: float = 0.5,
                       **kwargs: float) -> AutoscalingPolicyConfig:
        """Target queue = ``queue_fraction`` of ``admission.max_queue_len`` (at least 1): scale
        while the queues are half full, before arrivals meet 503 ``queue_full`` (a new replica
        needs minutes to start)."""
        if not 0 < queue_fraction <= 1:
            raise ValueError(f"queue_fraction must be in (0, 1], got {queue_fraction}")
        return cls(target_queue_per_replica=max(1.0, max_queue_len * queue_fraction), **kwargs)


class Pressure(NamedTuple):
    """Demand over capacity at the targets (1.0 = exactly full); see the module docstring."""

    bytes: float
    queue: float

    @property
    def value(self) -> float:
        return max(self.bytes, self.queue)


class Decision(NamedTuple):
    """The result of :func:`decide`; unpacks as ``desired, state, reason``."""

    desired_replicas: int
    state: ScalingState
    reason: str


def pressure(snapshot: AutoscalingSnapshot, config: AutoscalingPolicyConfig) -> Pressure:
    """Bytes and queue pressure over the running replicas (0 when none is running).

    Replicas that have not reported count as empty replicas of the mean reported budget; with no
    budget reported at all there is no bytes signal (bytes pressure 0).
    """
    n = snapshot.current_replicas
    if n <= 0:
        return Pressure(0.0, 0.0)
    loads = snapshot.replicas
    budgets = [r.budget_bytes for r in loads if r.budget_bytes > 0]
    demand = sum(r.reserved_bytes + r.queued_bytes for r in loads)
    capacity = config.target_utilisation * (sum(budgets) / len(budgets)) * n if budgets else 0.0
    bytes_p = demand / capacity if capacity > 0 else (math.inf if budgets and demand else 0.0)
    waiting = sum(r.queue_depth + r.refused_by_prediction for r in loads) \
        + max(0.0, snapshot.handle_queued_requests) \
        + max((r.jobs_queued for r in loads), default=0.0)
    return Pressure(bytes_p, waiting / (config.target_queue_per_replica * n))


def decide(snapshot: AutoscalingSnapshot, config: AutoscalingPolicyConfig) -> Decision:
    """The replica count to aim at now, the state to carry to the next call, and why.

    See the module docstring for the formula and the rules. The result is always within
    ``[min_replicas, max_replicas]``.
    """
    s, now = snapshot, snapshot.now_s
    lo, hi = s.min_replicas, s.max_replicas
    idle_since = _since(s.state.idle_since_s, now) if s.idle else None
    if s.target_replicas > hi or s.target_replicas < lo:
        bound = _clamp(s.target_replicas, lo, hi)
        return Decision(bound, ScalingState(idle_since_s=idle_since),
                        f"target {s.target_replicas} outside [{lo}, {hi}]: {bound}")
    if s.current_replicas == 0:
        return _from_zero(s, idle_since)
    if not s.replicas:
        return Decision(s.target_replicas, ScalingState(),
                        "hold: no replica has reported its admission load yet")

    p = pressure(s, config)
    want, why, due = _wanted(s, p, idle_since, config)
    direction: Direction | None = ("up" if want > s.target_replicas
                                   else "down" if want < s.target_replicas else None)
    if direction is None:
        return Decision(s.target_replicas, ScalingState(idle_since_s=idle_since),
                        f"hold at {s.target_replicas}: {why}")
    since = _since(s.state.since_s if s.state.direction == direction else None, now)
    delay = config.upscale_delay_s if direction == "up" else config.downscale_delay_s
    waited = now - since
    if due or waited + _EPS >= delay:
        return Decision(want, ScalingState(idle_since_s=idle_since),
                        f"scale {direction} {s.target_replicas} -> {want}: {why}")
    return Decision(s.target_replicas, ScalingState(direction, since, idle_since),
                    f"want {want} ({direction}), waited {waited:.1f}/{delay:.1f} s: {why}")


def _wanted(s: AutoscalingSnapshot, p: Pressure, idle_since: float | None,
            config: AutoscalingPolicyConfig) -> tuple[int, str, bool]:
    """The count aimed at if no delay applied, a short explanation, and whether it is due now
    whatever the direction timer says (idle for ``downscale_delay_s``: the idleness itself is
    the wish that persisted)."""
    lo, hi, target = s.min_replicas, s.max_replicas, s.target_replicas
    if idle_since is not None:
        idle_for = s.now_s - idle_since
        if idle_for + _EPS >= config.downscale_delay_s:
            return lo, f"idle for {idle_for:.1f} s", True
        return (max(lo, target - 1),
                f"idle for {idle_for:.1f} s (to {lo} after {config.downscale_delay_s:.1f} s)",
                False)
    why = (f"bytes pressure {p.bytes:.2f}, queue pressure {p.queue:.2f} "
           f"over {s.current_replicas} running")
    needed = s.current_replicas * p.value
    raw = hi if needed >= hi else math.ceil(needed - _EPS)  # no ceil(inf) on a vanishing budget
    if p.value > 1:
        return _clamp(max(target, raw), lo, hi), why, False
    if p.value < 1:
        # one step at a time: each removal drains gracefully and is measured before the next
        return _clamp(max(min(target, raw), target - 1), lo, hi), why, False
    return target, why, False


def _from_zero(s: AutoscalingSnapshot, idle_since: float | None) -> Decision:
    """No replica runs (``min_replicas`` 0): one is wanted as soon as a request waits."""
    if s.handle_queued_requests > 0 and s.target_replicas == 0:
        want = _clamp(1, s.min_replicas, s.max_replicas)
        return Decision(want, ScalingState(),
                        f"scale up 0 -> {want}: {s.handle_queued_requests:g} requests wait "
                        "with no replica")
    return Decision(s.target_replicas, ScalingState(idle_since_s=idle_since),
                    f"hold at {s.target_replicas}: no replica running")


def _since(previous: float | None, now: float) -> float:
    """When a condition began: ``previous`` if it is a past time, else ``now`` (a clock that
    went back restarts the timer rather than stretching it)."""
    return previous if previous is not None and previous <= now else now


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def _float_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
