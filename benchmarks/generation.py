"""Generation (issue 15): today's pass batching vs token-level continuous batching, on the fake
engine and on a tiny random Llama built offline, in one run. Bounded; prints a markdown
table and the done-when ratios.

    python -m benchmarks.generation [--clients 16] [--requests 4] [--seed 0] [--fake-only]

Each engine runs in this process behind a model replica's own parts (admission gate,
inference thread, pass batcher or decode loop: :class:`deployments.replica.parts.Replica`), not
over HTTP: what is compared is the scheduling, and the ingress is the same for both. Rows:

- mixed: ``--clients`` concurrent clients, each sending ``--requests`` greedy completions
  one after another, ``max_tokens`` drawn from 8-128 (the same draws for both schedules):
  generated tokens/s and the p50/p99 latency per request;
- short under load: the p50 latency of 8-token completions sent one after another while
  ``--clients`` - 1 clients keep 128-token ones running, vs the same 8-token completions
  on an idle replica.

The fake engine takes 5 ms per forward pass (a step, a prefill or a pass) plus 0.1 ms per
token processed (``fake.latency_per_pass_s``, ``latency_per_token_s``); the tiny Llama (4
layers, 256 wide, random weights) runs on one torch thread.

Measured on the 2-core dev machine (2026-12-01, one run; tokens/s, seconds):

=========== ============= ======== ===== ===== ============ ====================
engine      schedule      tokens/s p50   p99   8-tok alone  8-tok under load
=========== ============= ======== ===== ===== ============ ====================
fake        pass batching 506      1.842 3.283 0.051        1.569
fake        continuous    1488     0.429 1.047 0.050        0.073
tiny llama  pass batching 397      2.146 3.862 0.053        2.188
tiny llama  continuous    549      1.333 3.040 0.079        0.177
=========== ============= ======== ===== ===== ============ ====================

Fake engine: 2.94x the tokens/s, 8-token completions at 1.44x their lone latency under load.
On the CPU the tiny Llama's step cost grows with its batch (no parallel hardware) and joins
copy its padded cache: 1.38x (1.2-2x between runs) and 2.24x.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deployments.engines.fake import FakeEngine, exact_cost_model
from deployments.replica.parts import Replica, ReplicaIdentity
from serve_app.config import parse_args
from serve_app.kinds import build_request
from serve_app.memory.simulated import SimulatedDevice, SimulatedDeviceProbe
from serve_app.metrics import ProcessMetrics
from serve_app.request import GenerationParams

MAX_TOKENS = (8, 128)


def fake_engine() -> FakeEngine:
    return FakeEngine(SimulatedDevice(1 << 40), weights_bytes=0, bytes_per_token=1000,
                      latency_per_token_s=0.0001, latency_per_pass_s=0.005,
                      max_seq_tokens=512)


def tiny_llama() -> Any:
    from deployments.engines.generation import GenerationEngine
    from tests.model_dirs import build_causal_lm

    path = build_causal_lm(Path(tempfile.mkdtemp()) / "llama", "llama", num_layers=4,
                           hidden_size=256)
    return GenerationEngine(path, "cpu", "float32", num_threads=1)


def replica(engine: Any, continuous: bool, clients: int) -> tuple[Replica, Any]:
    args = parse_args({"limits": {"max_tokens": MAX_TOKENS[1], "max_input_tokens": 64},
                       "admission": {"max_queue_len": 1024, "max_queue_wait_s": 600,
                                     "inference_timeout_s": 600},
                       "batching": {"continuous": continuous, "max_batch_size": clients}})
    executor = ThreadPoolExecutor(max_workers=1)
    parts = Replica(engine, SimulatedDeviceProbe(SimulatedDevice(1 << 40)),
                    exact_cost_model(1, 0), 1 << 40, args, executor,
                    ProcessMetrics("ModelServer", "bench", use_ray=False),
                    ReplicaIdentity("bench"))
    return parts, args


async def complete(parts: Replica, args: Any, engine: Any, prompt: tuple[int, ...],
                   max_tokens: int) -> tuple[float, int]:
    """One greedy completion; ``(seconds, tokens generated)``."""
    request = build_request("generate", [prompt],
                            GenerationParams(max_tokens=max_tokens, temperature=0.0),
                            False, args, engine.max_seq_tokens)
    started = time.perf_counter()
    output = (await parts.lifecycle.infer(request)).output
    return time.perf_counter() - started, output.completion_tokens


async def mixed(engine: Any, continuous: bool, clients: int, requests: int,
                seed: int) -> dict[str, float]:
    parts, args = replica(engine, continuous, clients)
    rng = random.Random(seed)
    plans = [[(prompt_ids(engine, rng), rng.randint(*MAX_TOKENS)) for _ in range(requests)]
             for _ in range(clients)]

    async def client(plan):
        return [await complete(parts, args, engine, p, m) for p, m in plan]

    started = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(client(p) for p in plans)) for r in rs]
    wall_s = time.perf_counter() - started
    parts.close()
    latencies = sorted(s for s, _ in results)
    return {"tokens_per_s": sum(t for _, t in results) / wall_s,
            "p50_s": statistics.median(latencies),
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


async def short_under_load(engine: Any, continuous: bool, clients: int,
                           probes: int = 6) -> tuple[float, float]:
    """p50 of 8-token completions alone, then while 128-token ones run."""
    rng = random.Random(7)
    parts, args = replica(engine, continuous, clients)
    prompt = prompt_ids(engine, rng)
    alone = [await complete(parts, args, engine, prompt, 8) for _ in range(probes)]
    stop = asyncio.Event()

    async def long_client():
        while not stop.is_set():
            await complete(parts, args, engine, prompt_ids(engine, rng), 128)

    background = [asyncio.create_task(long_client()) for _ in range(clients - 1)]
    await asyncio.sleep(0.2)
    loaded = [await complete(parts, args, engine, prompt, 8) for _ in range(probes)]
    stop.set()
    await asyncio.gather(*background)
    parts.close()
    return (statistics.median(s for s, _ in alone), statistics.median(s for s, _ in loaded))


def prompt_ids(engine: Any, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(5, 200) for _ in range(rng.randint(8, 24)))


async def run(clients: int, requests: int, seed: int, fake_only: bool = False) -> None:
    print(f"{clients} clients x {requests} greedy completions, max_tokens {MAX_TOKENS[0]}-"
          f"{MAX_TOKENS[1]}; in-process replica parts, no HTTP\n")
    print("| engine | schedule | tokens/s | p50 s | p99 s | 8-token p50 alone s "
          "| 8-token p50 under 128-token load s |")
    print("|---|---|---|---|---|---|---|")
    ratios = {}
    engines = (("fake", fake_engine),) + (() if fake_only else (("tiny llama", tiny_llama),))
    for name, make in engines:
        engine = make()
        figures = {}
        for continuous in (False, True):
            row = await mixed(engine, continuous, clients, requests, seed)
            alone, loaded = await short_under_load(engine, continuous, clients)
            figures[continuous] = (row, alone, loaded)
            schedule = "continuous" if continuous else "pass batching"
            print(f"| {name} | {schedule} | {row['tokens_per_s']:.0f} | {row['p50_s']:.3f} | "
                  f"{row['p99_s']:.3f} | {alone:.3f} | {loaded:.3f} |")
        ratios[name] = (figures[True][0]["tokens_per_s"] / figures[False][0]["tokens_per_s"],
                        figures[True][2] / figures[True][1])
        engine.close()
    print()
    for name, (speedup, short) in ratios.items():
        print(f"{name}: continuous / pass tokens/s = {speedup:.2f}x; 8-token p50 under load / "
              f"alone (continuous) = {short:.2f}x")
    fake_speedup, fake_short = ratios["fake"]
    print(f"goals (fake engine): tokens/s >= 1.5x: {'met' if fake_speedup >= 1.5 else 'MISSED'}; "
          f"8-token latency <= 1.5x alone: {'met' if fake_short <= 1.5 else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fake-only", action="store_true", help="skip the tiny Llama")
    options = parser.parse_args()
    asyncio.run(run(options.clients, options.requests, options.seed, options.fake_only))


if __name__ == "__main__":
    main()
