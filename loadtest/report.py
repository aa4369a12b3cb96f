"""``python -m loadtest.run report``: every baseline side by side, in one run, -> BENCHMARKS.md.

For each workload of :data:`WORKLOADS` (the fake engine on a small simulated card, under the
heterogeneous mix and under completions and chat only; the packaged all-MiniLM-L6-v2 on CPU):
the ``steady`` shape against each baseline of
:data:`loadtest.scenarios.BASELINES` (budget first: its measured budget and cost model size the
slot-count baseline), then, where the workload asks for it, the ``spike`` shape against the
budget policy, its base load calibrated to the budget's measured steady throughput so that the
spike offers :data:`loadtest.scenarios.SPIKE_MULTIPLE` x what the service can answer; and the
same spike with ``deployment.max_ongoing_requests`` raised so that no request waits in Ray
Serve's handle queue (all waiting happens in the replica's timed admission queue): the
difference between the two locates any wait beyond ``max_queue_wait_s``. That second run is
left out when the budget's derived ``max_ongoing_requests`` is already
:data:`UNBOUNDED_ONGOING` or more (it would be the same run).

Then the tenants section (:mod:`benchmarks.tenants`, ``--engines tenants`` for it alone: a
noisy neighbour under fair share and FIFO, weights 3:1, a batch flood beside interactive
traffic, on the fake engine).

Then, where vLLM is installed (or ``--engines vllm``), the vLLM section
(:mod:`loadtest.vllm_section`: vramgate + vLLM against vLLM's own server, closed loop and
overload, and the two KV lease modes).

Writes the plots, ``summary.json`` and ``summary.csv`` to ``--out`` and the report to
``--markdown``; raw per-run files go to ``loadtest/results/report-<time>/``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import tenants
from loadtest import vllm_section
from loadtest.plots import comparison
from loadtest.prices import slots_for
from loadtest.runner import (
    REPO,
    RESULTS,
    RunSpec,
    deploy,
    progress,
    run_spec,
    saved_profile,
    start_serve,
    stop_serve,
    undeploy,
)
from loadtest.scenarios import BASELINES, SHAPES, SPIKE_MULTIPLE, Baseline

TENANTS, TENANTS_QUICK = (30.0, 500, 1000), (10.0, 100, 200)
"""The tenants section's seconds per run, durable jobs in its flood and lines in its Batch API
batch (full, ``--quick``)."""
UNBOUNDED_ONGOING = 1000  # max_ongoing_requests of the diagnostic spike run: above any queue


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One engine's side-by-side comparison.

    Attributes:
        engine: the engine's short name (tables, ``--engines``).
        title: what it is, for the report.
        config: the ``serve run`` YAML deployed.
        mix: the user mix (:data:`loadtest.scenarios.MIXES`).
        users: users of the steady runs; with ``pace_rps`` they offer about
            ``users x pace_rps`` requests per second (chosen above the budget's capacity, so
            every baseline is saturated and throughput measures capacity).
        steady_s, spike_s: run lengths (full report); ``--quick`` uses its own.
        spike: run the spike shape against the budget policy.
        spike_pace_rps: the spike users' pace: low, so that a user's period (20 s) outlasts
            the slowest answer under overload (``max_queue_wait_s`` + a pass + the handle
            queue) and the offered load stays ten times the base.
        name: file names and labels of its runs (default: ``engine``); unique per workload.
        goal: the done-when's budget / semaphore(1) throughput ratio (``None``: the budget
            must only not be slower).
    """

    engine: str
    title: str
    config: str
    mix: str
    users: int
    pace_rps: float
    steady_s: float
    spike: bool
    spike_s: float = 60.0
    spike_pace_rps: float = 0.05
    name: str = ""
    goal: float | None = None

    @property
    def key(self) -> str:
        return self.name or self.engine


FAKE_CARD = "loadtest/configs/fake_small_card.yaml"
# The goals are issue 15's done-when: on the fake card the budget at least 1.5x semaphore(1)'s
# throughput on the mixed run (1.19x with pass batching) and 3x on completions and chat only.
WORKLOADS: tuple[Workload, ...] = (
    Workload(engine="fake", title="fake engine on a simulated 6 GiB card", config=FAKE_CARD,
             mix="mixed", users=150, pace_rps=0.1, steady_s=45.0, spike=True, goal=1.5),
    Workload(engine="fake",
             title="fake engine on a simulated 6 GiB card: completions and chat only",
             config=FAKE_CARD, mix="chat", users=150, pace_rps=0.1, steady_s=45.0, spike=False,
             name="fake-chat", goal=3.0),
    Workload(engine="minilm", title="all-MiniLM-L6-v2 on CPU (1 thread)",
             config="loadtest/configs/minilm_cpu.yaml", mix="mixed_embed", users=160,
             pace_rps=0.1, steady_s=45.0, spike=False),
)
# --quick: short runs, so users send every 2 s (the same offered load from fewer users)
QUICK_STEADY_S, QUICK_SPIKE_S, QUICK_PACE_RPS = 10.0, 15.0, 0.5


def machine() -> dict[str, Any]:
    """Where the figures come from: CPU, cores, memory, and the versions that matter."""
    import psutil

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    versions = {name: metadata.version(name) for name in ("ray", "locust", "torch",
                                                          "matplotlib")}
    return {"cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
            "os": platform.platform(), "python": platform.python_version(), **versions,
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def run_report(options: argparse.Namespace) -> None:
    """Run every workload's baselines (see module docstring) and write the report."""
    quick = options.quick
    out = Path(options.out or (RESULTS / "quick" if quick else REPO / "docs" / "benchmarks"))
    markdown = Path(options.markdown or (out / "BENCHMARKS.md" if quick
                                         else REPO / "BENCHMARKS.md"))
    wanted = [w for w in WORKLOADS if not options.engines or w.engine in options.engines]
    if quick:  # the fake engine only, short runs
        wanted = [replace(w, steady_s=QUICK_STEADY_S, spike_s=QUICK_SPIKE_S,
                          pace_rps=QUICK_PACE_RPS, users=round(w.users * w.pace_rps
                                                               / QUICK_PACE_RPS),
                          spike_pace_rps=QUICK_PACE_RPS)
                  for w in wanted if w.engine == "fake"]
    results = RESULTS / f"report-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    base_url = start_serve()
    sections = []
    try:
        for workload in wanted:
            sections.append(_run_workload(workload, base_url, results, out, quick))
        tenants_figures = tenants.run(base_url, *(TENANTS_QUICK if quick else TENANTS)) \
            if not options.engines or "tenants" in options.engines.split(",") else None
    finally:
        stop_serve()
    vllm = vllm_section.run_section(quick) if vllm_section.wanted(options.engines) else None
    elapsed_s = time.monotonic() - started
    report = {"machine": machine(), "quick": quick, "elapsed_s": round(elapsed_s),
              "command": " ".join(["python -m loadtest.run", *sys.argv[1:]]),
              "results": str(results.relative_to(REPO)), "workloads": sections, "vllm": vllm,
              "tenants": tenants_figures}
    (out / "summary.json").write_text(json.dumps(report, indent=2, default=str))
    _write_csv(out / "summary.csv", [row for s in sections for row in s["rows"]])
    from loadtest.markdown import render

    markdown.write_text(render(report, out, markdown.parent))
    progress(f"report written to {markdown} ({elapsed_s / 60:.1f} min)")
    from loadtest.markdown import summary_tables

    print(summary_tables(report))


def _run_workload(workload: Workload, base_url: str, results: Path, out: Path,
                  quick: bool) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    slots: dict[str, Any] = {}
    for baseline in BASELINES:
        spec = _spec(workload, baseline, "steady", workload.users, workload.steady_s)
        if baseline.slot_count:
            if not slots:  # no budget row (e.g. it failed): measure the budget alone
                statuses = deploy(_spec(workload, BASELINES[0], "steady", 1, 1).args(),
                                  base_url)
                undeploy()
                slots = slots_for(spec.args(), statuses, workload.mix)
            spec = replace(spec, max_ongoing_requests=slots["slots"])
        row = run_spec(spec, base_url, results)
        statuses = row.pop("status_before")
        if baseline.name == "budget":
            slots = slots_for(spec.args(), statuses, workload.mix)
            progress(f"slot-count baseline: {slots}")
        row["offered_rps"] = round(workload.users * workload.pace_rps, 2)
        _plot(results / spec.label, row, out, statuses)
        rows.append(row)
    comparison(rows, f"{workload.title}: {workload.mix} mix, "
               f"{workload.users} users x {workload.pace_rps:g} req/s, steady",
               out / f"{workload.key}-steady-comparison.png")
    spikes = []
    budget_row = rows[0]
    if workload.spike and budget_row["throughput_rps"] > 0:
        pace = workload.spike_pace_rps
        base_users = max(1, round(budget_row["throughput_rps"] / pace))
        runs = [("budget", None)]
        if not quick and (budget_row.get("ray_max_ongoing") or 0) < UNBOUNDED_ONGOING:
            # the diagnostic: the same spike without Ray Serve's handle queue (the same run
            # when the budget's derived max_ongoing_requests is already above any queue)
            runs.append((f"budget, max_ongoing {UNBOUNDED_ONGOING}", UNBOUNDED_ONGOING))
        for label, ongoing in runs:
            spec = replace(_spec(workload, BASELINES[0], "spike", base_users, workload.spike_s),
                           max_ongoing_requests=ongoing, pace_rps=pace,
                           label=f"{workload.key}-spike-" + ("budget" if ongoing is None
                                                            else "budget-unbounded"))
            row = run_spec(spec, base_url, results)
            statuses = row.pop("status_before")
            row.update(baseline=label, offered_rps=round(base_users * pace, 2),
                       spike_offered_rps=round(base_users * SPIKE_MULTIPLE * pace, 2),
                       capacity_rps=budget_row["throughput_rps"])
            _plot(results / spec.label, row, out, statuses)
            spikes.append(row)
    return {"engine": workload.engine, "name": workload.key, "goal": workload.goal,
            "title": workload.title, "config": workload.config,
            "mix": workload.mix, "users": workload.users, "pace_rps": workload.pace_rps,
            "spike_pace_rps": workload.spike_pace_rps,
            "steady_s": workload.steady_s, "spike_s": workload.spike_s, "slots": slots,
            "rows": rows, "spikes": spikes}


def _spec(workload: Workload, baseline: Baseline, shape: str, users: int,
          seconds: float) -> RunSpec:
    name = baseline.name.split("(")[0]
    return RunSpec(label=f"{workload.key}-{shape}-{name}", engine=workload.engine,
                   config=workload.config, baseline=baseline, mix=workload.mix, shape=shape,
                   base_users=users, pace_rps=workload.pace_rps,
                   shape_seconds=seconds if seconds != SHAPES[shape].duration_s else 0.0,
                   profile_path=saved_profile(workload.config))


def _plot(run_dir: Path, row: dict[str, Any], out: Path,
          statuses: list[dict[str, Any]]) -> None:
    from loadtest.plots import timeline

    capacity = max((int(s.get("capacity_bytes") or 0) for s in statuses), default=0)
    timeline(run_dir, row, out / f"{run_dir.name}.png", capacity_bytes=capacity or None)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys = [k for k in rows[0] if not isinstance(rows[0][k], (dict, list))] if rows else []
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
