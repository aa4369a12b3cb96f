"""CPU threads (issue 16): items/s of 16-input requests through a model replica of the local
config (configs/local.yaml: the packaged all-MiniLM-L6-v2 on CPU, ``num_cpus: 1``), with
``model.num_threads: 1`` (before: the replica's ``num_cpus``) and unset (after: measured at
start-up, :mod:`deployments.engines.cpu_threads`), beside the bare model at each candidate
thread count. In this process, without Ray or HTTP: the replica is the one
:class:`deployments.replica.model_server.ModelServer` assembles (measured on its inference
thread, its
admission, batching and lifecycle), the requests are built as the ingress builds them
(tokenized per request, on this process's cores). Bounded; prints a markdown table.

    python -m benchmarks.cpu_threads [--seconds 8] [--clients 4] [--repeats 2]

Rows are measured ``--repeats`` times in turn (bare 1, bare 2, ..., replica before, replica
after, then again), so that load which comes and goes on the host falls on all of them; the
table shows each row's best and every pass with the share of the host's CPU that other
processes took meanwhile (a pass beside other work is not a figure of this code).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks.throughput import BATCH_INPUTS, sentence_pool
from serve_app.config import parse_args

LOCAL_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


def local_args(num_threads: int | None) -> dict[str, Any]:
    """configs/local.yaml's application args, with ``model.num_threads``."""
    args = yaml.safe_load(LOCAL_CONFIG.read_text())["applications"][0]["args"]
    args["model"]["num_threads"] = num_threads
    return args


def groups() -> list[list[str]]:
    pool = sentence_pool()
    return [pool[i:i + BATCH_INPUTS] for i in range(0, len(pool), BATCH_INPUTS)]


def bare_items_per_s(engine: Any, threads: int, seconds: float) -> float:
    """``embed`` of 16 sentences back to back at ``threads`` torch threads, after 1 s of
    the same."""
    import torch

    torch.set_num_threads(threads)
    batches, done = groups(), 0
    warm_until = time.perf_counter() + 1.0
    while time.perf_counter() < warm_until:
        engine.embed(batches[done % len(batches)])
        done += 1
    started, count = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        engine.embed(batches[count % len(batches)])
        count += 1
    return count * BATCH_INPUTS / (time.perf_counter() - started)


class LocalReplica:
    """A replica of :func:`local_args` as ``ModelServer.__init__`` builds it, without Ray."""

    def __init__(self, num_threads: int | None) -> None:
        self.args = parse_args(local_args(num_threads))
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")

    async def start(self) -> dict[str, Any]:
        """Measure on the inference thread, as the replica does; its ``cpu_threads``."""
        from deployments.http.request_factory import RequestFactory
        from deployments.replica.parts import Replica
        from deployments.replica.profiling import measure_replica
        from serve_app.metrics import ProcessMetrics

        loop = asyncio.get_running_loop()
        measured = await loop.run_in_executor(
            self.executor, lambda: measure_replica(self.args, on_progress=lambda _: None))
        self.replica = Replica(measured.engine, measured.probe, measured.cost_model,
                               measured.budget_bytes, self.args, self.executor,
                               ProcessMetrics("ModelServer", "bench", use_ray=False))
        self.factory = RequestFactory(self.args, measured.engine.front)
        return measured.memory_status(self.args)["cpu_threads"]

    async def items_per_s(self, clients: int, seconds: float) -> float:
        """``clients`` closed-loop clients of 16-input requests for ``seconds`` after 1 s."""
        batches, answered = groups(), []
        measure_from = time.monotonic() + 1.0
        stop_at = measure_from + seconds

        async def client(k: int) -> None:
            while time.monotonic() < stop_at:
                request = await self.factory.build("embed", batches[k % len(batches)])
                await self.replica.lifecycle.infer(request.sent(None, time.time()))
                if measure_from <= time.monotonic() <= stop_at:
                    answered.append(BATCH_INPUTS)
                k += 1

        await asyncio.gather(*(client(k) for k in range(clients)))
        return sum(answered) / seconds

    def close(self) -> None:
        self.replica.close()
        self.executor.shutdown(wait=True)


@dataclass
class Pass:
    """One measured pass of a row: items/s, and the share of the host's CPU time that other
    processes used meanwhile."""

    items_per_s: float = 0.0
    others: float = 0.0

    def __str__(self) -> str:
        return f"{self.items_per_s:.1f} (others {self.others:.0%})"

    @classmethod
    @contextlib.contextmanager
    def watch(cls, into: list[Pass]) -> Iterator[Pass]:
        done, me = cls(), psutil.Process()
        host, own, started = psutil.cpu_times(), me.cpu_times(), time.monotonic()
        yield done
        host_after, own_after = psutil.cpu_times(), me.cpu_times()
        busy = (sum(host_after) - host_after.idle - host_after.iowait
                - sum(host) + host.idle + host.iowait)
        mine = own_after.user + own_after.system - own.user - own.system
        done.others = max(0.0, busy - mine) / ((time.monotonic() - started)
                                               * (os.cpu_count() or 1))
        into.append(done)


async def measure(options: argparse.Namespace) -> list[tuple[str, str, list[Pass]]]:
    """``(row, threads, items/s of every pass)``: the bare model at each candidate, then the
    replica before and after, ``--repeats`` times in turn. Each replica keeps the threads it
    chose on its own inference thread (torch's count is per thread once a thread has run);
    the bare rows run on this one."""
    from deployments.engines.cpu_threads import candidate_threads, usable_cores
    from deployments.engines.embeddings import EmbeddingEngine

    engine = EmbeddingEngine(parse_args({}).model.resolved_path(), "cpu", "float32", 1)
    replicas = {"replica, model.num_threads: 1 (before)": LocalReplica(1),
                "replica, model.num_threads unset (after)": LocalReplica(None)}
    rows: dict[str, tuple[str, list[Pass]]] = {}
    for name, replica in replicas.items():
        choice = await replica.start()
        rows[name] = (f"{choice['threads']} ({choice['chosen_by']}; "
                      f"{_candidates(choice)})", [])
        _progress(f"{name}: {rows[name][0]}")
    bare = {f"bare model, {n} thread(s)": n for n in candidate_threads(usable_cores())}
    rows = {**{name: (str(n), []) for name, n in bare.items()}, **rows}
    try:
        for _ in range(options.repeats):
            for name, n in bare.items():
                with Pass.watch(rows[name][1]) as done:
                    done.items_per_s = bare_items_per_s(engine, n, options.seconds)
                _progress(f"{name}: {rows[name][1][-1]}")
            for name, replica in replicas.items():
                with Pass.watch(rows[name][1]) as done:
                    done.items_per_s = await replica.items_per_s(options.clients,
                                                                 options.seconds)
                _progress(f"{name}: {rows[name][1][-1]}")
    finally:
        for replica in replicas.values():
            replica.close()
    return [(name, threads, passes) for name, (threads, passes) in rows.items()]


def _candidates(choice: dict[str, Any]) -> str:
    measured = ", ".join(f"{c['threads']}: {c['items_per_s']:.1f}"
                         for c in choice["candidates"])
    return (f"probe items/s by threads {{{measured}}} in {choice['measure_s']:.1f} s"
            if measured else "not measured")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="measured seconds per row and pass (default 8)")
    parser.add_argument("--clients", type=int, default=4,
                        help=f"concurrent clients of {BATCH_INPUTS}-input requests (default 4, "
                        "as benchmarks.throughput's --batch-clients)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over all rows")
    options = parser.parse_args()
    load = os.getloadavg()[0]
    rows = asyncio.run(measure(options))
    print(f"\n{BATCH_INPUTS}-input requests, {options.clients} clients (replica) or back to "
          f"back (bare), {options.seconds:g} s per pass, {os.cpu_count()} cores, load "
          f"average {load:.2f} before / {os.getloadavg()[0]:.2f} after\n")
    print("| row | torch threads | items/s (best) | passes (other processes' CPU share) |\n"
          "|---|---|---|---|")
    for name, threads, passes in rows:
        best = max(p.items_per_s for p in passes)
        print(f"| {name} | {threads} | {best:.1f} | {', '.join(map(str, passes))} |")


if __name__ == "__main__":
    main()
