"""Measurements made before the deployment: their key, their cache, the plan they yield, and
the placement check that refuses a cluster without the GPUs a replica needs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.cluster.fail_fast import _is_live_serve_run, refusal_text
from deployments.engines.fake import FakeEngine
from serve_app import planning
from serve_app.config import parse_args
from serve_app.measurement import (
    ALLOCATOR_ENV,
    Measurement,
    MeasurementCache,
    measurement_identity,
    measurement_key,
)
from serve_app.memory.cost_model import FittedCostModel
from serve_app.memory.profiler import MemoryProfile, ProfilePoint
from serve_app.placement import gpu_placement_problem

MiB, GiB = 1 << 20, 1 << 30
CARD = ("NVIDIA H200", 143 * GiB)


def gpu_args(**sections: dict):
    return parse_args({"model": {"task": "fake"}, "deployment": {"num_gpus": 0.5},
                       **sections})


def key_of(args) -> str:
    return measurement_key(measurement_identity(args, "fake"))


def measurement(args, per_token_bytes: float = 2 * MiB, held_bytes: int = 2 * GiB,
                card=CARD) -> Measurement:
    point = ProfilePoint(1, 8, 0, measured_bytes=MiB, predicted_bytes=MiB,
                         analytic_bytes=MiB, held_out=False)
    profile = MemoryProfile(
        device="cuda:0", method="torch.cuda.max_memory_allocated", task="fake",
        model_path="fake", capacity_bytes=card[1] // 2, held_bytes=held_bytes,
        cost_model=FittedCostModel(("batch_tokens",), (per_token_bytes,), 0.01),
        points=(point,), duration_s=3.0)
    identity = measurement_identity(args, "fake")
    return Measurement(key=measurement_key(identity), identity=identity, device_name=card[0],
                       card_bytes=card[1], profile=profile, max_request_bytes=4 * GiB,
                       measured_at=1_796_000_000.0)


def test_the_key_changes_with_what_changes_the_measurement(monkeypatch) -> None:
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    base = key_of(gpu_args())
    assert key_of(gpu_args()) == base  # stable
    assert len(base) == 16 and int(base, 16) >= 0
    changed = [gpu_args(limits={"max_inputs": 9}), gpu_args(model={"task": "fake",
                                                                   "dtype": "bfloat16"}),
               gpu_args(deployment={"num_gpus": 0.25}),
               gpu_args(memory={"capacity_bytes": GiB}),
               gpu_args(fake={"bytes_per_token": 2 * MiB})]
    keys = {key_of(a) for a in changed}
    assert base not in keys and len(keys) == len(changed)
    monkeypatch.setenv(ALLOCATOR_ENV, "expandable_segments:True")
    assert key_of(gpu_args()) != base
    # What a measurement does not depend on leaves the key alone.
    assert key_of(gpu_args(admission={"max_queue_len": 7}, memory={"safety_factor": 0.5})) \
        == key_of(gpu_args())


def test_the_cache_gives_back_what_it_saved_for_the_same_card(tmp_path: Path) -> None:
    args = gpu_args()
    cache = MeasurementCache(tmp_path / "m")
    saved = cache.put(measurement(args))
    assert saved.profile_path == str(tmp_path / "m" / f"{saved.key}.profile.json")
    assert MemoryProfile.load(Path(saved.profile_path)) == saved.profile  # for profile_path
    found = cache.get(saved.key, CARD)
    assert found is not None and found.reused and not saved.reused
    assert (found.profile, found.card_bytes, found.max_request_bytes, found.measured_at) == \
        (saved.profile, CARD[1], 4 * GiB, 1_796_000_000.0)
    assert found.summary()["measured_at"] == "2026-11-30T00:53:20Z"
    assert found.describe().startswith(f"cached measurement {saved.key} on NVIDIA H200")
    assert cache.get(saved.key, ("NVIDIA H100 80GB HBM3", 80 * GiB)) is None  # another card
    assert cache.get(saved.key, (CARD[0], CARD[1] - GiB)) is None  # another size
    assert cache.get(saved.key) is not None  # the card unchecked (no GPU free to check on)
    assert cache.get("0" * 16, CARD) is None


def test_an_unreadable_cache_entry_is_a_miss_and_an_unwritable_dir_still_serves(
        tmp_path: Path) -> None:
    args = gpu_args()
    cache = MeasurementCache(tmp_path)
    cache.path(key_of(args)).write_text("{not json")
    assert cache.get(key_of(args), CARD) is None
    blocked = tmp_path / "file"
    blocked.write_text("")
    kept = MeasurementCache(blocked / "sub").put(measurement(args))
    assert kept.profile_path == "" and kept.key == key_of(args)
    assert not list(tmp_path.glob(".*.tmp"))  # no half-written file left behind


def test_a_measurement_plans_the_deployment_from_what_it_measured() -> None:
    args = gpu_args(fake={"device_capacity_bytes": 16 * GiB, "weights_bytes": 2 * GiB})
    analytic = planning.plan_deployment(args, FakeEngine)
    # Measured: the model holds 3 GiB, not 2, and a token costs 2 MiB, not the 1 MiB the
    # fake engine's config says: fewer requests fit.
    measured = measurement(args, per_token_bytes=2 * MiB, held_bytes=3 * GiB,
                           card=("simulated", 16 * GiB))
    plan = planning.plan_deployment(args, FakeEngine, measured)
    budget = int((8 * GiB - 3 * GiB) * 0.9)
    price = 2 * MiB * 8 * 128  # P95: 8 inputs x 128 tokens
    assert (plan.budget_bytes, plan.request_bytes) == (budget, price)
    assert plan.max_running_estimate == budget // price != analytic.max_running_estimate
    smallest = 2 * MiB  # 1 x 1 token
    assert plan.max_admitted_estimate == budget // smallest
    assert plan.max_ongoing_requests == min(planning.MAX_ONGOING_REQUESTS_CAP,
                                            budget // smallest + args.admission.max_queue_len)
    assert plan.how == measured.describe().replace("cached ", "")
    assert plan.min_num_gpus is not None  # the card's size is known: a share is recommended
    assert planning.plan_deployment(args, FakeEngine, None) == analytic


@pytest.mark.parametrize(("need", "gpus", "problem"), [
    (0.5, [0.0], "has a GPU (10.0.0.1: 0 GPU)"),
    (0.5, [], "has a GPU (no nodes)"),
    (2.0, [1.0, 1.0], "has 2 GPU (10.0.0.1: 1 GPU, 10.0.0.2: 1 GPU)"),
    (0.5, [0.0, 1.0], None),
    (1.0, [1.0], None),
    (0.0, [], None),
])
def test_a_cluster_that_can_never_place_a_replica_is_named(
        need: float, gpus: list[float], problem: str | None) -> None:
    nodes = [{"Alive": True, "NodeManagerAddress": f"10.0.0.{i}", "Resources": {"GPU": g}}
             for i, g in enumerate(gpus, 1)]
    nodes.append({"Alive": False, "NodeManagerAddress": "10.0.0.9", "Resources": {"GPU": 8}})
    args = parse_args({"model": {"task": "fake"}, "deployment": {"num_gpus": min(need, 1.0)}})
    if need > 1:  # more than one card per replica is not a config value; check the rule
        args = args.model_copy(update={"deployment": args.deployment.model_copy(
            update={"num_gpus": need})})
    found = gpu_placement_problem(args, nodes)
    if problem is None:
        assert found is None
        return
    assert found.startswith(f"deployment.num_gpus is {need:g} per model replica, but no node "
                            f"of this Ray cluster {problem}. ")
    assert "deployment.wait_for_gpus: true" in found
    waiting = args.model_copy(update={"deployment": args.deployment.model_copy(
        update={"wait_for_gpus": True})})
    assert gpu_placement_problem(waiting, nodes) is None


@pytest.mark.parametrize(("entrypoint", "status", "stopped"), [
    ("/venv/bin/python /venv/bin/serve run configs/prod.yaml", "RUNNING", True),
    ("serve run configs/prod.yaml", "RUNNING", True),
    ("/venv/bin/python /venv/bin/serve run configs/prod.yaml", "SUCCEEDED", False),
    ("/venv/bin/python /venv/bin/serve deploy configs/prod.yaml", "RUNNING", False),
    ("/venv/bin/python -m pytest tests/e2e", "RUNNING", False),
    ("python my_serve_run_script.py", "RUNNING", False),
])
def test_only_live_serve_run_drivers_are_stopped(entrypoint: str, status: str,
                                                 stopped: bool) -> None:
    job = SimpleNamespace(entrypoint=entrypoint, status=status,
                          driver_info=SimpleNamespace(pid="1", node_ip_address="10.0.0.1"))
    assert _is_live_serve_run(job) is stopped


def test_a_measurement_round_trips_through_json() -> None:
    original = measurement(gpu_args())
    again = Measurement.from_dict(json.loads(json.dumps(original.to_dict())))
    assert again.profile == original.profile and again.identity == original.identity
    assert again.reused and not original.reused


def test_an_unreadable_model_names_model_path_in_the_refusal() -> None:
    args = parse_args({"model": {"task": "generate", "path": "/nowhere/causal-lm"}})
    missing = FileNotFoundError(2, "No such file or directory", "/nowhere/causal-lm/config.json")
    assert refusal_text(missing, args) == (
        "cannot load the model of model.path '/nowhere/causal-lm': No such file or directory: "
        "/nowhere/causal-lm/config.json")
    assert refusal_text(ValueError("budget too small"), args) == "budget too small"
