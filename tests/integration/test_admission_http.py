"""The byte-budget gate under concurrent HTTP load on a local Ray Serve."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support import measure_in_fresh_process

# Every request: 8 inputs of exactly 32 tokens ([CLS] + 30 words + [SEP]), all priced alike.
INPUTS_PER_REQUEST = 8
MAX_TOKENS = 32
ARGS = {
    "model": {"device": "cpu"},
    "limits": {"max_inputs": INPUTS_PER_REQUEST, "max_input_tokens": MAX_TOKENS},
    "admission": {"max_queue_len": 4, "max_queue_wait_s": 5},
}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A memory profile measured (in a fresh process, as a replica measures) and saved, so the
    replica reuses it and every request's price is known to the test: (profile path, price
    of one request in bytes)."""
    profile, _, _ = measure_in_fresh_process(ARGS)
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    profile.save(path)
    return path, profile.cost_model.request_bytes(INPUTS_PER_REQUEST, MAX_TOKENS)


@pytest.fixture(scope="module")
def app(deploy, profiled):
    path, price = profiled
    # A budget for about two requests at once (2.5 x the price of each).
    return deploy({**ARGS, "memory": {"profile_path": str(path),
                                      "budget_bytes": int(2.5 * price)}})


async def _burst(base_url: str, n: int) -> list[httpx.Response]:
    text = " ".join(["fox"] * (MAX_TOKENS - 2))
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=n)) as http:
        return await asyncio.gather(*(
            http.post("/v1/embeddings", json={"input": [text] * INPUTS_PER_REQUEST})
            for _ in range(n)))


async def test_32_concurrent_requests_get_200_or_503_with_retry_after(app, profiled):
    _, price = profiled
    responses = await _burst(app.base_url, 32)
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(ok) >= 2
    for r in refused:
        assert "retry-after" in r.headers, (r.headers, r.text)
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "overloaded"
        assert r.json()["error"]["code"] in {"queue_full", "queue_timeout"}
    for r in ok:
        assert len(r.json()["data"]) == INPUTS_PER_REQUEST
    print(f"\n32 concurrent requests: {len(ok)} x 200, {len(refused)} x 503")
    [replica] = app.check_invariants()
    assert replica["profile"]["reused"] is True, replica
    assert replica["budget_bytes"] == int(2.5 * price)
    # Never more than two requests' bytes leased at once, and at least two ran together.
    assert replica["peak_reserved_bytes"] == 2 * price, replica
