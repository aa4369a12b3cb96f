"""Replicas removed under load (a redeploy from two model replicas to one) drain: running work
finishes, queued work is admitted or refused with 503, nothing is lost and no other 5xx."""

from __future__ import annotations

import asyncio
import time

import httpx
from ray import serve

from serve_app.app import build_app
from tests.support import MiB, fake_app_args, wait_until_ready


def _args(num_replicas: int) -> dict:
    return fake_app_args(
        fake={"latency_per_token_s": 0.005, "bytes_per_token": MiB},
        memory={"budget_bytes": 64 * MiB},
        limits={"max_inputs": 1, "max_input_tokens": 32, "max_tokens": 16},
        deployment={"num_replicas": num_replicas},
        admission={"max_queue_len": 8, "max_queue_wait_s": 3, "inference_timeout_s": 10})


async def test_replicas_removed_under_load_drain_without_losing_requests(deploy):
    app = deploy(_args(2))
    old_ids = {r["replica_id"] for r in app.check_invariants()}
    assert len(old_ids) == 2
    outcomes: dict[str, int] = {}
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:

        async def client(i: int) -> None:
            while not stop.is_set():
                response = await http.post("/v1/embeddings",
                                           json={"input": " ".join(["w"] * (10 + i))})
                key = str(response.status_code)
                if response.status_code != 200:
                    key += f" {response.json()['error']['code']}"
                outcomes[key] = outcomes.get(key, 0) + 1
                if response.status_code == 503:  # a well-behaved client waits as told
                    await asyncio.sleep(int(response.headers["retry-after"]))

        # Fewer clients than one replica can hold (running + admission.max_queue_len).
        clients = [asyncio.create_task(client(i)) for i in range(6)]
        await asyncio.sleep(2)  # steady load on both replicas
        started = time.monotonic()
        await asyncio.to_thread(serve.run, build_app(_args(1)), name=app.name,
                                route_prefix="/", blocking=False)
        redeploy_s = time.monotonic() - started
        await asyncio.sleep(2)  # load on the new replica
        stop.set()
        await asyncio.gather(*clients)  # every request got an answer: none lost or hung
    wait_until_ready(app.base_url)
    print(f"\nredeploy 2 -> 1 replicas under load took {redeploy_s:.1f} s: {outcomes}")
    assert outcomes.get("200", 0) > 50
    assert sum(n for k, n in outcomes.items() if k != "200") <= 12  # at most 2 per client
    assert set(outcomes) <= {"200", "503 draining", "503 queue_full", "503 queue_timeout",
                             "503 no_replicas"}, outcomes
    replicas = app.check_invariants()
    assert len(replicas) == 1 and replicas[0]["replica_id"] not in old_ids
