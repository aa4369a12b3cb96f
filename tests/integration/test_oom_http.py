"""An injected OOM storm: the replica keeps serving, answers each OOM with 503 ``oom``, shrinks
its budget and regrows it (fake engine, 20 % of inferences fail)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest


@pytest.fixture(scope="module")
def app(deploy):
    return deploy({
        "model": {"task": "fake", "name": "fake"},
        "fake": {"oom_probability": 0.2, "fault_seed": 3, "latency_per_token_s": 0.001},
        "limits": {"max_inputs": 2, "max_input_tokens": 32, "max_tokens": 16},
        "admission": {"oom_quiet_s": 1.0, "oom_regrow_fraction": 0.5},
        # One request per forward pass, so that one injected OOM refuses exactly one request
        # (a batched pass that OOMs refuses all its members, each with 503 oom).
        "batching": {"enabled": False},
    })


async def test_an_oom_storm_leaves_the_replica_serving(app):
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:
        before = (await http.get("/v1/status")).json()["replicas"][0]
        responses = []
        for _ in range(10):  # 10 rounds of 10 concurrent requests
            responses += await asyncio.gather(*(
                http.post("/v1/embeddings", json={"input": ["a b c d"]}) for _ in range(10)))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(refused) == 100
    assert 5 <= len(refused) <= 40  # about 20 % of 100
    for response in refused:
        assert response.json()["error"]["code"] == "oom"
        assert int(response.headers["retry-after"]) >= 1
    [after] = app.check_invariants()
    assert after["replica_id"] == before["replica_id"]  # no restart
    assert after["oom_count"] == len(refused)  # every non-OOM request was answered 200
    assert after["budget_shrink_count"] == len(refused)
    # Injected OOMs asked for exactly the priced bytes: the cost model stays as measured, and
    # the canary after each OOM found finite output.
    assert after["cost_correction_factor"] == 1.0 and after["device_fault"] is None
    # Regrowth: one step of half the measured budget per quiet second, back to the full figure.
    deadline = time.monotonic() + 15
    state = after
    while time.monotonic() < deadline and state["budget_bytes"] < state["measured_budget_bytes"]:
        await asyncio.sleep(0.5)
        state = httpx.get(f"{app.base_url}/v1/status").json()["replicas"][0]
    assert state["budget_bytes"] == state["measured_budget_bytes"]
    assert state["budget_regrow_count"] >= 1
