"""Several models in one app (``args.models``): how entries inherit the top-level sections,
what an entry may not set, and how their GPU shares pack onto whole cards."""

from __future__ import annotations

import pytest

from serve_app.app_config import parse_models
from serve_app.cli.plan import packing_lines
from serve_app.config import ConfigError
from serve_app.placement import cluster_cards, gpu_packing, packing_problem

THREE_HALVES = {
    "limits": {"max_input_tokens": 64, "max_tokens": 32},
    "deployment": {"num_gpus": 0.5},
    "models": [
        {"model": {"name": "embedder", "task": "fake"}},
        {"model": {"name": "chat", "task": "fake"}, "limits": {"max_tokens": 8}},
        {"model": {"name": "speech", "task": "fake"}, "deployment": {"num_replicas": 1}},
    ],
}


def _nodes(*gpus: float) -> list[dict]:
    return [{"Alive": True, "NodeManagerAddress": f"10.0.0.{i}", "Resources": {"GPU": g}}
            for i, g in enumerate(gpus)]


def test_an_app_of_one_model_needs_no_models_key() -> None:
    [args] = parse_models({"model": {"name": "solo", "task": "fake"}})
    assert args.model.name == "solo"


def test_entries_override_the_top_level_sections_key_by_key() -> None:
    embedder, chat, speech = parse_models(THREE_HALVES)
    assert [m.model.name for m in (embedder, chat, speech)] == ["embedder", "chat", "speech"]
    assert (chat.limits.max_tokens, chat.limits.max_input_tokens) == (8, 64)
    assert (embedder.limits.max_tokens, embedder.limits.max_input_tokens) == (32, 64)
    assert speech.deployment.num_gpus == 0.5 and speech.deployment.num_replicas == 1


def test_every_problem_of_every_entry_is_named_at_once() -> None:
    raw = {"models": [
        {"model": {"name": "a", "task": "fake"}, "limits": {"max_tokens": 0}},
        {"model": {"name": "b", "task": "fake"}, "auth": {"api_key": "k"},
         "deployment": {"ingress_replicas": 2, "ingress_max_queued_requests": 8}},
    ]}
    with pytest.raises(ConfigError) as caught:
        parse_models(raw)
    text = str(caught.value)
    assert "args.models[0].limits.max_tokens: Input should be greater than or equal to 1" \
        in text
    assert "args.models[1].auth: app-wide, set it at the top level of args" in text
    assert "args.models[1].deployment.ingress_replicas: the ingress's" in text
    assert "args.models[1].deployment.ingress_max_queued_requests: the ingress's" in text


def test_the_proxys_queue_for_the_ingress_is_bounded_by_default() -> None:
    # Ray's own default (-1) is unbounded: a flood would wait at the proxy past every deadline
    [args] = parse_models({"model": {"name": "solo", "task": "fake"}})
    assert (args.deployment.ingress_max_queued_requests,
            args.deployment.ingress_retry_after_s) == (256, 1.0)
    with pytest.raises(ConfigError, match="ingress_max_queued_requests: Input should be "
                                          "greater than or equal to 1"):
        parse_models({"model": {"name": "solo", "task": "fake"},
                      "deployment": {"ingress_max_queued_requests": -1}})


def test_two_models_of_one_name_are_refused() -> None:
    raw = {"models": [{"model": {"name": "x", "task": "fake"}},
                      {"model": {"name": "x", "task": "embed"}}]}
    with pytest.raises(ConfigError, match="two models are named 'x'"):
        parse_models(raw)


@pytest.mark.parametrize("models", [[], "chat", [["not a mapping"]]])
def test_models_must_be_a_list_of_mappings(models) -> None:
    with pytest.raises(ConfigError, match=r"args\.models"):
        parse_models({"models": models})


def test_three_half_gpu_models_pack_onto_two_cards() -> None:
    models = parse_models(THREE_HALVES)
    cards, left = gpu_packing(models)
    assert cards == [[("embedder", 0.5), ("chat", 0.5)], [("speech", 0.5)]] and left == []
    assert packing_problem(models, cluster_cards(_nodes(2))) is None
    assert cluster_cards(_nodes(1, 1)) == 2  # a card on each of two nodes
    problem = packing_problem(models, cluster_cards(_nodes(1)))
    assert problem is not None and "need 2 GPUs" in problem and "has 1" in problem
    assert "left over: speech (0.5)" in problem
    assert packing_lines(models) == [
        "  GPUs needed:          2   (each replica's num_gpus is a share of one card)",
        "    GPU 0: embedder (0.5), chat (0.5)   (1 of 1)",
        "    GPU 1: speech (0.5)   (0.5 of 1)"]


def test_shares_larger_than_half_do_not_share_a_card_and_cpu_models_take_none() -> None:
    raw = {"models": [
        {"model": {"name": "big", "task": "fake"}, "deployment": {"num_gpus": 0.6,
                                                                  "num_replicas": 2}},
        {"model": {"name": "small", "task": "fake"}, "deployment": {"num_gpus": 0.4}},
        {"model": {"name": "cpu", "task": "fake"}},
    ]}
    cards, _ = gpu_packing(parse_models(raw))
    assert cards == [[("big", 0.6), ("small", 0.4)], [("big", 0.6)]]
    waiting = {**raw, "deployment": {"wait_for_gpus": True}}
    assert packing_problem(parse_models(waiting), cluster_cards(_nodes())) is None
