"""Idempotency-Key across two ingress replicas and two model replicas: one inference for ten
concurrent duplicates, identical bodies, replays, and 422 for a reused key."""

from __future__ import annotations

import asyncio

import httpx
import pytest


@pytest.fixture(scope="module")
def app(deploy):
    return deploy({"model": {"task": "fake", "name": "fake"},
                   "fake": {"latency_per_token_s": 0.02},
                   "limits": {"max_inputs": 2, "max_input_tokens": 32, "max_tokens": 8},
                   "deployment": {"num_replicas": 2, "ingress_replicas": 2, "num_cpus": 0}})


def total_inferences(app) -> int:
    return sum(r["inferences_total"] for r in app.check_invariants())


async def test_ten_concurrent_duplicates_run_once_and_get_the_same_body(app):
    before = total_inferences(app)
    headers = {"Idempotency-Key": "order-42"}
    body = {"prompt": "a b c", "max_tokens": 8, "temperature": 0.9}  # sampled: runs differ
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:
        responses = await asyncio.gather(*(
            http.post("/v1/completions", json=body, headers=headers) for _ in range(10)))
        late = await http.post("/v1/completions", json=body, headers=headers)
        reused = await http.post("/v1/completions", json={**body, "max_tokens": 7},
                                 headers=headers)
    assert [r.status_code for r in responses] == [200] * 10
    assert len({r.text for r in responses + [late]}) == 1
    assert late.headers["idempotent-replayed"] == "true"
    assert reused.status_code == 422
    assert reused.json()["error"]["code"] == "idempotency_key_reused"
    assert total_inferences(app) - before == 1


def test_a_malformed_key_is_400(app):
    response = httpx.post(f"{app.base_url}/v1/embeddings", json={"input": "a"},
                          headers={"Idempotency-Key": "has space"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "idempotency_key"
