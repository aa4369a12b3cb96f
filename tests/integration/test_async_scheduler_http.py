"""An engine that schedules itself (tests/engines/async_engine.py, an ``AsyncScheduler``) served
through ``build_app`` by ``model.engine`` alone, behind the same byte gate: 50 concurrent
streamed completions, 20 of whose clients leave after their first piece; the others get their
whole text (or a 503 with ``Retry-After``); afterwards nothing is leased, queued or reserved,
and the engine never held more at once than the budget allows."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from deployments.engines.words import VOCAB
from tests.support import measure_in_fresh_process

MAX_TOKENS = 24
ARGS = {
    "model": {"engine": "tests.engines.async_engine:TickingScheduler", "name": "ticking",
              "device": "cpu"},
    "limits": {"max_input_tokens": 16, "max_tokens": MAX_TOKENS},
    "admission": {"max_queue_len": 64, "max_queue_wait_s": 20},
}
PROMPT = "one two three"
EXPECTED = "".join(f" {VOCAB[n % len(VOCAB)]}" for n in range(1, MAX_TOKENS + 1))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The engine's profile, measured in a fresh process and saved: (path, the largest
    request's price in bytes), what the budget is sized by (the replica may profile again:
    the engine holds no weights, so its held bytes are RSS noise a saved profile is checked
    against)."""
    profile, max_request_bytes, _ = measure_in_fresh_process(ARGS)
    path = tmp_path_factory.mktemp("profile") / "ticking.json"
    profile.save(path)
    return path, max_request_bytes


@pytest.fixture(scope="module")
def app(deploy, profiled):
    path, price = profiled
    return deploy({**ARGS, "memory": {"profile_path": str(path), "budget_bytes": 8 * price}})


async def _one(http: httpx.AsyncClient, leaves: bool) -> tuple[int, str]:
    body = {"model": "ticking", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, response.headers.get("retry-after", "")
        text = []
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            if leaves and text[-1]:
                return -1, ""  # the client leaves: the stream is closed here
        return 200, "".join(text)


async def test_fifty_streams_twenty_leaving_through_the_gate_leave_nothing_leased(app) -> None:
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=50)) as http:
        ends = await asyncio.gather(*(_one(http, i % 5 < 2) for i in range(50)))
    statuses = [status for status, _ in ends]
    assert statuses.count(-1) + statuses.count(503) + statuses.count(200) == 50, statuses
    assert statuses.count(200) >= 8, statuses
    assert [text for status, text in ends if status == 200] == \
        [EXPECTED] * statuses.count(200)
    assert all(int(after) >= 1 for status, after in ends if status == 503)
    print(f"\n50 streams on a self-scheduling engine: {statuses.count(200)} x 200, "
          f"{statuses.count(-1)} left, {statuses.count(503)} x 503")
    [replica] = app.check_invariants()  # nothing reserved, queued or leased
    assert 0 < replica["peak_reserved_bytes"] <= replica["budget_bytes"]
    assert replica["kinds"] == ["generate"]
