"""The queue/bytes autoscaling policy: the pure decision, and its adapter on Ray's own
``AutoscalingContext`` and policy wrapper (no Ray cluster: both are plain Python objects)."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.autoscaling import (
    AutoscalingPolicyConfig,
    AutoscalingSnapshot,
    ReplicaLoad,
    ScalingState,
    decide,
    pressure,
)

GB = 1 << 30
NO_STATE = ScalingState()
CONFIG = AutoscalingPolicyConfig(target_queue_per_replica=4, target_utilisation=1.0,
                                 upscale_delay_s=10.0, downscale_delay_s=60.0)


def load(queue: float = 0, queued_gb: float = 0, reserved_gb: float = 0, budget_gb: float = 10,
         running: float | None = None) -> ReplicaLoad:
    return ReplicaLoad(queue_depth=queue, queued_bytes=queued_gb * GB,
                       reserved_bytes=reserved_gb * GB, budget_bytes=budget_gb * GB,
                       running_requests=(1 if reserved_gb else 0) if running is None else running)


def snap(now: float, current: int, each: ReplicaLoad, *, target: int | None = None,
         lo: int = 1, hi: int = 8, state: ScalingState = NO_STATE,
         handle_queued: float = 0) -> AutoscalingSnapshot:
    """``current`` running replicas, all reporting ``each``."""
    return AutoscalingSnapshot(now_s=now, current_replicas=current,
                               target_replicas=current if target is None else target,
                               min_replicas=lo, max_replicas=hi, replicas=(each,) * current,
                               handle_queued_requests=handle_queued, state=state)


class Deployment:
    """Ray's loop in miniature: every tick the policy's answer becomes the target, and the
    replicas follow at once (the metrics then describe the new count)."""

    def __init__(self, replicas: int, lo: int = 1, hi: int = 8,
                 config: AutoscalingPolicyConfig = CONFIG) -> None:
        self.replicas, self.lo, self.hi, self.config = replicas, lo, hi, config
        self.state = ScalingState()
        self.reason = ""

    def tick(self, now: float, each: ReplicaLoad, handle_queued: float = 0) -> int:
        desired, self.state, self.reason = decide(
            snap(now, self.replicas, each, lo=self.lo, hi=self.hi, state=self.state,
                 handle_queued=handle_queued), self.config)
        self.replicas = desired
        return desired


# --- the formula ---------------------------------------------------------------------------


def test_pressure_is_demand_over_capacity_at_the_targets() -> None:
    s = snap(0, 2, load(queue=6, queued_gb=5, reserved_gb=10))
    p = pressure(s, CONFIG)
    assert p.bytes == pytest.approx((2 * 15) / (1.0 * 10 * 2))  # 1.5
    assert p.queue == pytest.approx(12 / (4 * 2))  # 1.5
    half = pressure(s, replace(CONFIG, target_utilisation=0.5))
    assert half.bytes == pytest.approx(3.0)


def test_replicas_that_have_not_reported_count_as_empty_replicas_of_the_mean_budget() -> None:
    s = AutoscalingSnapshot(now_s=0, current_replicas=4, target_replicas=4, min_replicas=1,
                            max_replicas=8, replicas=(load(reserved_gb=10, queued_gb=10),) * 2)
    assert pressure(s, CONFIG).bytes == pytest.approx(40 / (10 * 4))  # 1.0, not 2.0
    assert decide(s, CONFIG).desired_replicas == 4


def test_a_vanishing_budget_reads_as_full_not_as_a_crash() -> None:
    tiny = ReplicaLoad(reserved_bytes=1.0, budget_bytes=5e-324)  # capacity underflows to 0
    s = snap(0.0, 2, tiny, state=ScalingState("up", -100.0))
    assert pressure(s, replace(CONFIG, target_utilisation=0.1)).bytes == math.inf
    assert decide(s, CONFIG).desired_replicas == 8


# --- scaling up ----------------------------------------------------------------------------


def test_a_burst_scales_to_max_only_after_the_upscale_delay() -> None:
    dep = Deployment(2, hi=6)
    burst = load(queue=40, reserved_gb=10, queued_gb=30)
    assert dep.tick(1000.0, burst) == 2
    assert dep.state.direction == "up" and "waited 0.0/10.0 s" in dep.reason
    assert dep.tick(1005.0, burst) == 2
    assert dep.tick(1009.9, burst) == 2
    assert dep.tick(1010.0, burst) == 6  # raw ceil(2 x 10) = 20, clamped to max
    assert dep.state == ScalingState() and "scale up 2 -> 6" in dep.reason


def test_upscaling_jumps_straight_to_the_computed_count() -> None:
    dep = Deployment(2)
    heavy = load(reserved_gb=10, queued_gb=12.5)  # demand 45 GB over 2 x 10 GB
    dep.tick(0.0, heavy)
    assert dep.tick(10.0, heavy) == 5  # ceil(2 x 2.25)


def test_few_huge_requests_scale_on_bytes_though_the_queue_is_short() -> None:
    # one waiter per replica (queue pressure 2 / (4 x 2) = 0.25), but each needs 16 GB
    heavy = load(queue=1, reserved_gb=9, queued_gb=16)
    s = snap(0.0, 2, heavy)
    p = pressure(s, CONFIG)
    assert p.queue == pytest.approx(0.25) and p.bytes == pytest.approx(2.5)
    dep = Deployment(2)
    dep.tick(0.0, heavy)
    assert dep.tick(10.0, heavy) == 5  # ceil(2 x 2.5)


def test_many_small_requests_scale_on_queue_length_though_bytes_are_free() -> None:
    many_small = load(queue=12, reserved_gb=1, queued_gb=0.1)
    dep = Deployment(2)
    dep.tick(0.0, many_small)
    assert dep.tick(10.0, many_small) == 6  # ceil(2 x 24 / 8)


def test_requests_queued_at_the_handles_count_as_queue() -> None:
    dep = Deployment(2)
    busy = load(reserved_gb=9)
    dep.tick(0.0, busy, handle_queued=20)
    assert dep.tick(10.0, busy, handle_queued=20) == 5  # ceil(2 x 20 / (4 x 2))


def test_no_scale_up_while_the_new_replicas_are_still_starting() -> None:
    # target already 5 (3 replicas starting); the 2 running ones ask for 5: nothing to do
    s = replace(snap(0.0, 2, load(reserved_gb=10, queued_gb=15)), target_replicas=5)
    assert decide(s, CONFIG).desired_replicas == 5
    assert decide(s, CONFIG).state.direction is None


# --- steady load ---------------------------------------------------------------------------


def test_steady_load_within_target_keeps_the_count() -> None:
    dep = Deployment(3)
    steady = load(queue=3, reserved_gb=8, queued_gb=1)  # bytes 0.9, queue 0.75: raw 3
    for t in range(0, 3600, 7):
        assert dep.tick(float(t), steady) == 3
    assert dep.state == ScalingState()
    assert dep.reason.startswith("hold at 3")


def test_a_step_up_is_stable_once_taken() -> None:
    dep = Deployment(2)
    demand_gb = 25.0  # 2.5 replicas of 10 GB
    for t in range(0, 600, 5):
        dep.tick(float(t), load(reserved_gb=demand_gb / dep.replicas))
    assert dep.replicas == 3


# --- scaling down --------------------------------------------------------------------------


def test_idle_goes_back_to_min_only_after_the_downscale_delay() -> None:
    dep = Deployment(5, lo=2)
    idle = load()
    assert dep.tick(1000.0, idle) == 5
    assert dep.tick(1030.0, idle) == 5
    assert dep.tick(1059.9, idle) == 5
    assert dep.tick(1060.0, idle) == 2  # straight to min: idle replicas have nothing to drain
    assert "idle for 60.0 s" in dep.reason


def test_low_load_scales_down_one_replica_per_downscale_delay() -> None:
    dep = Deployment(4)
    light = load(reserved_gb=1)  # bytes pressure 0.1: raw 1, but one step at a time
    assert dep.tick(0.0, light) == 4
    assert dep.tick(59.0, light) == 4
    assert dep.tick(60.0, light) == 3
    assert dep.tick(61.0, light) == 3  # the next step waits a full delay again
    assert dep.tick(119.0, light) == 3
    assert dep.tick(121.0, light) == 2


def test_any_work_in_flight_stops_the_jump_to_min() -> None:
    dep = Deployment(5)
    nearly_idle = load(running=1)  # a request holds a lease of (almost) no bytes
    dep.tick(0.0, nearly_idle)
    assert dep.tick(60.0, nearly_idle) == 4  # one step, not to min
    assert dep.state.idle_since_s is None


def test_idle_after_low_load_steps_first_then_goes_to_min_once_idle_long_enough() -> None:
    dep = Deployment(6)
    dep.tick(0.0, load(reserved_gb=1))
    dep.tick(30.0, load())  # idle from 30 s; the down timer has run since 0 s
    assert dep.tick(60.0, load()) == 5  # down timer due, idle only 30 s: one step
    assert dep.tick(89.0, load()) == 5
    assert dep.tick(90.0, load()) == 1  # idle for 60 s: to min at once


# --- timers and bounds ---------------------------------------------------------------------


def test_a_change_of_direction_restarts_the_timer() -> None:
    dep = Deployment(3)
    up, down = load(queue=20, reserved_gb=10), load(reserved_gb=1)
    dep.tick(0.0, up)
    assert dep.tick(9.0, up) == 3  # 9 of 10 s
    assert dep.tick(9.5, down) == 3 and dep.state.direction == "down"
    assert dep.tick(10.0, up) == 3 and dep.state.since_s == 10.0  # restarted, not 0.0
    assert dep.tick(19.9, up) == 3
    assert dep.tick(20.0, up) > 3


def test_hold_resets_the_timer() -> None:
    dep = Deployment(3)
    up, steady = load(queue=20, reserved_gb=10), load(queue=3, reserved_gb=8)
    dep.tick(0.0, up)
    dep.tick(8.0, steady)
    assert dep.state == ScalingState()
    dep.tick(9.0, up)
    assert dep.tick(18.0, up) == 3 and dep.tick(19.0, up) > 3


def test_a_clock_that_goes_back_restarts_the_timer() -> None:
    state = ScalingState("up", 5000.0)
    s = snap(1000.0, 2, load(queue=20, reserved_gb=10), state=state)
    d = decide(s, CONFIG)
    assert d.desired_replicas == 2 and d.state.since_s == 1000.0


def test_results_are_clamped_to_min_and_max() -> None:
    huge = load(queue=1000, reserved_gb=10, queued_gb=1000)
    assert decide(snap(0.0, 3, huge, hi=4, state=ScalingState("up", -100.0)),
                  CONFIG).desired_replicas == 4
    # a target outside the bounds (bounds lowered) comes back at once, without a delay
    assert decide(snap(0.0, 6, load(), hi=4), CONFIG).desired_replicas == 4
    assert decide(snap(0.0, 1, huge, lo=3), CONFIG).desired_replicas == 3
    # never below min, even idle for long
    idle_long = ScalingState(idle_since_s=-1e6)
    assert decide(snap(0.0, 3, load(), lo=3, state=idle_long), CONFIG).desired_replicas == 3


def test_no_reports_hold_the_count() -> None:
    s = AutoscalingSnapshot(now_s=0, current_replicas=3, target_replicas=3, min_replicas=1,
                            max_replicas=8, state=ScalingState("down", -1e6, -1e6))
    d = decide(s, CONFIG)
    assert d.desired_replicas == 3 and d.state == ScalingState() and "no replica" in d.reason


def test_from_zero_replicas_a_waiting_request_starts_one_at_once() -> None:
    s = AutoscalingSnapshot(now_s=0, current_replicas=0, target_replicas=0, min_replicas=0,
                            max_replicas=4, handle_queued_requests=2)
    assert decide(s, CONFIG).desired_replicas == 1
    assert decide(replace(s, handle_queued_requests=0), CONFIG).desired_replicas == 0


# --- config and state ----------------------------------------------------------------------


def test_target_queue_from_admission_max_queue_len() -> None:
    assert AutoscalingPolicyConfig.from_admission(64).target_queue_per_replica == 32
    assert AutoscalingPolicyConfig.from_admission(1).target_queue_per_replica == 1
    assert AutoscalingPolicyConfig.from_admission(
        64, queue_fraction=0.25, upscale_delay_s=1).target_queue_per_replica == 16


@pytest.mark.parametrize("field,value", [("target_queue_per_replica", 0),
                                         ("target_utilisation", -1),
                                         ("target_utilisation", math.inf),
                                         ("upscale_delay_s", -1),
                                         ("downscale_delay_s", math.nan)])
def test_invalid_config_is_refused_with_the_field_named(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        AutoscalingPolicyConfig(**{field: value})


def test_state_survives_the_dict_ray_carries_and_ignores_ray_keys() -> None:
    state = ScalingState("down", 12.5, 3.0)
    carried = {**state.to_dict(), "__decision_counters": -3, "__decision_timestamp": 1.0}
    assert ScalingState.from_dict(carried) == state
    assert ScalingState.from_dict({}) == ScalingState()
    assert ScalingState.from_dict({"vramgate_direction": "sideways",
                                   "vramgate_since_s": "soon"}) == ScalingState()


# --- properties ----------------------------------------------------------------------------

loads = st.builds(ReplicaLoad,
                  queue_depth=st.floats(0, 500), queued_bytes=st.floats(0, 1e12),
                  reserved_bytes=st.floats(0, 1e12), budget_bytes=st.floats(0, 1e12),
                  running_requests=st.floats(0, 50))
states = st.builds(ScalingState, st.sampled_from([None, "up", "down"]),
                   st.none() | st.floats(-1e4, 1e4), st.none() | st.floats(-1e4, 1e4))
configs = st.builds(AutoscalingPolicyConfig, st.floats(0.5, 100), st.floats(0.1, 2),
                    st.floats(0, 100), st.floats(0, 1000))


@st.composite
def snapshots(draw: st.DrawFn, target_in_bounds: bool = False) -> AutoscalingSnapshot:
    lo = draw(st.integers(0, 5))
    hi = draw(st.integers(max(lo, 1), 12))
    target = draw(st.integers(lo, hi) if target_in_bounds else st.integers(0, 15))
    current = draw(st.integers(0, 15))
    reported = draw(st.lists(loads, max_size=current))
    return AutoscalingSnapshot(now_s=draw(st.floats(-1e4, 1e4)), current_replicas=current,
                               target_replicas=target, min_replicas=lo, max_replicas=hi,
                               replicas=tuple(reported),
                               handle_queued_requests=draw(st.floats(0, 1000)),
                               state=draw(states))


@settings(max_examples=500, deadline=None)
@given(snapshots(), configs)
def test_property_the_result_is_always_within_min_and_max(s: AutoscalingSnapshot,
                                                          config: AutoscalingPolicyConfig
                                                          ) -> None:
    assert s.min_replicas <= decide(s, config).desired_replicas <= s.max_replicas


@settings(max_examples=500, deadline=None)
@given(snapshots(target_in_bounds=True), configs)
def test_property_never_moves_against_the_pressure(s: AutoscalingSnapshot,
                                                   config: AutoscalingPolicyConfig) -> None:
    desired, state, _ = decide(s, config)
    p = pressure(s, config).value
    if p > 1 or s.handle_queued_requests > 0 and s.current_replicas == 0:
        assert desired >= s.target_replicas
    if p < 1 and s.current_replicas > 0:
        assert desired <= s.target_replicas
    if desired < s.target_replicas - 1:  # more than one step down only to min when idle
        assert s.idle and desired == s.min_replicas
    if desired != s.target_replicas:
        assert state.direction is None  # acting resets the timer


# --- the adapter on Ray's own context and wrapper --------------------------------------------

ray_config = pytest.importorskip("ray.serve.config", reason="the adapter tests need ray[serve]")
from ray.serve._private.autoscaling_state import _resolve_policy_callable  # noqa: E402
from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402
from ray.serve.autoscaling_policy import _apply_autoscaling_config  # noqa: E402

from deployments.cluster import autoscaling as adapter  # noqa: E402
from serve_app import replica_state as keys  # noqa: E402
from serve_app.replica_state import DeviceFigures, GateFigures, ReplicaState  # noqa: E402

DEP = DeploymentID(name="ModelServer", app_name="default")
REPLICAS = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(2)]


def ray_autoscaling_config(policy: str, ray_delays_s: float = 0.0,
                           **policy_kwargs: object) -> object:
    return ray_config.AutoscalingConfig(
        min_replicas=1, max_replicas=6, upscale_delay_s=ray_delays_s,
        downscale_delay_s=ray_delays_s,
        policy={"policy_function": f"deployments.cluster.autoscaling:{policy}",
                "policy_kwargs": policy_kwargs})


def context(config: object, now: float, state: dict, per_replica: dict[str, float],
            target: int = 2, handle_queued: float = 0.0) -> object:
    metrics = {key: {r: value for r in REPLICAS} for key, value in per_replica.items()}
    return ray_config.AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
        current_num_replicas=len(REPLICAS), target_num_replicas=target,
        running_replicas=REPLICAS, total_num_requests=lambda: 0.0,
        total_queued_requests=lambda: handle_queued, aggregated_metrics=lambda: metrics,
        raw_metrics=lambda: {}, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state=state,
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=config)


def replica_stats(queue: int = 0, queued_gb: float = 0, reserved_gb: float = 0,
                  budget_gb: float = 10, leases: int = 0) -> dict[str, float]:
    """What a replica in this state returns from ``record_autoscaling_stats``."""
    budget = int(budget_gb * GB)
    gate = GateFigures(capacity=budget, reserved_bytes=int(reserved_gb * GB),
                       peak_reserved_bytes=int(reserved_gb * GB),
                       free_bytes=budget - int(reserved_gb * GB), active_leases=leases,
                       queue_depth=queue, queued_bytes=int(queued_gb * GB),
                       charged_bytes_total=0, released_bytes_total=0, drain_bytes_per_s=None)
    device = DeviceFigures(inferences_running=0, inferences_total=0, oom_count=0,
                           device_fault=None, cost_correction_factor=1.0, cost_corrections=0)
    state = ReplicaState(replica_id="r", node_id="node", gpu_ids=(), num_gpus=0.0,
                         model="ignored", task="fake", kinds=("embed",), policy="budget",
                         gate_units="bytes", memory={}, cost_model={}, gate=gate,
                         device=device, budget_bytes=budget, measured_budget_bytes=budget,
                         budget_shrink_count=0, budget_regrow_count=0)
    return state.to_autoscaling_stats()


def test_replica_stats_are_numbers_under_the_module_keys() -> None:
    stats = replica_stats(queue=3, reserved_gb=1, leases=2)
    assert set(stats) == set(keys.AUTOSCALING_KEYS)
    assert all(type(v) is float for v in stats.values())  # Ray refuses anything else
    assert stats[keys.AUTOSCALING_QUEUE_DEPTH_KEY] == 3
    assert stats[keys.AUTOSCALING_RUNNING_REQUESTS_KEY] == 2


def test_the_snapshot_sums_per_replica_metrics_from_the_context() -> None:
    config = ray_autoscaling_config("QueueAutoscalingPolicy")
    ctx = context(config, 123.0, {"vramgate_direction": "up", "vramgate_since_s": 100.0},
                  replica_stats(queue=2, queued_gb=3, reserved_gb=4, leases=1), target=3,
                  handle_queued=5)
    s = adapter.snapshot_from_context(ctx)
    assert (s.now_s, s.current_replicas, s.target_replicas, s.min_replicas,
            s.max_replicas) == (123.0, 2, 3, 1, 6)
    assert s.replicas == (load(queue=2, queued_gb=3, reserved_gb=4, running=1),) * 2
    assert s.handle_queued_requests == 5 and s.state == ScalingState("up", 100.0)


def test_a_replica_without_a_budget_figure_has_not_reported() -> None:
    config = ray_autoscaling_config("QueueAutoscalingPolicy")
    stats = replica_stats(queue=2)
    del stats[keys.AUTOSCALING_BUDGET_BYTES_KEY]
    assert adapter.snapshot_from_context(context(config, 0.0, {}, stats)).replicas == ()


def test_ray_runs_the_policy_class_with_its_kwargs_and_carries_its_state() -> None:
    config = ray_autoscaling_config("QueueAutoscalingPolicy", upscale_delay_s=5,
                                    downscale_delay_s=30, max_queue_len=8)
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    burst = replica_stats(queue=10, reserved_gb=10)  # queue pressure 20 / (4 x 2) = 2.5
    n, state = policy(context(config, 1000.0, {}, burst))
    assert n == 2 and state["vramgate_direction"] == "up"
    assert "__decision_timestamp" in state  # Ray's own keys ride along
    n, state = policy(context(config, 1004.9, state, burst))
    assert n == 2
    n, state = policy(context(config, 1005.0, state, burst))
    assert n == 5 and state["vramgate_direction"] is None


def test_ray_runs_the_policy_function_with_the_module_defaults() -> None:
    config = ray_autoscaling_config("queue_autoscaling_policy")
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    heavy = replica_stats(reserved_gb=10, queued_gb=20)  # bytes pressure 3
    n, state = policy(context(config, 0.0, {}, heavy))
    assert n == 2
    n, state = policy(context(config, adapter.DEFAULT_CONFIG.upscale_delay_s, state, heavy))
    assert n == 6


def test_ray_own_delays_come_on_top_and_are_warned_about(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "_warned_ray_delays", False)
    config = ray_autoscaling_config("QueueAutoscalingPolicy", ray_delays_s=30.0,
                                    upscale_delay_s=0)
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        n, _ = policy(context(config, 0.0, {}, replica_stats(queue=10, reserved_gb=10)))
    assert n == 2  # our delay (0 s) has passed; Ray's 30 s timer has only started
    assert "set both to 0" in caplog.text


def test_unknown_or_conflicting_policy_kwargs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown autoscaling policy_kwargs"):
        adapter.QueueAutoscalingPolicy(upscale_delay=5)
    with pytest.raises(ValueError, match="not both"):
        adapter.QueueAutoscalingPolicy(max_queue_len=8, target_queue_per_replica=2)
    with pytest.raises(ValueError, match="needs max_queue_len"):
        adapter.QueueAutoscalingPolicy(queue_fraction=0.5)
    assert adapter.QueueAutoscalingPolicy(
        max_queue_len=64, queue_fraction=0.25).config.target_queue_per_replica == 16
