"""plan_deployment: max_ongoing_requests from a measured profile, else the analytic estimate.

The engine of each config comes from the registry (:func:`engine_class`), as in ``build_app``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from deployments.engines.registry import engine_class
from serve_app import planning
from serve_app.config import AppArgs, parse_args
from serve_app.kinds import context_problems
from serve_app.memory.budget import InsufficientMemoryError
from serve_app.memory.cost_model import (
    DTYPE_BYTES,
    AnalyticCostModel,
    FittedCostModel,
    TransformerShape,
)
from serve_app.memory.profiler import MemoryProfile, ProfilePoint
from serve_app.planning import (
    FALLBACK_MAX_RUNNING,
    MAX_ONGOING_REQUESTS_CAP,
    DeploymentPlan,
    gpu_share_for,
    max_running_requests,
)

MiB = 1 << 20
GiB = 1 << 30
# 1 MiB per request + 1 KiB per input token: a P95 request of 8 x 128 tokens costs 2 MiB.
COST_MODEL = FittedCostModel(("const", "batch_tokens"), (float(MiB), 1024.0), 0.05)
P95_PRICE = MiB + 1024 * 8 * 128


def plan_deployment(args: AppArgs) -> DeploymentPlan:
    return planning.plan_deployment(args, engine_class(args))


def plan_from_profile(args: AppArgs, profile: MemoryProfile, **options) -> DeploymentPlan:
    return planning.plan_from_profile(args, profile, engine_class(args).kinds, **options)


def p95_request_shapes(args: AppArgs) -> list[tuple[int, int, int]]:
    return planning.p95_request_shapes(args, engine_class(args).kinds)


def packaged_model_path() -> str:
    return str(AppArgs().model.resolved_path())


def make_profile(device: str = "cpu", capacity_bytes: int = 1000 * MiB,
                 held_bytes: int = 100 * MiB, model_path: str | None = None,
                 task: str = "embed") -> MemoryProfile:
    point = ProfilePoint(1, 8, 0, measured_bytes=MiB, predicted_bytes=MiB,
                         analytic_bytes=2 * MiB, held_out=False)
    return MemoryProfile(device=device, method="hand-made for a test", task=task,
                         model_path=model_path or packaged_model_path(),
                         capacity_bytes=capacity_bytes, held_bytes=held_bytes,
                         cost_model=COST_MODEL, points=(point,), duration_s=0.0)


def saved(tmp_path: Path, profile: MemoryProfile) -> Path:
    path = tmp_path / "profile.json"
    profile.save(path)
    return path


def args_with(profile_path: Path | str = "", **sections: dict) -> AppArgs:
    memory = {"reserve_bytes": 50 * MiB, "safety_factor": 0.5, **sections.pop("memory", {})}
    if profile_path:
        memory["profile_path"] = str(profile_path)
    return parse_args({"memory": memory, **sections})


# --- with a measured profile ------------------------------------------------------------------


def test_a_saved_profile_gives_budget_floordiv_price(tmp_path: Path) -> None:
    path = saved(tmp_path, make_profile())
    plan = plan_deployment(args_with(path, admission={"max_queue_len": 10}))
    budget = int((1000 * MiB - 100 * MiB - 50 * MiB) * 0.5)  # capacity - held - reserve
    assert plan.budget_bytes == budget == 445644800
    assert plan.request_bytes == P95_PRICE == 2 * MiB
    assert plan.max_running_estimate == budget // P95_PRICE == 212
    # Ray's cap holds what the budget admits at once: the smallest request (1 x 1 token)
    # costs 1 MiB + 1 KiB, plus the queue.
    assert plan.max_admitted_estimate == budget // (MiB + 1024) == 424
    assert plan.max_ongoing_requests == 424 + 10
    assert plan.how == f"measured profile {path}"


def test_the_p95_knobs_set_the_price(tmp_path: Path) -> None:
    path = saved(tmp_path, make_profile())
    plan = plan_deployment(args_with(path, deployment={"p95_inputs": 2, "p95_input_tokens": 64}))
    price = MiB + 1024 * 2 * 64
    assert plan.request_bytes == price
    assert plan.max_running_estimate == 445644800 // price == 377


def test_the_p95_request_is_capped_by_the_limits(tmp_path: Path) -> None:
    args = args_with(saved(tmp_path, make_profile()), limits={"max_inputs": 4,
                                                              "max_input_tokens": 32})
    assert p95_request_shapes(args) == [(4, 32, 0)]
    assert plan_deployment(args).request_bytes == MiB + 1024 * 4 * 32


def test_memory_capacity_bytes_overrides_the_profiles_capacity(tmp_path: Path) -> None:
    path = saved(tmp_path, make_profile())
    plan = plan_deployment(args_with(path, memory={"capacity_bytes": 500 * MiB}))
    assert plan.budget_bytes == int((500 - 100 - 50) * MiB * 0.5)
    assert plan.max_running_estimate == plan.budget_bytes // P95_PRICE == 87


def test_memory_budget_bytes_overrides_the_derived_budget(tmp_path: Path) -> None:
    path = saved(tmp_path, make_profile())
    plan = plan_deployment(args_with(path, memory={"budget_bytes": 21 * MiB}))
    assert plan.budget_bytes == 21 * MiB
    assert plan.max_running_estimate == 10


def test_a_budget_smaller_than_one_request_still_runs_one(tmp_path: Path) -> None:
    path = saved(tmp_path, make_profile())
    plan = plan_deployment(args_with(path, memory={"budget_bytes": MiB}))
    assert plan.max_running_estimate == 1
    assert max_running_requests(0, 5) == 1
    assert max_running_requests(10, 0) == 10


def test_a_profile_that_leaves_no_budget_fails_fast(tmp_path: Path) -> None:
    path = saved(tmp_path, make_profile(held_bytes=990 * MiB))
    with pytest.raises(InsufficientMemoryError, match="memory.reserve_bytes"):
        plan_deployment(args_with(path))


@pytest.mark.parametrize("contents", ["not json", json.dumps({"version": 99})])
def test_an_unreadable_profile_falls_back_to_the_analytic_estimate(
        tmp_path: Path, contents: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "broken.json"
    path.write_text(contents)
    with caplog.at_level(logging.WARNING, logger="serve_app.planning"):
        plan = plan_deployment(args_with(path, memory={"capacity_bytes": GiB}))
    assert plan.how == "analytic estimate from memory.capacity_bytes"
    assert "cannot use the profile" in caplog.text


def test_a_missing_profile_falls_back_to_the_analytic_estimate(tmp_path: Path) -> None:
    plan = plan_deployment(args_with(tmp_path / "absent.json", memory={"capacity_bytes": GiB}))
    assert plan.how == "analytic estimate from memory.capacity_bytes"


def test_a_profile_of_another_model_is_not_used(tmp_path: Path) -> None:
    path = saved(tmp_path, make_profile(model_path="/elsewhere/model"))
    plan = plan_deployment(args_with(path, memory={"capacity_bytes": GiB}))
    assert plan.how == "analytic estimate from memory.capacity_bytes"


def test_a_profile_of_another_kind_of_device_is_not_used(tmp_path: Path) -> None:
    gpu_args = {"model": {"device": "cuda"}, "deployment": {"num_gpus": 0.5},
                "memory": {"capacity_bytes": GiB}}
    plan = plan_deployment(args_with(saved(tmp_path, make_profile(device="cpu")), **gpu_args))
    assert plan.how == "analytic estimate from memory.capacity_bytes"
    cuda = make_profile(device="cuda:0 (test card)")
    plan = plan_deployment(args_with(saved(tmp_path, cuda), memory={"capacity_bytes": GiB}))
    assert plan.how == "analytic estimate from memory.capacity_bytes"
    plan = plan_deployment(args_with(saved(tmp_path, cuda), **gpu_args))
    assert plan.how.startswith("measured profile")


def test_the_profile_path_may_start_with_a_tilde(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    saved(tmp_path, make_profile())
    plan = plan_deployment(args_with("~/profile.json"))
    assert plan.max_running_estimate == 212


# --- without a profile: the analytic estimate -------------------------------------------------


def minilm_analytic() -> AnalyticCostModel:
    config = json.loads((Path(packaged_model_path()) / "config.json").read_text())
    return AnalyticCostModel(TransformerShape.from_hf_config(config, DTYPE_BYTES["float32"]))


def test_without_a_profile_the_analytic_model_prices_the_p95_request() -> None:
    args = args_with(memory={"capacity_bytes": 2 * GiB}, model={"dtype": "float32"},
                     admission={"max_queue_len": 7})
    analytic = minilm_analytic()
    budget = int((2 * GiB - analytic.weights_bytes() - 50 * MiB) * 0.5)
    price = analytic.request_bytes(8, 128)
    plan = plan_deployment(args)
    assert (plan.budget_bytes, plan.request_bytes) == (budget, price)
    assert plan.max_running_estimate == budget // price
    smallest = analytic.request_bytes(1, 1)
    assert plan.max_ongoing_requests == budget // smallest + 7
    assert plan.how == "analytic estimate from memory.capacity_bytes"
    assert plan.min_num_gpus is None


def test_analytic_with_a_fixed_budget() -> None:
    plan = plan_deployment(args_with(memory={"budget_bytes": 300 * MiB}))
    assert plan.max_running_estimate == 300 * MiB // minilm_analytic().request_bytes(8, 128)
    assert plan.how == "analytic estimate from memory.budget_bytes"


def test_a_gpu_replica_of_unknown_size_uses_the_fallback() -> None:
    plan = plan_deployment(parse_args({"model": {"device": "cuda"},
                                       "deployment": {"num_gpus": 0.5}}))
    assert plan.max_running_estimate == FALLBACK_MAX_RUNNING
    assert plan.max_ongoing_requests == FALLBACK_MAX_RUNNING + 64
    assert plan.budget_bytes is None and plan.request_bytes is None


# --- overrides and policies -------------------------------------------------------------------


@pytest.mark.parametrize("with_profile", [True, False])
def test_deployment_max_ongoing_requests_overrides(tmp_path: Path, with_profile: bool) -> None:
    path = saved(tmp_path, make_profile()) if with_profile else ""
    plan = plan_deployment(args_with(path, memory={"capacity_bytes": GiB},
                                     deployment={"max_ongoing_requests": 5}))
    assert plan.max_ongoing_requests == 5
    assert plan.how == "deployment.max_ongoing_requests"


@pytest.mark.parametrize("with_profile", [True, False])
def test_the_semaphore_policy_runs_its_permits(tmp_path: Path, with_profile: bool) -> None:
    path = saved(tmp_path, make_profile()) if with_profile else ""
    plan = plan_deployment(args_with(path, memory={"capacity_bytes": GiB},
                                     admission={"policy": "semaphore", "semaphore_permits": 3,
                                                "max_queue_len": 4}))
    assert plan.max_running_estimate == plan.max_admitted_estimate == 3
    assert plan.max_ongoing_requests == 3 + 4
    assert plan.how == "admission.semaphore_permits"


def test_max_ongoing_requests_is_capped(tmp_path: Path) -> None:
    path = saved(tmp_path, make_profile(capacity_bytes=100 * GiB))
    plan = plan_deployment(args_with(path))
    assert plan.max_running_estimate > MAX_ONGOING_REQUESTS_CAP
    assert plan.max_ongoing_requests == MAX_ONGOING_REQUESTS_CAP


def test_the_caller_queue_is_the_replica_queue_times_replicas(tmp_path: Path) -> None:
    plan = plan_deployment(args_with(saved(tmp_path, make_profile()),
                                     admission={"max_queue_len": 6},
                                     deployment={"num_replicas": 3}))
    assert plan.max_queued_requests == 18


# --- the recommended GPU share ----------------------------------------------------------------


def test_a_cpu_profile_recommends_no_gpu() -> None:
    assert plan_from_profile(args_with(), make_profile()).min_num_gpus == 0.0


def test_a_cuda_profile_without_the_card_size_recommends_nothing() -> None:
    profile = make_profile(device="cuda:0 (test card)")
    assert plan_from_profile(args_with(), profile).min_num_gpus is None


def test_the_gpu_share_holds_the_running_requests_and_no_less_would() -> None:
    card = 10 * GiB
    args = args_with(model={"device": "cuda"}, deployment={"num_gpus": 0.6})
    profile = make_profile(device="cuda:0 (test card)", capacity_bytes=int(0.6 * card),
                           held_bytes=GiB)
    plan = plan_from_profile(args, profile, card_bytes=card)
    running = plan.max_running_estimate
    assert running == int((0.6 * card - GiB - 50 * MiB) * 0.5) // P95_PRICE == 1267
    # held + reserve + running x price / safety = 1024 + 50 + 5068 = 6142 MiB of a 10240 MiB
    # card: 0.5998 of it, so 0.60; at 0.55 the budget would run only 1139 such requests.
    assert plan.min_num_gpus == 0.6
    for share, holds in ((0.60, True), (0.55, False)):
        budget = int((share * card - GiB - 50 * MiB) * 0.5)
        assert (budget // P95_PRICE >= running) is holds


def test_fewer_running_requests_need_a_smaller_share() -> None:
    args = args_with(model={"device": "cuda"}, deployment={"num_gpus": 0.6},
                     admission={"policy": "semaphore", "semaphore_permits": 100})
    profile = make_profile(device="cuda:0 (test card)", capacity_bytes=6 * GiB,
                           held_bytes=GiB)
    # 1024 + 50 + 100 x 2 MiB / 0.5 = 1474 MiB of 10240: 0.1439, so 0.15.
    assert plan_from_profile(args, profile, card_bytes=10 * GiB).min_num_gpus == 0.15


def test_the_gpu_share_also_holds_the_largest_request() -> None:
    args = args_with(model={"device": "cuda"}, deployment={"num_gpus": 0.5},
                     admission={"policy": "semaphore", "semaphore_permits": 1})
    profile = make_profile(device="cuda:0 (test card)", capacity_bytes=5 * GiB,
                           held_bytes=GiB)
    plan = plan_from_profile(args, profile, card_bytes=10 * GiB, min_budget_bytes=GiB)
    # 1 GiB + 50 MiB + 1 GiB / 0.5 = 3122 MiB of 10240: 0.3049, so 0.35.
    assert plan.min_num_gpus == 0.35


def test_gpu_share_with_a_fixed_budget_covers_that_budget() -> None:
    args = args_with(model={"device": "cuda"}, deployment={"num_gpus": 0.5},
                     memory={"budget_bytes": 2 * GiB})
    # held 1 GiB + reserve 50 MiB + budget 2 GiB (not scaled by the safety factor) of 10 GiB.
    assert gpu_share_for(100 * MiB, GiB, args, 10 * GiB) == 0.35


def test_gpu_share_may_exceed_one_card() -> None:
    args = args_with(model={"device": "cuda"}, deployment={"num_gpus": 1})
    # 1 GiB + 50 MiB + 10 GiB / 0.5 = 21.05 GiB of a 10 GiB card.
    assert gpu_share_for(10 * GiB, GiB, args, 10 * GiB) == 2.15


# --- completions and the fake engine ----------------------------------------------------------


def test_a_p95_completion_asks_for_the_most_new_tokens_allowed() -> None:
    args = parse_args({"model": {"task": "generate", "path": "/some/causal-lm"},
                       "limits": {"max_tokens": 64}})
    assert p95_request_shapes(args) == [(1, 128, 64)]
    fake = parse_args({"model": {"task": "fake"}, "limits": {"max_tokens": 64}})
    assert p95_request_shapes(fake) == [(8, 128, 0), (1, 128, 64)]


def test_the_p95_request_fits_the_models_context_and_what_does_not_is_named() -> None:
    fake = parse_args({"model": {"task": "fake"}, "fake": {"max_seq_tokens": 200},
                       "limits": {"max_input_tokens": 256, "max_tokens": 150},
                       "deployment": {"p95_input_tokens": 180}})
    engine = engine_class(fake)
    assert planning.model_context(fake, engine) == 200
    # embeddings: at most the context; a completion: its 150 new tokens and the 50 left.
    assert planning.p95_request_shapes(fake, engine.kinds, 200) == [(8, 180, 0), (1, 50, 150)]
    assert context_problems(fake.limits, engine.kinds, engine.planned_context(fake)) == [
        "limits.max_input_tokens (256) exceeds the model's context of 200 tokens "
        "(fake.max_seq_tokens): an input holds at most 200 tokens (more is refused with "
        "400, or cut with truncate)",
        "limits.max_input_tokens (256) + limits.max_tokens (150) exceed the model's context "
        "of 200 tokens (fake.max_seq_tokens): a prompt and its completion together hold at "
        "most 200 tokens (more is refused with 400)"]
    # The plan prices that request: a fake request costs 1 MiB per token of it.
    assert plan_deployment(fake).request_bytes == 8 * 180 * MiB
    longest = parse_args({"model": {"task": "fake"}, "fake": {"max_seq_tokens": 100},
                          "limits": {"max_tokens": 256}})
    assert planning.p95_request_shapes(longest, ("generate",), 100) == [(1, 1, 99)]
    fits = parse_args({"model": {"task": "fake"}})
    assert context_problems(fits.limits, ("embed", "generate"), (2048, "here")) == []


def test_a_generation_profile_prices_prompt_and_new_tokens(tmp_path: Path) -> None:
    model_dir = tmp_path / "lm"
    path = saved(tmp_path, make_profile(model_path=str(model_dir), task="generate"))
    plan = plan_deployment(args_with(path, model={"task": "generate", "path": str(model_dir)},
                                     limits={"max_tokens": 64}))
    assert plan.request_bytes == MiB + 1024 * 1 * (128 + 64)
    assert plan.max_running_estimate == 445644800 // plan.request_bytes


FAKE = {"device_capacity_bytes": 16 * GiB, "weights_bytes": GiB, "bytes_per_token": 1024,
        "bytes_per_request": 4096}


def test_the_fake_engine_is_planned_from_its_exact_costs() -> None:
    plan = plan_deployment(args_with(model={"task": "fake"}, fake=FAKE,
                                     deployment={"num_gpus": 0.5}))
    budget = int((8 * GiB - GiB - 50 * MiB) * 0.5)  # half the simulated card
    price = max(1024 * 8 * 128, 1024 * (128 + 256)) + 4096  # embeddings cost more here
    assert (plan.budget_bytes, plan.request_bytes) == (budget, price)
    assert plan.max_running_estimate == budget // price == 3545
    assert plan.how == "analytic estimate from fake.device_capacity_bytes x num_gpus"


def test_a_fake_engine_profile_is_used_for_the_fake_engine(tmp_path: Path) -> None:
    profile = make_profile(model_path="fake", task="fake")
    profile = MemoryProfile(**{**profile.__dict__, "device": "simulated (16.0 GiB)",
                               "method": "simulated device: allocations counted exactly"})
    path = saved(tmp_path, profile)
    plan = plan_deployment(args_with(path, model={"task": "fake"}, fake=FAKE))
    assert plan.how == f"measured profile {path}"
    assert plan.request_bytes == MiB + 1024 * 8 * 128  # the profile's model, not fake.*


def test_a_vllm_replica_on_cpu_is_planned_with_the_pool_it_will_ask_for(tmp_path: Path) -> None:
    """vLLM's CPU pool is at most what ``max_batch_size`` sequences of ``max_model_len``
    fill (128-token blocks), however much host memory the formula leaves; on a small share
    the formula's budget stands."""
    from deployments.engines.vllm_engine import VLLMEngine
    from tests.support import build_tiny_causal_lm

    model = build_tiny_causal_lm(tmp_path / "lm", hidden_size=128, num_heads=2)
    block_bytes = 128 * 2 * 2 * 2 * 64 * 4  # tokens x K,V x layers x KV heads x dim x fp32

    def plan(capacity_bytes: int) -> Any:
        return planning.plan_deployment(parse_args({
            "model": {"engine": "vllm", "path": str(model), "device": "cpu",
                      "dtype": "float32"},
            "memory": {"capacity_bytes": capacity_bytes, "reserve_bytes": 0,
                       "safety_factor": 1.0},
            "limits": {"max_input_tokens": 32, "max_tokens": 224},  # 256: 2 blocks
            "batching": {"max_batch_size": 4}}), VLLMEngine)

    assert plan(8 * GiB).budget_bytes == 4 * 2 * block_bytes
    _, weights_bytes = VLLMEngine.analytic_costs(parse_args({
        "model": {"engine": "vllm", "path": str(model), "device": "cpu",
                  "dtype": "float32"}}))
    assert plan(weights_bytes + 5 * block_bytes).budget_bytes == 5 * block_bytes
