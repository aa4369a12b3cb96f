"""Leases survive the unhappy paths: inference timeouts and clients that go away."""

from __future__ import annotations

import asyncio

import httpx
import pytest

MiB = 1 << 20


@pytest.fixture(scope="module")
def app(deploy):
    # 40 MiB + 1 MiB per token and 40 ms per token: a budget of 110 MiB runs one request at
    # a time; 1 s to infer.
    return deploy({
        "model": {"task": "fake", "name": "fake"},
        "fake": {"bytes_per_token": MiB, "bytes_per_request": 40 * MiB,
                 "latency_per_token_s": 0.04},
        "memory": {"budget_bytes": 110 * MiB},
        "limits": {"max_inputs": 1, "max_input_tokens": 64, "max_tokens": 32},
        "admission": {"max_queue_len": 16, "max_queue_wait_s": 30, "inference_timeout_s": 1.0},
    })


def words(n: int) -> str:
    return " ".join(["w"] * n)  # n + 2 tokens


async def _status(http: httpx.AsyncClient) -> dict:
    return (await http.get("/v1/status")).json()["replicas"][0]


async def test_a_timed_out_inference_keeps_its_lease_until_the_thread_returns(app):
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
        # (32 prompt + 30 new) tokens x 40 ms = 2.5 s > the 1 s limit; leased 40 MiB +
        # (32 + 32) MiB = 104 MiB (a batchable completion's max_tokens is priced padded to
        # batching.pad_to_multiple_of, 16)
        slow = await http.post("/v1/completions",
                               json={"prompt": words(30), "max_tokens": 30, "temperature": 0})
        assert slow.status_code == 504, slow.text
        assert slow.json()["error"] == {"message": "inference ran longer than 1 s",
                                        "type": "timeout", "code": "inference_timeout"}
        held = None
        for _ in range(40):  # bounded: the replica publishes its state about once a second
            state = await _status(http)
            if state["inferences_running"] == 1:
                held = state
                break
            await asyncio.sleep(0.1)
        # Seen after the 504, before the thread finished: its bytes are still leased.
        assert held is not None, "the timed-out inference was not seen still running"
        assert abs(held["reserved_bytes"] - 104 * MiB) <= 1  # the fit rounds up
    app.check_invariants()


async def test_queued_requests_whose_clients_leave_are_withdrawn(app):
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
        running = asyncio.create_task(http.post(
            "/v1/embeddings", json={"input": words(8)}))  # 10 tokens: 0.4 s, 50 MiB
        await asyncio.sleep(0.2)  # (not a clock: lets the first request reach the model)
        leavers = [asyncio.create_task(http.post("/v1/embeddings", json={"input": words(20)}))
                   for _ in range(8)]  # 62 MiB each: they wait behind the first
        queued = 0
        for _ in range(40):
            queued = (await _status(http))["queue_depth"]
            if queued:
                break
            await asyncio.sleep(0.05)
        for task in leavers:  # the clients disconnect while their requests wait
            task.cancel()
        await asyncio.gather(*leavers, return_exceptions=True)
        first = await running
        assert first.status_code == 200, first.text
        after = await http.post("/v1/embeddings", json={"input": words(4)})  # 46 MiB
        assert after.status_code == 200
        # It was admitted at once: the abandoned requests did not run before it.
        assert after.headers["x-queue-position"] == "0"
    assert queued >= 1
    [replica] = app.check_invariants()
    assert replica["charged_bytes_total"] == replica["released_bytes_total"]
