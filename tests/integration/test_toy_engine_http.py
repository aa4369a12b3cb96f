"""The engine written from docs/engines.md (tests/engines/toy_engine.py) served through
``build_app`` by ``model.engine`` alone: 200s, 503s with ``Retry-After`` under a concurrent
burst beyond its byte budget, nothing leased afterwards, and its shape axes in
``/v1/status``. No product file knows it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.engines.toy_engine import WIDTH
from tests.support import measure_in_fresh_process

TEXTS, WORDS = 8, 64  # every request: 8 texts of exactly 64 tokens (62 words + begin, end)
ARGS = {
    "model": {"engine": "tests.engines.toy_engine:ToyEngine", "name": "toy", "device": "cpu"},
    "limits": {"max_inputs": TEXTS, "max_input_tokens": WORDS},
    "admission": {"max_queue_len": 4, "max_queue_wait_s": 5},
}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The toy's profile, measured in a fresh process and saved (the replica reuses it, so
    every request's price is known here): (path, one request's price in bytes)."""
    profile, _, _ = measure_in_fresh_process(ARGS)
    path = tmp_path_factory.mktemp("profile") / "toy.json"
    profile.save(path)
    return path, profile.cost_model.request_bytes(TEXTS, WORDS)


@pytest.fixture(scope="module")
def app(deploy, profiled):
    path, price = profiled
    return deploy({**ARGS, "memory": {"profile_path": str(path),
                                      "budget_bytes": int(2.5 * price)}})


async def _burst(base_url: str, n: int) -> list[httpx.Response]:
    text = " ".join(["word"] * (WORDS - 2))
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=n)) as http:
        return await asyncio.gather(*(
            http.post("/v1/embeddings", json={"input": [text] * TEXTS}) for _ in range(n)))


async def test_a_burst_gets_200s_and_503s_with_retry_after_and_leaves_nothing_leased(
        app, profiled) -> None:
    _, price = profiled
    responses = await _burst(app.base_url, 32)
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(ok) >= 2 and refused, statuses
    for r in ok:
        assert [len(d["embedding"]) for d in r.json()["data"]] == [WIDTH] * TEXTS
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1, r.headers
        assert r.json()["error"]["type"] == "overloaded"
    print(f"\n32 concurrent toy requests: {len(ok)} x 200, {len(refused)} x 503")
    [replica] = app.check_invariants()  # nothing reserved, queued or leased
    assert replica["profile"]["reused"] is True
    assert replica["profile"]["shape_axes"] == ["texts", "words", "unused"]
    assert "toy_texts_word_pairs" in replica["cost_model"]["features"]
    assert price <= replica["peak_reserved_bytes"] <= replica["budget_bytes"]
