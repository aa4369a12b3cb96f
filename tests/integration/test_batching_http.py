"""Dynamic batching on the fake engine: concurrent requests share forward passes, each pass
fits the leases of its members (the simulated device never holds more than was leased), and
batching off runs one pass per request. Requests of 3-14 tokens are priced at 16
(``batching.pad_to_multiple_of``), so they can share passes."""

from __future__ import annotations

import asyncio

import httpx

from tests.support import MiB, fake_app_args, scrape, total


def _args(enabled: bool) -> dict:
    return fake_app_args(
        # 10 ms per token: the inference thread, not the HTTP path, is the bottleneck, so
        # requests wait for it and batches form.
        fake={"latency_per_token_s": 0.01, "bytes_per_token": MiB},
        memory={"budget_bytes": 256 * MiB},
        limits={"max_inputs": 4, "max_input_tokens": 32, "max_tokens": 4},
        batching={"enabled": enabled, "max_batch_size": 16, "max_wait_ms": 5},
        admission={"max_queue_len": 64, "max_queue_wait_s": 10})


async def _send(base_url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                 limits=httpx.Limits(max_connections=n)) as http:
        return await asyncio.gather(*(
            http.post("/v1/embeddings", json={"input": [" ".join(["w"] * (1 + i % 12))]})
            for i in range(n)))


async def test_concurrent_requests_share_forward_passes_within_their_leases(deploy):
    app = deploy(_args(enabled=True))
    before = scrape(app.base_url)
    responses = await _send(app.base_url, 48)
    assert [r.status_code for r in responses] == [200] * 48
    vectors = [r.json()["data"][0]["embedding"] for r in responses]
    # Batched or not, a text gets its own vector (the fake engine seeds it by the text).
    assert vectors[0] == vectors[12] and vectors[0] != vectors[1]
    [replica] = app.check_invariants()
    print(f"\n48 requests ran as {replica['inferences_total']} forward passes")
    assert replica["inferences_total"] <= 24  # batches formed: 2+ requests per pass
    after = scrape(app.base_url)
    ratios = total(after, "vramgate_request_measured_over_estimated_count") - total(
        before, "vramgate_request_measured_over_estimated_count")
    within = total(after, "vramgate_request_measured_over_estimated_bucket", le="1.0") - total(
        before, "vramgate_request_measured_over_estimated_bucket", le="1.0")
    assert ratios == replica["inferences_total"] and within == ratios  # pass <= its leases
    assert replica["peak_reserved_bytes"] <= replica["budget_bytes"]


async def test_batching_off_runs_one_pass_per_request(deploy):
    app = deploy(_args(enabled=False))
    responses = await _send(app.base_url, 16)
    assert [r.status_code for r in responses] == [200] * 16
    [replica] = app.check_invariants()
    assert replica["inferences_total"] == 16
