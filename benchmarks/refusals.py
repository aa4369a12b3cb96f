"""How fast a request that will be refused learns it: refusal latency, and refusals that came
only after a full wait, on the two workloads of the "refusals by prediction miss" finding.
Loopback only; each workload stops by itself; prints one table.

    python -m benchmarks.refusals [--workload closed|polite|cold|all] [--clients 100]
                                  [--seconds 25]

- ``closed``: ``--clients`` clients in a closed loop for ``--seconds``, each sending
  embeddings of 1 or 4 inputs of 100-200 words, at the fake engine's 6 GiB card
  (``loadtest/configs/fake_small_card.yaml``, one replica), the next request as soon as the
  last is answered. Refused at once, such clients come straight back, so refusals take about
  clients / (requests per second the proxy and ingress answer) by Little's law, whatever
  the replica does: on 2 cores about 300 per second, a third of a second each;
- ``polite``: the same clients, each waiting ``Retry-After`` (``retry-after-ms``) after a
  503, as the OpenAI SDKs do: what a refusal itself costs;
- ``cold``: 6 maximal requests (64 inputs of 256 tokens, about 4 s each on 2 cores) at
  once to a freshly started replica of ``configs/local.yaml`` (the packaged MiniLM on CPU).

A refusal "after a full wait" is a ``queue_timeout``: the request waited its whole
``admission.max_queue_wait_s`` and was refused then, the miss that refusals by prediction
exist to prevent. The goal: refusals p99 < 100 ms, and at most 1 % of them after a full wait.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import httpx

from loadtest.payloads import text
from loadtest.runner import (
    config_args,
    deploy,
    progress,
    saved_profile,
    start_serve,
    stop_serve,
    undeploy,
)

WORKLOADS = ("closed", "polite", "cold")
SLOW_REFUSAL_S = 0.1  # the goal: refusals within this, at the 99th percentile


@dataclass(frozen=True)
class Outcome:
    status: int
    code: str
    seconds: float
    retry_after_s: float = 0.0


async def _send(http: httpx.AsyncClient, body: dict) -> Outcome:
    started = time.monotonic()
    response = await http.post("/v1/embeddings", json=body)
    if response.status_code == 200:
        return Outcome(200, "", time.monotonic() - started)
    return Outcome(response.status_code, response.json()["error"]["code"],
                   time.monotonic() - started,
                   int(response.headers.get("retry-after-ms", 0)) / 1000)


async def closed_loop(base_url: str, clients: int, seconds: float, seed: int,
                      polite: bool = False) -> list[Outcome]:
    """``clients`` clients, each sending its next request as soon as the last is answered
    (``polite``: after the ``Retry-After`` of a refusal), until ``seconds`` have passed."""
    stop_at, outcomes = time.monotonic() + seconds, []

    async def client(rng: random.Random) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            while time.monotonic() < stop_at:
                inputs = [text(rng, 100, 200) for _ in range(rng.choice((1, 4)))]
                outcome = await _send(http, {"input": inputs})
                outcomes.append(outcome)
                if polite and outcome.retry_after_s:
                    await asyncio.sleep(min(outcome.retry_after_s,
                                            max(0.0, stop_at - time.monotonic())))

    await asyncio.gather(*(client(random.Random(seed + i)) for i in range(clients)))
    return outcomes


async def cold_burst(base_url: str, count: int = 6) -> list[Outcome]:
    """``count`` maximal requests at once to a replica that has served nothing."""
    rng = random.Random(0)
    body = {"input": [text(rng, 254, 254) for _ in range(64)]}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        return list(await asyncio.gather(*(_send(http, body) for _ in range(count))))


def figures(name: str, outcomes: list[Outcome], max_queue_wait_s: float) -> list[str]:
    refused = [o for o in outcomes if o.status != 200]
    after_wait = [o for o in refused if o.code == "queue_timeout"]
    codes = sorted({o.code for o in refused})
    cells = [name, str(len(outcomes)), str(len(outcomes) - len(refused)), str(len(refused)),
             ", ".join(f"{c} {sum(o.code == c for o in refused)}" for c in codes) or "-"]
    if refused:
        latencies = sorted(o.seconds for o in refused)
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        slow = sum(o.seconds > SLOW_REFUSAL_S for o in refused)
        cells += [f"{statistics.median(latencies) * 1000:.0f}", f"{p99 * 1000:.0f}",
                  f"{slow} ({slow / len(refused):.1%})",
                  f"{len(after_wait)} ({len(after_wait) / len(refused):.1%})"]
    else:
        cells += ["-", "-", "0", "0"]
    served = sorted(o.seconds for o in outcomes if o.status == 200)
    cells.append(f"{served[-1]:.1f}" if served else "-")
    cells.append(f"{max_queue_wait_s:g}")
    return cells


def run(workload: str, clients: int, seconds: float) -> list[str]:
    config = "configs/local.yaml" if workload == "cold" \
        else "loadtest/configs/fake_small_card.yaml"
    args = config_args(config)
    if profile := saved_profile(config):
        args = {**args, "memory": {**args.get("memory", {}), "profile_path": profile}}
    base_url = start_serve()
    try:
        progress(f"{workload}: deploying {config}")
        deploy(args, base_url)
        progress(f"{workload}: sending")
        outcomes = asyncio.run(cold_burst(base_url) if workload == "cold" else closed_loop(
            base_url, clients, seconds, 0, polite=workload == "polite"))
        undeploy()
    finally:
        stop_serve()
    wait_s = float(args.get("admission", {}).get("max_queue_wait_s", 10))
    return figures(workload, outcomes, wait_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=25.0)
    options = parser.parse_args()
    workloads = WORKLOADS if options.workload == "all" else (options.workload,)
    rows = [["workload", "requests", "served", "refused", "codes", "refusal p50 ms",
             "refusal p99 ms", "refusals > 100 ms", "after a full wait", "slowest served s",
             "wait limit s"]]
    rows += [run(w, options.clients, options.seconds) for w in workloads]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
