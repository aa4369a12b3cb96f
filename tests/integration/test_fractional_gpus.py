"""Replicas holding half a (declared) GPU each budget only their half of the card."""

from __future__ import annotations

import collections

import httpx
import pytest

CARD_BYTES = 16 << 30


@pytest.fixture(scope="module")
def app(deploy):
    # The session's Ray declares 2 GPUs: four replicas of 0.5 fill both cards.
    return deploy({
        "model": {"task": "fake", "name": "fake"},
        "fake": {"device_capacity_bytes": CARD_BYTES, "weights_bytes": 1 << 30,
                 "latency_per_token_s": 0.0},
        "limits": {"max_inputs": 4, "max_input_tokens": 64, "max_tokens": 16},
        "deployment": {"num_replicas": 4, "num_gpus": 0.5, "num_cpus": 0},
    })


def test_each_replica_budgets_half_a_card_and_no_card_is_overcommitted(app):
    replicas = app.check_invariants()
    assert len(replicas) == 4
    for replica in replicas:
        assert replica["num_gpus"] == 0.5 and len(replica["gpu_ids"]) == 1
        assert replica["capacity_bytes"] == CARD_BYTES // 2
        assert replica["budget_bytes"] <= CARD_BYTES // 2 - replica["held_bytes"]
    per_card = collections.defaultdict(int)
    for replica in replicas:
        per_card[replica["gpu_ids"][0]] += replica["budget_bytes"] + replica["held_bytes"]
    for replica in sorted(replicas, key=lambda r: r["gpu_ids"][0]):
        print(f"\nGPU {replica['gpu_ids'][0]}: capacity {replica['capacity_bytes']} held "
              f"{replica['held_bytes']} budget {replica['budget_bytes']} bytes")
    print(f"held + budget per card: {dict(per_card)} (card {CARD_BYTES})")
    assert len(per_card) == 2
    assert all(total <= CARD_BYTES for total in per_card.values())


def test_requests_are_served_by_the_fake_engine(app):
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        embedded = http.post("/v1/embeddings", json={"input": ["a b c", "d e"]})
        completed = http.post("/v1/completions",
                              json={"prompt": "a b c", "max_tokens": 5, "temperature": 0})
    assert embedded.status_code == 200 and len(embedded.json()["data"]) == 2
    assert completed.status_code == 200
    assert len(completed.json()["choices"][0]["text"].split()) == 5
    app.check_invariants()
