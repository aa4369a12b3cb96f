"""Throughput (issue 7, budget-aware dynamic batching): the bare model in-process vs the served
model over HTTP at saturation, with batching on and off, beside the fake engine at zero cost
(the serving stack's own ceiling). Loopback only; bounded; prints a markdown table and the
done-when ratios.

    python -m benchmarks.throughput [--seconds 15] [--clients 32] [--threads 1] [--only-bare]

Rows, all measured in one run:

- bare: the packaged all-MiniLM-L6-v2 in this process (``EmbeddingEngine``, ``--threads``
  torch threads, as a replica with ``deployment.num_cpus: --threads`` runs it), one sentence
  per call, then batches of 16 and 32;
- served: a local Ray + Serve (started here; one model replica of ``--threads`` CPUs),
  single-input requests from ``--clients`` concurrent clients and 16-input requests from
  ``--batch-clients`` clients, each with ``batching.enabled`` on and off, redeployed per row;
- fake: the same service on the fake engine at zero time and memory cost, single-input
  requests from ``--clients`` clients, batching on and off.

Items are inputs answered with 200. Served latencies are those of the 200s, client-side,
over a ``--seconds`` window after ``--warmup`` seconds of the same load. The load generator
runs in this process, on the same cores as the service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.stats import percentile
from serve_app.config import BatchingConfig, parse_args
from tests.support import SENTENCES, fake_app_args, free_port, wait_until_ready

BATCH_INPUTS = 16  # inputs per request of the batched served rows (and the bare batch it meets)
BARE_BATCHES = (1, 16, 32)
POOL_SIZE = 64  # varied short sentences, a multiple of every batch size above
APP_NAME = "vramgate"
TARGET_BATCHED_VS_BARE = 0.8
TARGET_SINGLE_VS_FAKE = 0.75
SERVED_SINGLE = "served MiniLM, single inputs"
SERVED_BATCHED = f"served MiniLM, {BATCH_INPUTS}-input requests"
FAKE_SINGLE = "fake engine at zero cost, single inputs"


def bare_name(size: int) -> str:
    return f"bare MiniLM, batches of {size}"


def sentence_pool(n: int = POOL_SIZE, seed: int = 7) -> list[str]:
    """``n`` short varied sentences (6-12 words), the test suite's three first."""
    rng = random.Random(seed)
    subjects = ["A man", "The girl", "A woman", "The old dog", "Two children", "A chef",
                "The pilot", "My neighbour", "A student", "The farmer"]
    verbs = ["is eating", "is carrying", "is reading", "is painting", "is watching",
             "is cleaning", "is playing with", "is looking for", "is holding", "is fixing"]
    objects = ["a piece of bread", "a baby", "the morning newspaper", "a red fence",
               "the sunset", "the kitchen floor", "a small ball", "the lost keys",
               "an old bicycle", "a cup of tea"]
    tails = ["", " in the park", " at night", " before lunch", " near the river",
             " with great care"]
    pool = list(SENTENCES)
    while len(pool) < n:
        sentence = (f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"
                    f"{rng.choice(tails)}.")
        if sentence not in pool:
            pool.append(sentence)
    return pool


def percentile_ms(seconds: list[float], q: float) -> float:
    """:func:`benchmarks.stats.percentile` of ``seconds``, in ms (NaN when empty)."""
    return 1000 * percentile(seconds, q)


@dataclass(kw_only=True)
class Row:
    name: str
    batching: str
    clients: str
    inputs: int
    ok: int  # calls or requests answered with 200
    seconds: float
    latencies_s: list[float] = field(default_factory=list)
    non_200: Counter = field(default_factory=Counter)
    served: bool = True

    @property
    def rps(self) -> float:
        return self.ok / self.seconds

    @property
    def items_per_s(self) -> float:
        return self.ok * self.inputs / self.seconds

    def cells(self) -> list[str]:
        lat = sorted(self.latencies_s)
        non_200 = (", ".join(f"{n}x{s}" for s, n in sorted(self.non_200.items(), key=str))
                   or "0") if self.served else "-"
        return [self.name, self.batching, self.clients, str(self.inputs), str(self.ok),
                non_200, f"{self.rps:.1f}", f"{self.items_per_s:.1f}",
                f"{percentile_ms(lat, 0.50):.1f}", f"{percentile_ms(lat, 0.99):.1f}"]


# --- the bare model, in this process ------------------------------------------------------

def bare_rows(threads: int, seconds: float, warmup_s: float) -> list[Row]:
    """One row per batch size of :data:`BARE_BATCHES`: ``embed`` calls back to back for
    ``seconds`` after ``warmup_s`` of the same calls."""
    from deployments.engines.embeddings import EmbeddingEngine

    path = parse_args({}).model.resolved_path()
    engine = EmbeddingEngine(path, "cpu", "float32", num_threads=threads)
    pool = sentence_pool()
    rows = []
    for size in BARE_BATCHES:
        groups = [pool[i:i + size] for i in range(0, len(pool), size)]
        warm_until = time.perf_counter() + warmup_s
        i = 0
        while time.perf_counter() < warm_until:
            engine.embed(groups[i % len(groups)])
            i += 1
        latencies = []
        started = time.perf_counter()
        stop_at = started + seconds
        while (now := time.perf_counter()) < stop_at:
            engine.embed(groups[i % len(groups)])
            latencies.append(time.perf_counter() - now)
            i += 1
        elapsed = time.perf_counter() - started
        rows.append(Row(name=bare_name(size), batching="-", clients="1 (in-process)",
                        inputs=size, ok=len(latencies), seconds=elapsed, latencies_s=latencies,
                        served=False))
        _progress(f"bare batch {size}: {rows[-1].items_per_s:.1f} items/s")
    del engine
    return rows


# --- the served model, over HTTP ----------------------------------------------------------

def batching_section(on: bool, options: argparse.Namespace) -> dict[str, Any]:
    if not on:
        return {"enabled": False}
    return {"enabled": True, "max_batch_size": options.max_batch_size,
            "max_wait_ms": options.max_wait_ms}


def real_args(threads: int, batching: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"device": "cpu"},
            "memory": {"capacity_bytes": 2 << 30, "reserve_bytes": 256 << 20},
            "limits": {"max_inputs": 32, "max_input_tokens": 128},
            "admission": {"max_queue_len": 256, "max_queue_wait_s": 30},
            "deployment": {"num_cpus": threads},
            "batching": batching}


def fake_args(threads: int, batching: dict[str, Any]) -> dict[str, Any]:
    """The fake engine at zero cost: no time, 1 byte per token, no weights, a budget far
    beyond the largest request (32 x 64 bytes)."""
    return fake_app_args(
        fake={"latency_per_token_s": 0.0, "bytes_per_token": 1, "weights_bytes": 0},
        memory={"budget_bytes": 1 << 30},
        limits={"max_inputs": 32, "max_input_tokens": 64},
        admission={"max_queue_len": 256, "max_queue_wait_s": 30},
        deployment={"num_cpus": threads},
        batching=batching)


async def _load(base_url: str, bodies: list[bytes], clients: int,
                warmup_s: float, seconds: float) -> tuple[int, list[float], Counter]:
    """``clients`` closed-loop clients posting ``bodies`` in turn for ``warmup_s + seconds``;
    returns the 200s, their latencies and the other outcomes that finished in the last
    ``seconds``."""
    ok_latencies: list[float] = []
    non_200: Counter = Counter()
    measure_from = time.monotonic() + warmup_s
    stop_at = measure_from + seconds
    headers = {"content-type": "application/json"}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as http:

        async def client(k: int) -> None:
            i = k
            while time.monotonic() < stop_at:
                body = bodies[i % len(bodies)]
                i += 1
                started = time.monotonic()
                try:
                    status: int | str = (await http.post("/v1/embeddings", content=body,
                                                         headers=headers)).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                finished = time.monotonic()
                if measure_from <= finished <= stop_at:
                    if status == 200:
                        ok_latencies.append(finished - started)
                    else:
                        non_200[status] += 1
                if status != 200:
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(client(k) for k in range(clients)))
    return len(ok_latencies), ok_latencies, non_200


def served_row(name: str, app_args: dict[str, Any], base_url: str, inputs: int, clients: int,
               options: argparse.Namespace) -> Row:
    """Deploy ``app_args``, load it, delete it."""
    from ray import serve

    from serve_app.app import build_app

    pool = sentence_pool()
    groups = [pool[i:i + inputs] for i in range(0, len(pool), inputs)]
    bodies = [json.dumps({"input": group if inputs > 1 else group[0],
                          "encoding_format": options.encoding_format}).encode()
              for group in groups]
    batching = "on" if app_args["batching"]["enabled"] else "off"
    started = time.monotonic()
    serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
    try:
        wait_until_ready(base_url)
        _progress(f"{name}, batching {batching}: ready after "
                  f"{time.monotonic() - started:.0f} s; loading for "
                  f"{options.warmup + options.seconds:g} s")
        ok, latencies, non_200 = asyncio.run(_load(base_url, bodies, clients,
                                                   options.warmup, options.seconds))
    finally:
        serve.delete(APP_NAME)
    row = Row(name=name, batching=batching, clients=str(clients), inputs=inputs, ok=ok,
              seconds=options.seconds, latencies_s=latencies, non_200=non_200)
    _progress(f"  {row.rps:.1f} req/s, {row.items_per_s:.1f} items/s, non-200: "
              f"{dict(non_200) or 0}")
    return row


def served_plan(options: argparse.Namespace) -> list[tuple[str, dict[str, Any], int, int]]:
    """``(name, app args, inputs per request, clients)`` of every served row, in order."""
    plan = []
    for on in (True, False):
        section = batching_section(on, options)
        plan += [
            (SERVED_SINGLE, real_args(options.threads, section), 1, options.clients),
            (SERVED_BATCHED, real_args(options.threads, section), BATCH_INPUTS,
             options.batch_clients),
            (FAKE_SINGLE, fake_args(options.threads, section), 1, options.clients)]
    return plan


def served_rows(options: argparse.Namespace) -> list[Row]:
    import ray
    from ray import serve

    plan = served_plan(options)
    ray.init(num_cpus=max(options.threads, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base_url = f"http://127.0.0.1:{port}"
    try:
        return [served_row(name, args, base_url, inputs, clients, options)
                for name, args, inputs, clients in plan]
    finally:
        serve.shutdown()
        ray.shutdown()


# --- report -------------------------------------------------------------------------------

def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _find(rows: list[Row], name: str, batching: str = "-") -> Row | None:
    return next((r for r in rows if r.name == name and r.batching == batching), None)


def _ratio_line(label: str, numerator: Row | None, denominator: Row | None, attr: str,
                target: float | None = None) -> str:
    if numerator is None or denominator is None or getattr(denominator, attr) == 0:
        return f"- {label}: n/a"
    ratio = getattr(numerator, attr) / getattr(denominator, attr)
    verdict = ""
    if target is not None:
        verdict = f" (target >= {target:g}: {'met' if ratio >= target else 'NOT met'})"
    return (f"- {label}: {getattr(numerator, attr):.1f} / {getattr(denominator, attr):.1f} "
            f"= **{ratio:.2f}**{verdict}")


def report(rows: list[Row], options: argparse.Namespace) -> None:
    header = ["row", "batching", "clients", "inputs/req", "200s (calls)", "non-200",
              "req/s", "items/s", "p50 ms", "p99 ms"]
    batching = (f"max_batch_size {options.max_batch_size}, max_wait_ms {options.max_wait_ms:g}")
    served = ("" if options.only_bare else
              f"; served: {options.seconds:g} s after {options.warmup:g} s warm-up, "
              f"encoding_format {options.encoding_format}, batching on = {batching}, "
              f"{os.cpu_count()} host cores shared with the load generator")
    print(f"\nthroughput, {options.threads} torch thread(s) per model (bare and replica); "
          f"bare: {options.bare_seconds:g} s per row, latency per call{served}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")
    single, batched, fake = SERVED_SINGLE, SERVED_BATCHED, FAKE_SINGLE
    bare_batched = _find(rows, bare_name(BATCH_INPUTS))
    lines = [
        _ratio_line(f"served {BATCH_INPUTS}-input items/s (batching on) / bare batches of "
                    f"{BATCH_INPUTS} items/s", _find(rows, batched, "on"), bare_batched,
                    "items_per_s", TARGET_BATCHED_VS_BARE),
        _ratio_line(f"served {BATCH_INPUTS}-input items/s (batching off) / bare batches of "
                    f"{BATCH_INPUTS} items/s", _find(rows, batched, "off"), bare_batched,
                    "items_per_s"),
        _ratio_line("served single-input req/s / fake zero-cost req/s (batching on)",
                    _find(rows, single, "on"), _find(rows, fake, "on"), "rps",
                    TARGET_SINGLE_VS_FAKE),
        _ratio_line("served single-input req/s, batching on / off",
                    _find(rows, single, "on"), _find(rows, single, "off"), "rps"),
        _ratio_line("fake zero-cost single-input req/s, batching on / off",
                    _find(rows, fake, "on"), _find(rows, fake, "off"), "rps"),
        _ratio_line("served single-input items/s (batching on) / bare single items/s",
                    _find(rows, single, "on"), _find(rows, bare_name(1)),
                    "items_per_s"),
    ]
    if not options.only_bare:
        print("\n" + "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="measured seconds per served row (default 15)")
    parser.add_argument("--warmup", type=float, default=3.0,
                        help="seconds of the same load before each served measurement")
    parser.add_argument("--clients", type=int, default=32,
                        help="concurrent clients of the single-input rows (default 32)")
    parser.add_argument("--batch-clients", type=int, default=4,
                        help=f"concurrent clients of the {BATCH_INPUTS}-input rows (default 4)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the bare model and deployment.num_cpus of the "
                        "replica (default 1)")
    parser.add_argument("--bare-seconds", type=float, default=5.0,
                        help="measured seconds per bare row (default 5)")
    parser.add_argument("--max-batch-size", type=int, default=32,
                        help="batching.max_batch_size of the batching-on rows (default 32)")
    default_wait_ms = BatchingConfig().max_wait_ms
    parser.add_argument("--max-wait-ms", type=float, default=default_wait_ms,
                        help="batching.max_wait_ms of the batching-on rows (default "
                        f"{default_wait_ms:g}, the config's)")
    parser.add_argument("--encoding-format", choices=("float", "base64"), default="float")
    parser.add_argument("--only-bare", action="store_true",
                        help="only the in-process rows (no Ray)")
    options = parser.parse_args()
    if not options.only_bare:  # fail fast, before minutes of measuring, on a bad config
        for _, args, _, _ in served_plan(options):
            parse_args(args)
    rows = bare_rows(options.threads, options.bare_seconds, min(options.warmup, 1.0))
    if not options.only_bare:
        rows += served_rows(options)
    report(rows, options)


if __name__ == "__main__":
    main()
