"""PNG plots of load-test runs (matplotlib, Agg backend: no display needed).

- :func:`timeline`: one run over time, four panels: latency percentiles of admitted (2xx)
  requests per kind; throughput by outcome beside the offered load; refusals and failures per
  second; gate use (reserved / budget), device memory and queue depth.
- :func:`comparison`: the baselines of one workload side by side: throughput, p50/p99, and
  refusals, OOMs and other failures.

Inputs are the files a run leaves (``locust_stats_history.csv``, ``metrics.csv``) and the rows
of :func:`loadtest.summary.run_row`.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.outcomes import Outcome, split_entry_name  # noqa: E402

GiB = 1 << 30
OUTCOME_COLORS = {"ok": "tab:green", "refused": "tab:orange", "oom": "tab:red",
                  "5xx": "tab:purple", "4xx": "tab:brown", "error": "black",
                  "aborted": "tab:gray"}


def _history(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return [row for row in csv.DictReader(f) if row["Name"] != "Aggregated"]


def _metrics(path: Path) -> dict[str, list[tuple[float, dict[str, str], float]]]:
    series: dict[str, list[tuple[float, dict[str, str], float]]] = defaultdict(list)
    with path.open() as f:
        for row in csv.DictReader(f):
            series[row["name"]].append((float(row["unix_s"]), json.loads(row["labels"]),
                                        float(row["value"])))
    return series


def _per_scrape(samples: Sequence[tuple[float, dict[str, str], float]], t0: float,
                ) -> tuple[list[float], list[float]]:
    """Values summed over replicas per scrape time, as ``(seconds since t0, values)``."""
    by_time: dict[float, float] = defaultdict(float)
    for t, _, value in samples:
        by_time[t] += value
    times = sorted(by_time)
    return [t - t0 for t in times], [by_time[t] for t in times]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # locust writes "N/A" before an entry's first request


def timeline(run_dir: Path, row: Mapping[str, Any], png: Path,
             capacity_bytes: int | None = None) -> None:
    """Plot one run (see module docstring) from the files in ``run_dir`` to ``png``."""
    history = _history(run_dir / "locust_stats_history.csv")
    metrics = _metrics(run_dir / "metrics.csv")
    t0 = min((float(r["Timestamp"]) for r in history), default=0.0)
    fig, axes = plt.subplots(4, 1, figsize=(10, 13), sharex=True)
    _latency_panel(axes[0], history, t0, row)
    _throughput_panel(axes[1], history, t0, row)
    _failure_panel(axes[2], history, t0)
    _gate_panel(axes[3], metrics, t0, row, capacity_bytes)
    axes[3].set_xlabel("seconds since the load started")
    fig.suptitle(f"{row['engine']} / {row['baseline']}: {row['mix']} mix, {row['shape']} "
                 f"shape, {row['base_users']} users at {row['pace_rps']:g} req/s each")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)


def _latency_panel(ax: Any, history: Sequence[dict[str, str]], t0: float,
                   row: Mapping[str, Any]) -> None:
    by_kind: dict[str, list[tuple[float, float | None, float | None]]] = defaultdict(list)
    for r in history:
        kind, outcome = split_entry_name(r["Name"])
        if outcome is Outcome.OK:
            by_kind[kind].append((float(r["Timestamp"]) - t0, _number(r["50%"]),
                                  _number(r["99%"])))
    for i, (kind, points) in enumerate(sorted(by_kind.items())):
        color = f"C{i}"
        ts = [p[0] for p in points]
        ax.plot(ts, [p[2] for p in points], color=color, label=kind)
        ax.plot(ts, [p[1] for p in points], color=color, linestyle=":")
    ax.axhline(1000 * row["max_queue_wait_s"], color="black", linewidth=0.8, linestyle="--",
               label="max_queue_wait_s")
    ax.set_ylabel("2xx latency, ms: p99 solid,\np50 dotted (locust, last 10 s)")
    ax.legend(fontsize=7, ncol=4, loc="upper left")


def _rates(history: Sequence[dict[str, str]], t0: float) -> dict[str, dict[float, float]]:
    rates: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for r in history:
        _, outcome = split_entry_name(r["Name"])
        rates[outcome.value][float(r["Timestamp"]) - t0] += _number(r["Requests/s"]) or 0.0
    return rates


def _throughput_panel(ax: Any, history: Sequence[dict[str, str]], t0: float,
                      row: Mapping[str, Any]) -> None:
    rates = _rates(history, t0)
    users: dict[float, float] = {}
    for r in history:
        users[float(r["Timestamp"]) - t0] = float(r["User Count"])
    times = sorted(users)
    ax.plot(times, [users[t] * row["pace_rps"] for t in times], color="black", linestyle="--",
            linewidth=0.8, label="offered (users x pace)")
    for outcome in ("ok", "refused"):
        if outcome in rates:
            ts = sorted(rates[outcome])
            ax.plot(ts, [rates[outcome][t] for t in ts], color=OUTCOME_COLORS[outcome],
                    label=f"{outcome} req/s")
    ax.set_ylabel("requests / s")
    ax.legend(fontsize=7, loc="upper left")


def _failure_panel(ax: Any, history: Sequence[dict[str, str]], t0: float) -> None:
    rates = _rates(history, t0)
    for outcome in ("refused", "oom", "5xx", "4xx", "error", "aborted"):
        if outcome in rates:
            ts = sorted(rates[outcome])
            ax.plot(ts, [rates[outcome][t] for t in ts], color=OUTCOME_COLORS[outcome],
                    label=outcome)
    ax.set_ylabel("refusals and failures / s")
    ax.legend(fontsize=7, ncol=6, loc="upper left")


def _gate_panel(ax: Any, metrics: Mapping[str, Sequence[Any]], t0: float,
                row: Mapping[str, Any], capacity_bytes: int | None) -> None:
    reserved = _per_scrape(metrics.get("vramgate_reserved_bytes", []), t0)
    budget = _per_scrape(metrics.get("vramgate_budget_bytes", []), t0)
    if row.get("policy") in ("budget", "semaphore") and budget[1]:
        use = [100 * r / b if b else 0.0 for r, b in zip(reserved[1], budget[1], strict=False)]
        ax.plot(reserved[0][:len(use)], use, color="tab:blue",
                label="gate: reserved / budget, %")
    device_name = ("vramgate_device_allocated_bytes"
                   if metrics.get("vramgate_device_allocated_bytes")
                   else "vramgate_host_resident_bytes")
    device = _per_scrape(metrics.get(device_name, []), t0)
    if device[1] and capacity_bytes:
        ax.plot(device[0], [100 * v / capacity_bytes for v in device[1]], color="tab:red",
                label=f"{device_name.removeprefix('vramgate_')} / capacity, %")
    ooms = _per_scrape(metrics.get("vramgate_ooms_total", []), t0)
    oom_times = [t for t, before, after in zip(ooms[0][1:], ooms[1], ooms[1][1:], strict=False)
                 if after > before]
    if oom_times:
        ax.plot(oom_times, [100.0] * len(oom_times), "x", color="black", markersize=8,
                label="replica OOM(s) in this second")
    ax.set_ylabel("% of budget or device")
    ax.set_ylim(bottom=0, top=110)
    twin = ax.twinx()
    queue = _per_scrape(metrics.get("vramgate_queue_depth", []), t0)
    twin.plot(queue[0], queue[1], color="tab:gray", linestyle=":", label="queue depth")
    twin.set_ylabel("requests waiting for a lease")
    lines = ax.get_legend_handles_labels()
    twin_lines = twin.get_legend_handles_labels()
    ax.legend(lines[0] + twin_lines[0], lines[1] + twin_lines[1], fontsize=7, loc="upper left")


def comparison(rows: Sequence[Mapping[str, Any]], title: str, png: Path) -> None:
    """Baselines of one workload side by side (see module docstring)."""
    names = [r["baseline"] for r in rows]
    xs = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(xs, [r["throughput_rps"] for r in rows], color="tab:green")
    axes[0].set_title("throughput (2xx / s)")
    width = 0.4
    axes[1].bar([x - width / 2 for x in xs], [r["p50_ms"] or 0 for r in rows], width,
                label="p50")
    axes[1].bar([x + width / 2 for x in xs], [r["p99_ms"] or 0 for r in rows], width,
                label="p99")
    axes[1].set_title("2xx latency (ms)")
    axes[1].legend(fontsize=8)
    bottom = [0.0] * len(rows)
    for outcome in ("refused", "oom", "5xx", "4xx", "error"):
        values = [float(r[outcome]) for r in rows]
        axes[2].bar(xs, values, bottom=bottom, color=OUTCOME_COLORS[outcome], label=outcome)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[2].set_title("non-2xx responses")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(xs), names, rotation=15, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
