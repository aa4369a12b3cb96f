"""A stream that waits for a place in the running batch (continuous batching, at most
``batching.max_batch_size`` sequences run) hears where it stands, as one that waits for
memory does (issue: "`: queued` comments are promised for every waiting stream"): its 200
starts at once with ``: queued position=N`` comments until its first token."""

from __future__ import annotations

import asyncio
import re

import httpx

from tests.support import MiB, fake_app_args

BODY = {"model": "fake", "prompt": "one two three", "max_tokens": 20, "stream": True}


async def test_a_stream_waiting_for_a_place_in_the_batch_hears_its_position(deploy):
    # One sequence runs at a time (max_batch_size 1), ~70 ms a token: the second waits
    # ~1.4 s for the first's 20 tokens, with memory to spare (budget 1 GiB).
    app = deploy(fake_app_args(
        fake={"latency_per_token_s": 0.07, "bytes_per_token": MiB},
        memory={"budget_bytes": 1024 * MiB},
        limits={"max_inputs": 1, "max_input_tokens": 16, "max_tokens": 20},
        batching={"continuous": True, "max_batch_size": 1}))
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:
        first = asyncio.ensure_future(http.post("/v1/completions",
                                                json={**BODY, "stream": False}))
        while (await http.get("/v1/status")).json()["replicas"][0]["kv_cache"][
                "running_sequences"] < 1:
            await asyncio.sleep(0.02)
        lines = []
        async with http.stream("POST", "/v1/completions", json=BODY) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                lines.append(line)
        assert (await first).status_code == 200
    queued = [line for line in lines if line.startswith(": queued")]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: {"))
    print(f"\nheard before the first token: {queued}")
    assert queued and all(re.fullmatch(r": queued position=0", line) for line in queued)
    assert all(lines.index(line) < first_data for line in queued)
    assert "data: [DONE]" in lines
    app.check_invariants()
