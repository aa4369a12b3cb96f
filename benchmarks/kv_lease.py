"""``admission.kv_lease``: ``guaranteed`` against ``expected`` on vLLM, the same model, the
same load, one run. Loopback only; stops by itself; prints one table.

    python -m benchmarks.kv_lease [--clients 32] [--requests-each 6] [--pool-blocks 24]

The model: the tiny Llama of :mod:`benchmarks.vllm` (float32, random weights, 1024
positions) with an ``init_std`` of 0.2, so that greedy completions vary and end at the
end-of-sequence token: over :data:`PROMPTS` they run 14 to 261 tokens (transformers
``generate``, whose greedy tokens vLLM's equal). The load is the traffic ``expected`` is
for: every request asks for ``max_tokens`` 992 and stops far earlier. The replica's KV pool is
held to ``--pool-blocks`` blocks of 128 tokens (the CPU backend's block) through
``memory.capacity_bytes``, so that leases, not the 2 cores, bound how many sequences run at
once: ``guaranteed`` leases ceil((prompt + 992) / 128) = 8 blocks a request, ``expected`` the
blocks of prompt + the 0.95 quantile of the completions it saw.

Both modes first run ``--warm-up`` requests (``expected`` needs 32 completions of a range
before it leases less; ``guaranteed`` gets the same), then the closed loop is measured:
generated tokens/s, p50/p99 latency, median time to first token (streamed requests), the
most blocks leased at once (``peak_reserved_bytes`` / block bytes, warm-up included) and the
sequences vLLM preempted meanwhile (``/v1/status``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks.llm_load import Done, client, closed_figures, post
from loadtest.runner import deploy, progress, start_serve, stop_serve, undeploy

MODEL = "tiny"
MAX_TOKENS = 992
MAX_INPUT_TOKENS = 32
BLOCK_TOKENS = 128
WORDS = ("memory", "budget", "replica", "request", "lease", "queue", "token", "device",
         "cache", "model", "serve", "batch", "ray", "bytes", "admit", "wait")
PROMPTS = tuple(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(6)) for i in range(16))


def vramgate_args(path: Path, kv_lease: str, capacity_bytes: int, clients: int,
                  ) -> dict[str, Any]:
    return {"model": {"engine": "vllm", "path": str(path), "name": MODEL, "device": "cpu"},
            "deployment": {"num_gpus": 0},
            "memory": {"capacity_bytes": capacity_bytes, "reserve_bytes": 0,
                       "safety_factor": 1.0},
            "limits": {"max_input_tokens": MAX_INPUT_TOKENS, "max_tokens": MAX_TOKENS},
            "batching": {"max_batch_size": clients},
            "admission": {"max_queue_len": 4 * clients, "max_queue_wait_s": 120,
                          "inference_timeout_s": 120, "kv_lease": kv_lease}}


def pool_capacity_bytes(path: Path, pool_blocks: int) -> tuple[int, int]:
    """``memory.capacity_bytes`` that leaves ``pool_blocks`` blocks after the weights, and
    the block's bytes (both as the vLLM engine computes them)."""
    from deployments.engines.vllm_engine import VLLMEngine
    from serve_app.config import parse_args

    args = parse_args(vramgate_args(path, "guaranteed", 1 << 40, 1))
    cost_model, weights_bytes = VLLMEngine.analytic_costs(args)
    block_bytes = int(cost_model.coefficients[0])
    return weights_bytes + pool_blocks * block_bytes, block_bytes


def bodies(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"model": MODEL, "prompt": rng.choice(PROMPTS), "temperature": 0,
             "max_tokens": MAX_TOKENS, "stream": rng.random() < 0.25} for _ in range(count)]


async def _closed(base_url: str, clients: int, each: int, seed: int) -> tuple[list[Done], float]:
    async with client(base_url) as http:
        started = asyncio.get_running_loop().time()

        async def one_client(index: int) -> list[Done]:
            return [await post(http, body) for body in bodies(seed + index, each)]

        ends = await asyncio.gather(*(one_client(i) for i in range(clients)))
        return [d for done in ends for d in done], asyncio.get_running_loop().time() - started


def _status(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/v1/status", timeout=30).json()["replicas"][0]


def measure(base_url: str, options: argparse.Namespace, block_bytes: int) -> dict[str, Any]:
    """Warm-up, then the measured closed loop, with the replica's figures around it."""
    asyncio.run(_closed(base_url, options.clients, -(-options.warm_up // options.clients),
                        seed=100))
    before = _status(base_url)
    dones, wall_s = asyncio.run(_closed(base_url, options.clients, options.requests_each,
                                        seed=1))
    after = _status(base_url)
    ok = [d for d in dones if d.status == 200]
    return {**closed_figures(dones, wall_s),
            "mean_tokens": sum(d.tokens for d in ok) / max(1, len(ok)),
            "peak_blocks": after["peak_reserved_bytes"] / block_bytes,
            "preempted": (after["kv_cache"]["preempted_sequences"]
                          - before["kv_cache"]["preempted_sequences"]),
            "expected_new_tokens": after["cost_model"].get("expected_new_tokens", {})}


def run(options: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from tests.support import build_tiny_causal_lm

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_causal_lm(Path(tmp) / "lm", hidden_size=128, num_heads=2,
                                    init_std=0.2, max_positions=1024)
        capacity_bytes, block_bytes = pool_capacity_bytes(path, options.pool_blocks)
        base_url = start_serve()
        try:
            for kv_lease in ("guaranteed", "expected"):
                progress(f"kv_lease: {kv_lease}: deploying")
                deploy(vramgate_args(path, kv_lease, capacity_bytes, options.clients),
                       base_url)
                rows[kv_lease] = measure(base_url, options, block_bytes)
                undeploy()
        finally:
            stop_serve()
    return rows


def table(rows: dict[str, dict[str, Any]], clients: int) -> list[str]:
    lines = ["| kv_lease | clients | tokens/s | p50 s | p99 s | TTFT p50 s | mean completion "
             "tokens | most blocks leased at once | preempted | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {clients} | {row['tokens_per_s']:.0f} | {row['p50_s']:.2f} | "
                     f"{row['p99_s']:.2f} | {row['ttft_p50_s']:.2f} | {row['mean_tokens']:.0f} "
                     f"| {row['peak_blocks']:.0f} | {row['preempted']} | {row['failed']} |")
    if "expected" in rows:
        lines.append(f"\nexpected new tokens by max_tokens range: "
                     f"{rows['expected']['expected_new_tokens']}")
    if len(rows) == 2:
        ratio = rows["expected"]["tokens_per_s"] / rows["guaranteed"]["tokens_per_s"]
        lines.append(f"expected / guaranteed (tokens/s): {ratio:.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests-each", type=int, default=6)
    parser.add_argument("--warm-up", type=int, default=64)
    parser.add_argument("--pool-blocks", type=int, default=24)
    options = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    rows = run(options)
    print("\n".join(["", *table(rows, options.clients)]))


if __name__ == "__main__":
    main()
