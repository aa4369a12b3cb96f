"""Generation on vLLM behind vramgate's gate vs vLLM alone vs vramgate's transformers engine:
the same model, the same load, one run. Loopback only; every run stops by itself; prints two
tables and the ratios the goals name.

    python -m benchmarks.vllm [--overload-s 60] [--deadline-s 10] [--skip-overload]

The model: a tiny Llama built here (hidden 128, 2 heads of 64, 2 layers, float32, random
weights), served by:

- ``in process``: vLLM's ``AsyncLLM`` called directly (the engine's ceiling: no HTTP);
- ``bare vLLM``: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) over
  loopback HTTP;
- ``vramgate+vLLM``: ``model.engine: vllm`` on local Ray Serve;
- ``vramgate+hf``: ``model.engine: generate`` (transformers, continuous batching).

Closed loop: 16 and 64 clients, each sending its requests one after another
(:mod:`benchmarks.llm_load`: ``max_tokens`` 8-128, one in four streamed; greedy, so every
target generates the same tokens): generated tokens/s, p50/p99 latency, median time to
first token of the streamed requests. Overload: an open loop at 3x and 10x the capacity
vramgate+vLLM measured at 64 clients (completions/s), ``--overload-s`` seconds, each request
abandoned by its client after ``--deadline-s``: goodput (completions within the deadline per
second), refusals (and how many came with ``Retry-After``), client timeouts, the served p99,
and the sequences vLLM preempted (its ``/metrics`` or vramgate's ``/v1/status``).

Measured on the 2-core dev machine (2026-12-06, one run; tokens/s at 16 / 64 clients):
in process 2162 / 4205, bare vLLM 1750 / 3906, vramgate+vLLM 682 / 791, vramgate+hf 749 /
957. Overload at 38 and 127 req/s (3x and 10x vramgate+vLLM's 12.7 req/s): goodput
vramgate+vLLM 6.72 / 0.73 per s (1069 refusals, all with ``Retry-After``, then 5283 client
timeouts: Ray Serve's proxy and ingress on 2 cores could not answer 127 req/s), bare vLLM
35.98 / 52.37 per s (these rates did not overload it); 0 preemptions in all four. On these
2 cores the request path, not the engine, bounds vramgate+vLLM (README: Generation on vLLM).
With streams grouped (``batching.stream_interval_ms``) and ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``
(2026-12-07, a slower moment of the host: in process 1591 / 3474, bare vLLM 1434 / 2740):
vramgate+vLLM 975 / 1429, vramgate+hf 1008 / 1171; goodput at 10x 0.47 against 41.40 per s.
With the door bounded (the ingress caps in :func:`vramgate_args`) and an aiohttp client
(:mod:`benchmarks.llm_load`), Ray's default mode, 2026-12-07, another slow moment (in process
1373 / 3197, bare vLLM 1280 / 2576): vramgate+vLLM 496 / 643, vramgate+hf 357 / 451 (1.39 /
1.43x; the door refused 15 of hf's 256 requests at 64 clients); overload at 31 and 103 req/s
(3x and 10x 10.3): goodput 3.90 / 3.70 per s, 924 / 4435 refusals, every one a 503 with
``Retry-After``, 629 / 799 client timeouts; bare vLLM 29.83 / 24.97 per s (3795 client
timeouts at 10x); 0 preemptions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.llm_load import (
    Done,
    client,
    closed_figures,
    closed_loop,
    open_loop,
    overload_figures,
    post,
)
from loadtest.runner import deploy, progress, start_serve, stop_serve, undeploy

CLIENTS = ((16, 8), (64, 4))  # (clients, requests each)
MAX_NUM_SEQS = 64
MODEL = "tiny"


def vramgate_args(path: Path, engine: str, max_queue_wait_s: float) -> dict[str, Any]:
    return {"model": {"engine": engine, "path": str(path), "name": MODEL, "device": "cpu"},
            "limits": {"max_input_tokens": 64, "max_tokens": 128},
            "batching": {"max_batch_size": MAX_NUM_SEQS, "continuous": True},
            "admission": {"max_queue_len": 4096, "max_queue_wait_s": max_queue_wait_s,
                          "kv_lease": "guaranteed"},  # the overload goal's mode
            # The door (README: Overload at the door): the ingress holds what the replica
            # runs (max_num_seqs) and as many again waiting, and half that may wait at Ray's
            # proxy; the rest get 503 + Retry-After from the proxy. With the defaults
            # (1024 / 256) the 10x overload on 2 cores stalled every request past its
            # deadline and none was refused; with 64 / 32 or 128 / 16 the proxy also
            # refused some of the 64 clients' closed loop (Ray counts a request queued until
            # an ingress replica is chosen, which takes a while on a busy proxy).
            "deployment": {"num_gpus": 0, "ingress_max_ongoing_requests": 2 * MAX_NUM_SEQS,
                           "ingress_max_queued_requests": MAX_NUM_SEQS // 2}}


async def _in_process(path: Path) -> list[dict[str, float]]:
    """``AsyncLLM`` in this process, the closed loops."""
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(path), dtype="float32", max_model_len=192, max_num_seqs=MAX_NUM_SEQS,
        enforce_eager=True, kv_cache_memory_bytes=256 << 20, disable_log_stats=True))
    counter = iter(range(10**9))

    async def send(body: dict) -> Done:
        started, first, tokens = time.monotonic(), None, 0
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0)
        async for out in llm.generate(body["prompt"], params, f"r{next(counter)}"):
            first = first or time.monotonic()
            tokens = len(out.outputs[0].token_ids)
        elapsed = time.monotonic() - started
        ttft = (first - started) if body["stream"] else elapsed
        return Done(status=200, seconds=elapsed, ttft_s=ttft, tokens=tokens)

    try:
        return [closed_figures(*await closed_loop(send, clients, each, seed=1, model=MODEL))
                for clients, each in CLIENTS]
    finally:
        llm.shutdown()


async def _closed_http(base_url: str) -> list[dict[str, float]]:
    async with client(base_url) as http:
        return [closed_figures(*await closed_loop(lambda b: post(http, b), clients, each,
                                                  seed=1, model=MODEL))
                for clients, each in CLIENTS]


async def _overload_http(base_url: str, rate_per_s: float, seconds: float,
                         deadline_s: float) -> dict[str, float]:
    async with client(base_url) as http:
        dones, _ = await open_loop(lambda b: post(http, b, deadline_s), rate_per_s, seconds,
                                   seed=2, model=MODEL)
    return overload_figures(dones, seconds, deadline_s)


def _overloads(base_url: str, vramgate: bool, rates: list[float],
               options: argparse.Namespace) -> list[dict[str, float]]:
    """The open loops at ``rates``, each with the preemptions vLLM counted meanwhile."""
    rows = []
    for rate in rates:
        before = _preempted(base_url, vramgate)
        progress(f"overload at {rate:.2f} req/s for {options.overload_s:g} s")
        row = asyncio.run(_overload_http(base_url, rate, options.overload_s,
                                         options.deadline_s))
        rows.append({**row, "rate_per_s": rate,
                     "preempted": _preempted(base_url, vramgate) - before})
    return rows


def _vllm_server(path: Path, port: int) -> subprocess.Popen:
    """vLLM's OpenAI server on ``port``, once it answers."""
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
         "--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1",
         "--dtype", "float32", "--max-model-len", "192", "--max-num-seqs", str(MAX_NUM_SEQS),
         "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20),
         "--disable-log-stats", "--disable-uvicorn-access-log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _once_settled(f"http://127.0.0.1:{port}/v1/models", within_s=300)
    except httpx.HTTPError:
        server.kill()
        raise RuntimeError("vLLM's server did not answer within 300 s") from None
    return server


def _preempted(base_url: str, vramgate: bool) -> int:
    """Sequences vLLM preempted since start, as the server reports them."""
    if vramgate:
        return sum(r["kv_cache"]["preempted_sequences"]
                   for r in _once_settled(f"{base_url}/v1/status").json()["replicas"])
    lines = _once_settled(f"{base_url}/metrics").text.splitlines()
    return int(sum(float(line.split()[-1]) for line in lines
                   if line.startswith("vllm:num_preemptions_total")))


def _once_settled(url: str, within_s: float = 120.0) -> httpx.Response:
    """``GET url`` once the server answers it with 200, within ``within_s``: while it starts,
    and right after a flood, when it is still shedding the abandoned requests (on 2 cores
    vramgate's ``/v1/status`` once took over httpx's default 5 s), one attempt is not enough.

    Raises ``httpx.HTTPStatusError`` (a last answer not 200) or ``httpx.TransportError``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            response = httpx.get(url, timeout=30)
            if response.status_code == 200 or time.monotonic() > deadline:
                return response.raise_for_status()
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(1)


def run(options: argparse.Namespace) -> tuple[dict[str, list], dict[str, list]]:
    """Every target's closed loops, and the overloads: ``(closed rows, overload rows)`` by
    target."""
    from tests.support import build_tiny_causal_lm, free_port

    closed: dict[str, list] = {}
    overload: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # Llama's own init (std 0.02): its random completions rarely meet EOS early, so
        # requests run to max_tokens
        path = build_tiny_causal_lm(Path(tmp) / "lm", hidden_size=128, num_heads=2)
        progress("AsyncLLM in process")
        closed["in process"] = asyncio.run(_in_process(path))
        base_url = start_serve()
        try:
            for engine, name in (("vllm", "vramgate+vLLM"), ("generate", "vramgate+hf")):
                progress(f"{name}: deploying")
                deploy(vramgate_args(path, engine, options.max_queue_wait_s), base_url)
                closed[name] = asyncio.run(_closed_http(base_url))
                if engine == "vllm" and not options.skip_overload \
                        and closed[name][-1]["requests_per_s"] > 0:
                    capacity = closed[name][-1]["requests_per_s"]
                    overload[name] = _overloads(base_url, True, [3 * capacity,
                                                                 10 * capacity], options)
                undeploy()
        finally:
            stop_serve()
        port = free_port()
        progress("bare vLLM server: starting")
        server = _vllm_server(path, port)
        try:
            url = f"http://127.0.0.1:{port}"
            closed["bare vLLM"] = asyncio.run(_closed_http(url))
            if overload:
                rates = [row["rate_per_s"] for row in overload["vramgate+vLLM"]]
                overload["bare vLLM"] = _overloads(url, False, rates, options)
        finally:
            server.terminate()
            server.wait(60)
    return closed, overload


def closed_table(closed: dict[str, list]) -> list[str]:
    lines = ["| target | clients | tokens/s | p50 s | p99 s | TTFT p50 s | failed |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in closed.items():
        for (clients, _), row in zip(CLIENTS, rows, strict=True):
            lines.append(f"| {name} | {clients} | {row['tokens_per_s']:.0f} | "
                         f"{row['p50_s']:.3f} | {row['p99_s']:.3f} | {row['ttft_p50_s']:.3f} | "
                         f"{row['failed']} |")
    lines.append("")
    ours = closed.get("vramgate+vLLM")
    for other in ("vramgate+hf", "in process", "bare vLLM"):
        if ours and other in closed:
            ratios = [f"{a['tokens_per_s'] / b['tokens_per_s']:.2f} at {clients}"
                      for (clients, _), a, b in zip(CLIENTS, ours, closed[other], strict=True)]
            lines.append(f"vramgate+vLLM / {other} (tokens/s): {', '.join(ratios)} clients")
    return lines


def overload_table(overload: dict[str, list], deadline_s: float) -> list[str]:
    lines = [f"| target | offered req/s | sent | served | goodput/s (<= {deadline_s:g} s) | "
             "refused (503 + Retry-After) | client timeouts | connection errors | served p99 s "
             "| preempted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in overload.items():
        for row in rows:
            lines.append(
                f"| {name} | {row['rate_per_s']:.2f} | {row['sent']} | {row['served']} | "
                f"{row['goodput_per_s']:.2f} | {row['refused']} "
                f"({row['refused_with_retry_after']}) | {row['client_timeouts']} | "
                f"{row['connection_errors']} | "
                f"{row['served_p99_s']:.2f} | {row['preempted']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overload-s", type=float, default=60.0)
    parser.add_argument("--deadline-s", type=float, default=10.0)
    parser.add_argument("--max-queue-wait-s", type=float, default=4.0,
                        help="vramgate's admission.max_queue_wait_s (below the deadline, so "
                             "that what it admits can finish in time)")
    parser.add_argument("--skip-overload", action="store_true")
    options = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    closed, overload = run(options)
    print("\n".join(["", *closed_table(closed), "", *overload_table(
        overload, options.deadline_s)]))


if __name__ == "__main__":
    main()
