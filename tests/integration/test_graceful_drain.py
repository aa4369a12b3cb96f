"""Replicas removed under load (a redeploy from two model replicas to one) drain: running work
finishes, queued work is admitted or refused with 503, nothing is lost and no other 5xx. With
``deployment.max_surge_percent`` the old replicas serve until the new one is ready: no 503.

The phases are counted in answers, not seconds, so a slow machine runs the same test."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from ray import serve

from serve_app.app import build_app
from tests.support import MiB, fake_app_args, wait_until_ready

CLIENTS = 6  # fewer than one replica can hold (running + admission.max_queue_len)
ANSWERS_PER_PHASE = 30  # 200s before the redeploy, and again after it
PHASE_DEADLINE_S = 120.0  # a phase that never gets its answers fails the test, not CI


def _args(num_replicas: int, max_surge_percent: int, jobs_dir: str) -> dict[str, Any]:
    return fake_app_args(
        fake={"latency_per_token_s": 0.005, "bytes_per_token": MiB},
        memory={"budget_bytes": 64 * MiB},
        limits={"max_inputs": 1, "max_input_tokens": 32, "max_tokens": 16},
        deployment={"num_replicas": num_replicas, "max_surge_percent": max_surge_percent},
        admission={"max_queue_len": 8, "max_queue_wait_s": 3, "inference_timeout_s": 10},
        jobs={"data_dir": jobs_dir})


async def _until(outcomes: Counter, answers: int) -> None:
    deadline = time.monotonic() + PHASE_DEADLINE_S
    while outcomes["200"] < answers:
        assert time.monotonic() < deadline, f"no {answers} answers in time: {outcomes}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("max_surge_percent", [0, 100])
async def test_replicas_removed_under_load_drain_without_losing_requests(
        deploy, tmp_path, max_surge_percent: int):
    app = deploy(_args(2, max_surge_percent, str(tmp_path)))
    old_ids = {r["replica_id"] for r in app.check_invariants()}
    assert len(old_ids) == 2
    outcomes: Counter = Counter()
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:

        async def client(i: int) -> None:
            while not stop.is_set():
                response = await http.post("/v1/embeddings",
                                           json={"input": " ".join(["w"] * (10 + i))})
                key = str(response.status_code)
                if response.status_code != 200:
                    key += f" {response.json()['error']['code']}"
                outcomes[key] += 1
                if response.status_code == 503:  # a well-behaved client waits as told
                    await asyncio.sleep(float(response.headers["retry-after-ms"]) / 1000)

        clients = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
        try:
            await _until(outcomes, ANSWERS_PER_PHASE)  # steady load on both replicas
            started = time.monotonic()
            await asyncio.to_thread(serve.run, build_app(_args(1, max_surge_percent,
                                                               str(tmp_path))),
                                    name=app.name, route_prefix="/", blocking=False)
            redeploy_s = time.monotonic() - started
            await _until(outcomes, outcomes["200"] + ANSWERS_PER_PHASE)  # the new replica
        finally:
            stop.set()
            await asyncio.gather(*clients)  # every request got an answer: none lost or hung
    wait_until_ready(app.base_url)
    print(f"\nredeploy 2 -> 1 replicas (max_surge_percent {max_surge_percent}) under load "
          f"took {redeploy_s:.1f} s: {dict(outcomes)}")
    refused = sum(n for k, n in outcomes.items() if k != "200")
    if max_surge_percent:
        assert refused == 0, outcomes  # the old replicas served until the new one was ready
    else:
        assert refused <= 2 * CLIENTS, outcomes
    assert set(outcomes) <= {"200", "503 draining", "503 queue_full", "503 queue_timeout",
                             "503 no_replicas"}, outcomes
    replicas = app.check_invariants()
    assert len(replicas) == 1 and replicas[0]["replica_id"] not in old_ids
