"""Many clients that go away at random moments (queued, running, or just arriving) leave
nothing behind: no lease, no waiter, bytes charged == bytes released."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.support import MiB, fake_app_args


@pytest.fixture(scope="module")
def app(deploy):
    # 10 ms per token, 1 MiB per token, a budget for about three requests at once.
    return deploy(fake_app_args(
        fake={"latency_per_token_s": 0.01, "bytes_per_token": MiB},
        memory={"budget_bytes": 64 * MiB},
        limits={"max_inputs": 1, "max_input_tokens": 32, "max_tokens": 16},
        admission={"max_queue_len": 64, "max_queue_wait_s": 5}))


async def test_a_thousand_random_aborts_leave_nothing_behind(app):
    rng = random.Random(7)
    outcomes: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30,
                                 limits=httpx.Limits(max_connections=200)) as http:

        async def one() -> None:
            words = " ".join(["w"] * rng.randint(1, 18))
            call = asyncio.create_task(http.post("/v1/embeddings", json={"input": words}))
            await asyncio.sleep(rng.uniform(0, 2.0))  # the moment the client gives up
            if call.done():
                key = str(call.result().status_code)
            else:
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
                key = "aborted"
            outcomes[key] = outcomes.get(key, 0) + 1

        for _ in range(5):  # 5 rounds of 200 concurrent clients
            await asyncio.gather(*(one() for _ in range(200)))
    print(f"\n1000 clients: {outcomes}")
    assert sum(outcomes.values()) == 1000
    assert set(outcomes) <= {"200", "503", "aborted"}
    assert outcomes.get("aborted", 0) > 100 and outcomes.get("200", 0) > 10
    [replica] = app.check_invariants()
    assert replica["charged_bytes_total"] == replica["released_bytes_total"]
