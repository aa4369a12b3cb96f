"""Latency of one short embeddings request: the bare model in-process vs served over HTTP,
and /healthz while the model is busy. Loopback only; bounded; prints a table.

    python -m benchmarks.latency [--requests 200]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx
import ray
from ray import serve

from deployments.engines.embeddings import EmbeddingEngine
from serve_app.app import build_app
from serve_app.config import parse_args
from tests.support import free_port, wait_until_ready

SENTENCE = "A man is eating a piece of bread."
ARGS = {"model": {"device": "cpu"},
        "memory": {"capacity_bytes": 2 << 30, "reserve_bytes": 256 << 20},
        "limits": {"max_inputs": 64, "max_input_tokens": 256}}


def _median_ms(samples_s: list[float]) -> float:
    return statistics.median(samples_s) * 1000


def bare_ms(n: int) -> float:
    """The engine as the replica runs it (1 torch thread: the replica's num_cpus)."""
    args = parse_args(ARGS)
    engine = EmbeddingEngine(args.model.resolved_path(), "cpu", "float32", num_threads=1)
    for _ in range(10):
        engine.embed([SENTENCE])
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        engine.embed([SENTENCE])
        samples.append(time.perf_counter() - started)
    return _median_ms(samples)


def served_ms(base_url: str, n: int) -> float:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        for _ in range(10):
            http.post("/v1/embeddings", json={"input": SENTENCE}).raise_for_status()
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            http.post("/v1/embeddings", json={"input": SENTENCE}).raise_for_status()
            samples.append(time.perf_counter() - started)
    return _median_ms(samples)


def healthz_while_busy_ms(base_url: str) -> tuple[float, float, int]:
    """(median, max) /healthz latency while a largest-size request runs, and how many."""
    busy = threading.Thread(target=lambda: httpx.post(
        f"{base_url}/v1/embeddings", json={"input": ["word " * 250] * 64}, timeout=120))
    busy.start()
    samples = []
    with httpx.Client(base_url=base_url, timeout=30) as http:
        time.sleep(0.3)  # let the big request reach the model
        while busy.is_alive() and len(samples) < 200:
            started = time.perf_counter()
            http.get("/healthz").raise_for_status()
            samples.append(time.perf_counter() - started)
            time.sleep(0.02)
    busy.join()
    return _median_ms(samples), max(samples) * 1000, len(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    n = parser.parse_args().requests
    bare = bare_ms(n)
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base_url = f"http://127.0.0.1:{port}"
    try:
        serve.run(build_app(ARGS), name="bench", route_prefix="/", blocking=False)
        wait_until_ready(base_url)
        served = served_ms(base_url, n)
        health_median, health_max, health_n = healthz_while_busy_ms(base_url)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\none short embeddings request, median of {n} sequential requests")
    print(f"{'bare model in-process':<34} {bare:8.2f} ms")
    print(f"{'served over HTTP (Ray Serve)':<34} {served:8.2f} ms")
    print(f"{'ratio served / bare':<34} {served / bare:8.2f} x")
    print(f"{'/healthz while the model is busy':<34} {health_median:8.2f} ms median, "
          f"{health_max:.2f} ms max over {health_n} calls")


if __name__ == "__main__":
    main()
