"""Across replicas: the budget-aware router spreads a burst and never makes a replica run more
than its budget, even on stale routing stats; the queue autoscaler grows a deployment under a
burst and shrinks it when idle, with no 500 and no lost request."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx

from tests.support import MiB, fake_app_args

BURST_DEADLINE_S = 120.0


def _replicas(base_url: str) -> list[dict]:
    return httpx.get(f"{base_url}/v1/status", timeout=10).json()["replicas"]


async def _burst(base_url: str, clients: int, seconds: float, rng: random.Random,
                 stop: asyncio.Event | None = None) -> Counter:
    """``clients`` concurrent clients sending mixed sizes for ``seconds`` (or until ``stop``
    is set); a 503 waits its ``Retry-After`` (capped at 1 s) and retries, as a well-behaved
    client does."""
    outcomes: Counter = Counter()
    stop_at = time.monotonic() + seconds
    stop = stop or asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                 limits=httpx.Limits(max_connections=clients)) as http:

        async def client() -> None:
            while time.monotonic() < stop_at and not stop.is_set():
                body = {"input": [" ".join(["w"] * rng.randint(1, 14))
                                  for _ in range(rng.randint(1, 4))]}
                response = await http.post("/v1/embeddings", json=body)
                outcomes[response.status_code] += 1
                assert response.status_code != 400, (body, response.text)
                if response.status_code == 503:
                    assert int(response.headers["retry-after"]) >= 1
                    await asyncio.sleep(1)

        await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


async def test_stale_routing_stats_never_overrun_a_budget(deploy):
    # Stats refreshed every 60 s: after the first report the router works on stale figures
    # (and its own optimistic reservations); each replica's gate must still hold.
    budget = 2 * 4 * 16 * MiB + 2  # two of the largest requests (4 inputs x 16 tokens)
    app = deploy(fake_app_args(
        fake={"latency_per_token_s": 0.002, "bytes_per_token": MiB},
        memory={"budget_bytes": budget},
        limits={"max_inputs": 4, "max_input_tokens": 16, "max_tokens": 4},
        deployment={"num_replicas": 2, "routing_stats_period_s": 60},
        admission={"max_queue_len": 8, "max_queue_wait_s": 3}))
    outcomes = await _burst(app.base_url, 24, 6.0, random.Random(5))
    print(f"\nburst on stale stats: {dict(outcomes)}")
    assert set(outcomes) <= {200, 503} and outcomes[200] > 20
    replicas = app.check_invariants()
    assert len(replicas) == 2
    for replica in replicas:
        assert 0 < replica["peak_reserved_bytes"] <= replica["measured_budget_bytes"] == budget
        assert replica["inferences_total"] > 0  # the burst was spread over both


async def test_a_burst_scales_one_replica_to_three_and_idle_brings_it_back(deploy):
    app = deploy(fake_app_args(
        fake={"latency_per_token_s": 0.004, "bytes_per_token": MiB},
        memory={"budget_bytes": 2 * 4 * 16 * MiB + 2},
        limits={"max_inputs": 4, "max_input_tokens": 16, "max_tokens": 4},
        deployment={"num_replicas": 1, "min_replicas": 1, "max_replicas": 3,
                    "upscale_delay_s": 1, "downscale_delay_s": 4,
                    "autoscaling_metrics_interval_s": 0.5, "autoscaling_look_back_s": 2},
        admission={"max_queue_len": 16, "max_queue_wait_s": 5}))
    assert len(_replicas(app.base_url)) == 1
    started = time.monotonic()
    # The burst lasts until the third replica serves (starting one takes tens of seconds on
    # a loaded 2-core machine), at most BURST_DEADLINE_S.
    scaled_up = asyncio.Event()
    burst = asyncio.create_task(_burst(app.base_url, 40, BURST_DEADLINE_S, random.Random(9),
                                       scaled_up))
    peak, scaled_up_s = 1, None
    while not burst.done():
        await asyncio.sleep(0.5)
        count = len(await asyncio.to_thread(_replicas, app.base_url))
        if count > peak:
            peak = count
        if count == 3 and scaled_up_s is None:
            scaled_up_s = time.monotonic() - started
            scaled_up.set()
    outcomes = await burst
    idle_from = time.monotonic()
    while len(_replicas(app.base_url)) > 1 and time.monotonic() - idle_from < 90:
        await asyncio.sleep(1)
    scaled_down_s = time.monotonic() - idle_from
    print(f"\nautoscaling burst: {dict(outcomes)}; 3 replicas after {scaled_up_s} s; "
          f"back to 1 after {scaled_down_s:.1f} s idle")
    assert peak == 3 and scaled_up_s is not None
    assert set(outcomes) <= {200, 503}  # no 500, and every request answered (none lost)
    assert outcomes[200] > 0
    [last] = app.check_invariants()
    assert last["reserved_bytes"] == 0
