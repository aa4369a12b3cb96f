"""Routing benchmark: a mixed-size request stream over four model replicas on simulated
devices (fake engine), with the budget-aware router vs Ray Serve's default power-of-two-
choices router, at the same derived ``max_ongoing_requests``. Loopback only; bounded; prints
one table row per router: requests, 200s, 503s, OOMs, other statuses, throughput, p50/p99.

    python -m benchmarks.routing [--seconds 20] [--clients 48]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter

import httpx
import ray
from ray import serve

from serve_app.app import build_app
from tests.support import MiB, fake_app_args, free_port, settled_status, wait_until_ready

SIZES_SEED = 17


def app_args(router: str) -> dict:
    """Four replicas on halves of two simulated 1 GiB cards (budget 0.9 x (512 - 64) MiB =
    403 MiB each); requests of 1-8 inputs x 4-48 tokens at 1 MiB per token: 4-384 MiB."""
    return fake_app_args(
        fake={"device_capacity_bytes": 1024 * MiB, "weights_bytes": 64 * MiB,
              "bytes_per_token": MiB, "latency_per_token_s": 0.003},
        memory={"reserve_bytes": 0, "safety_factor": 0.9},
        limits={"max_inputs": 8, "max_input_tokens": 48, "max_tokens": 1},
        deployment={"num_replicas": 4, "num_gpus": 0.5, "num_cpus": 0.5,
                    "request_router": router},
        admission={"max_queue_len": 16, "max_queue_wait_s": 5})


async def stream(base_url: str, seconds: float, clients: int) -> tuple[Counter, list[float]]:
    rng = random.Random(SIZES_SEED)
    outcomes: Counter = Counter()
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                 limits=httpx.Limits(max_connections=clients)) as http:

        async def client() -> None:
            while time.monotonic() < stop_at:
                words = rng.choice([2, 4, 8, 24, 46])  # mostly small, some large
                body = {"input": [" ".join(["w"] * words)] * rng.randint(1, 8)}
                started = time.monotonic()
                response = await http.post("/v1/embeddings", json=body)
                outcomes[response.status_code] += 1
                if response.status_code == 200:
                    latencies.append(time.monotonic() - started)
                else:
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes, latencies


def run(router: str, base_url: str, seconds: float, clients: int) -> dict:
    serve.run(build_app(app_args(router)), name="vramgate", route_prefix="/", blocking=False)
    wait_until_ready(base_url)
    while len(httpx.get(f"{base_url}/v1/status").json()["replicas"]) < 4:
        time.sleep(0.5)
    outcomes, latencies = asyncio.run(stream(base_url, seconds, clients))
    replicas = settled_status(base_url)
    serve.delete("vramgate")
    latencies.sort()
    return {
        "router": router, "requests": sum(outcomes.values()), "200": outcomes[200],
        "503": outcomes[503], "ooms": sum(r["oom_count"] for r in replicas),
        "other": sum(n for s, n in outcomes.items() if s not in (200, 503)),
        "throughput_rps": outcomes[200] / seconds,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else
        float("nan"),
        "peak_reserved_over_budget": max(r["peak_reserved_bytes"] / r["measured_budget_bytes"]
                                         for r in replicas),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=48)
    options = parser.parse_args()
    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base_url = f"http://127.0.0.1:{port}"
    try:
        rows = [run(router, base_url, options.seconds, options.clients)
                for router in ("budget", "pow2")]
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\n{options.clients} clients, {options.seconds:g} s, mixed 4-384 MiB requests, "
          "4 replicas x 403 MiB budget")
    print("| router | requests | 200 | 503 | OOMs | other | 200/s | p50 ms | p99 ms | "
          "peak reserved / budget |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['router']} | {r['requests']} | {r['200']} | {r['503']} | {r['ooms']} | "
              f"{r['other']} | {r['throughput_rps']:.1f} | {r['p50_ms']:.0f} | "
              f"{r['p99_ms']:.0f} | {r['peak_reserved_over_budget']:.2f} |")


if __name__ == "__main__":
    main()
