"""The load-test machinery: start the service from a config, run a locust scenario, scrape
``/metrics`` during it, write CSV, JSON and PNG. Loopback only, bounded in time. The command
line is :mod:`loadtest.run`; the side-by-side report is :mod:`loadtest.report`.

One local Ray (started here, on a free port of 127.0.0.1) serves each run in turn: the app is
deployed from the config's ``args:`` with the baseline's overrides, loaded by ``locust
--headless`` in a subprocess (gevent and Ray stay in separate processes), scraped every
:data:`SCRAPE_PERIOD_S` by a thread here, checked against the idle invariants (nothing
reserved or queued, every charged byte released) once the load stops, and deleted. Each
run's files go to ``<results>/<label>/``: locust's ``locust_stats.csv``,
``locust_stats_history.csv`` (per second, per entry) and ``locust_failures.csv``;
``outcomes.json`` (the locustfile's merged figures and contract checks); ``metrics.csv``
(every scraped ``vramgate_*`` sample); ``status.json`` (replica status before and after);
``summary.json`` (the table row); ``timeline.png``.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.scenarios import SHAPES, Baseline, apply_overrides
from loadtest.summary import Sample, idle_problems, parse_exposition, run_row

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "loadtest" / "results"
APP_NAME = "vramgate"
SCRAPE_PERIOD_S = 1.0  # the replicas publish their metrics once a second (replica_registry.py)
SETTLE_S = 2.5  # after the load: two publish periods, so the last scrape holds every count
LOCUST_GRACE_S = 60.0  # locust's start-up and shutdown on top of the shape's duration
# Users removed by the shape (or at the end) finish the request they are waiting for, within
# this: every request sent is recorded (locust would otherwise drop the slow in-flight ones).
STOP_TIMEOUT_S = 30


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run: a config with a baseline's overrides, under a mix and shape of users.

    Attributes:
        label: file-safe id, also the results sub-folder.
        engine: a short name for tables (``fake``, ``minilm``).
        config: a ``serve run`` YAML; its first application's ``args:`` are deployed.
        shape_seconds: the shape stretched to this many seconds (0: as defined).
        max_ongoing_requests: set for the slot-count baseline (see
            :func:`loadtest.prices.slots_for`).
    """

    label: str
    engine: str
    config: str
    baseline: Baseline
    mix: str
    shape: str
    base_users: int
    pace_rps: float
    shape_seconds: float = 0.0
    seed: int = 0
    max_ongoing_requests: int | None = None
    profile_path: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)

    def args(self) -> dict[str, Any]:
        """The app's ``args:``: the config's, with the baseline's and the run's overrides."""
        overrides = {**self.baseline.overrides, **self.overrides}
        if self.max_ongoing_requests is not None:
            overrides["deployment.max_ongoing_requests"] = self.max_ongoing_requests
        if self.profile_path:
            overrides["memory.profile_path"] = self.profile_path
        return apply_overrides(config_args(self.config), overrides)

    def duration_s(self) -> float:
        return self.shape_seconds or SHAPES[self.shape].duration_s


def config_args(path: str | Path) -> dict[str, Any]:
    """The ``args:`` of the first application of a ``serve run`` YAML.

    Raises:
        ValueError: the file has no application with ``args``.
    """
    config = yaml.safe_load((REPO / path).read_text())
    apps = config.get("applications") or []
    if not apps or "args" not in apps[0]:
        raise ValueError(f"{path}: no applications[0].args")
    return apps[0]["args"]


def saved_profile(config: str) -> str:
    """For a fake-engine config, a memory profile measured once (``python -m serve_app
    profile``, again whenever the config is newer) for every run to reuse: the fake engine's
    costs are exact, and profiling it takes ~15 s of simulated time per deployment. ``""`` for
    other configs: a real model's replica measures itself at start-up, as in production.

    Raises:
        subprocess.CalledProcessError: the profile command failed (its output is attached).
    """
    if config_args(config).get("model", {}).get("task") != "fake":
        return ""
    path = RESULTS / "profiles" / f"{Path(config).stem}.json"
    if not path.exists() or path.stat().st_mtime < (REPO / config).stat().st_mtime:
        path.parent.mkdir(parents=True, exist_ok=True)
        progress(f"profiling {config} once for every run")
        subprocess.run([sys.executable, "-m", "serve_app", "profile", "--config",
                        str(REPO / config), "--out", str(path)], cwd=REPO, check=True,
                       capture_output=True, timeout=300)
    return str(path)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the service --------------------------------------------------------------------------

def start_serve() -> str:
    """Start a local Ray and Serve's HTTP proxy on a free loopback port; return its URL."""
    import ray
    from ray import serve

    from tests.support import free_port

    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False, object_store_memory=256 * 1024 * 1024)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def stop_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def deploy(args: dict[str, Any], base_url: str,
           headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Deploy ``args`` as the app at ``/`` and wait until it is ready; return the replicas'
    statuses (read with ``headers``: a key, when ``args`` configure one)."""
    from ray import serve

    from serve_app.app import build_app
    from tests.support import wait_until_ready

    serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
    wait_until_ready(base_url, timeout_s=300)
    return replica_statuses(base_url, headers)


def undeploy() -> None:
    from ray import serve

    serve.delete(APP_NAME)


def replica_statuses(base_url: str,
                     headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 30
    while True:
        replicas = httpx.get(f"{base_url}/v1/status", headers=headers,
                             timeout=10).json()["replicas"]
        if replicas or time.monotonic() > deadline:
            return replicas
        time.sleep(0.5)


# --- scraping -----------------------------------------------------------------------------

class Scraper(threading.Thread):
    """Scrapes ``GET /metrics`` every ``period_s`` until :meth:`stop`; keeps every
    ``vramgate_*`` sample with the time it was taken."""

    def __init__(self, base_url: str, period_s: float = SCRAPE_PERIOD_S) -> None:
        super().__init__(daemon=True, name="metrics-scraper")
        self.base_url, self.period_s = base_url, period_s
        self.rows: list[tuple[float, str, dict[str, str], float]] = []
        self.errors = 0
        self._stop_event = threading.Event()

    def scrape(self) -> list[Sample]:
        """One scrape (raises httpx.HTTPError or ValueError on a bad answer)."""
        response = httpx.get(f"{self.base_url}/metrics", timeout=10)
        response.raise_for_status()
        return parse_exposition(response.text)

    def run(self) -> None:
        while not self._stop_event.is_set():
            started = time.time()
            try:
                self.rows += [(started, *sample) for sample in self.scrape()]
            except (httpx.HTTPError, ValueError):
                self.errors += 1
            self._stop_event.wait(max(0.0, self.period_s - (time.time() - started)))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=15)

    def write_csv(self, path: Path) -> None:
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["unix_s", "name", "labels", "value"])
            for t, name, labels, value in self.rows:
                writer.writerow([f"{t:.3f}", name, json.dumps(labels, sort_keys=True), value])


# --- one run ------------------------------------------------------------------------------

def run_locust(spec: RunSpec, base_url: str, out_dir: Path) -> dict[str, Any]:
    """``locust --headless`` with the spec's mix and shape against ``base_url``; returns the
    locustfile's summary (``outcomes.json``).

    Raises:
        RuntimeError: locust exited without writing its summary (its output is in
            ``locust.log``).
    """
    summary_path = out_dir / "outcomes.json"
    command = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"),
               "--headless", "--host", base_url, "--only-summary", "--loglevel", "WARNING",
               "--stop-timeout", str(STOP_TIMEOUT_S),
               "--csv", str(out_dir / "locust"), "--csv-full-history", "--exit-code-on-error",
               "0", "--mix", spec.mix, "--shape", spec.shape, "--base-users",
               str(spec.base_users), "--pace-rps", str(spec.pace_rps), "--shape-seconds",
               str(spec.shape_seconds), "--seed", str(spec.seed), "--summary-json",
               str(summary_path)]
    with (out_dir / "locust.log").open("w") as log:
        subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False,
                       timeout=spec.duration_s() + LOCUST_GRACE_S)
    if not summary_path.exists():
        raise RuntimeError(f"locust wrote no summary; see {out_dir / 'locust.log'}")
    return json.loads(summary_path.read_text())


def run_spec(spec: RunSpec, base_url: str, results: Path) -> dict[str, Any]:
    """Deploy, load, scrape, check and delete one run; returns its summary row (also written
    to ``summary.json``) with the replicas' statuses under ``status_before``."""
    out_dir = results / spec.label
    out_dir.mkdir(parents=True, exist_ok=True)
    args = spec.args()
    progress(f"{spec.label}: deploying ({spec.baseline.name})")
    status_before = deploy(args, base_url)
    try:
        scraper = Scraper(base_url)
        before = scraper.scrape()
        scraper.start()
        progress(f"{spec.label}: {spec.shape} x {spec.base_users} users at "
                 f"{spec.pace_rps:g} req/s each for {spec.duration_s():.0f} s")
        try:
            outcomes = run_locust(spec, base_url, out_dir)
        finally:
            time.sleep(SETTLE_S)
            scraper.stop()
        after = scraper.scrape()
        scraper.write_csv(out_dir / "metrics.csv")
        from tests.support import settled_status

        status_after = settled_status(base_url, timeout_s=30)
    finally:
        undeploy()
    admission = args.get("admission", {})
    max_wait_s = float(admission.get("max_queue_wait_s", 10.0))
    ray_max_ongoing = planned_max_ongoing(args)
    row = {"label": spec.label, "engine": spec.engine, "baseline": spec.baseline.name,
           "policy": admission.get("policy", "budget"),
           "mix": spec.mix, "shape": spec.shape, "base_users": spec.base_users,
           "peak_users": round(spec.base_users * SHAPES[spec.shape].peak_multiple()),
           "pace_rps": spec.pace_rps, "max_queue_wait_s": max_wait_s,
           "max_ongoing_requests": spec.max_ongoing_requests, "ray_max_ongoing": ray_max_ongoing,
           **run_row(outcomes, before, after, max_wait_s),
           "leaks": idle_problems(status_after), "audit": outcomes.get("audit", {}),
           "status_codes": outcomes.get("status_codes", {}), "by_kind": outcomes["by_kind"],
           "retry_after_s": outcomes.get("retry_after_s", {}),
           "scrape_errors": scraper.errors}
    (out_dir / "status.json").write_text(json.dumps(
        {"before": status_before, "after": status_after}, indent=2, default=str))
    (out_dir / "summary.json").write_text(json.dumps(
        {"spec": {**asdict(spec), "baseline": spec.baseline.name}, "row": row,
         "outcomes": outcomes}, indent=2, default=str))
    from loadtest.plots import timeline

    capacity = max((int(r.get("capacity_bytes") or 0) for r in status_before), default=0)
    timeline(out_dir, row, out_dir / "timeline.png", capacity_bytes=capacity or None)
    progress(f"{spec.label}: {row['ok']} ok ({row['throughput_rps']} req/s), p50 "
             f"{row['p50_ms']} ms, p99 {row['p99_ms']} ms, refused {row['refused']}, OOM "
             f"{row['oom']}, 5xx {row['5xx']}, leaks {row['leaks'] or 'none'}")
    return {**row, "status_before": status_before}


def planned_max_ongoing(raw_args: dict[str, Any]) -> int:
    """The ``max_ongoing_requests`` the app derives for these ``args:`` (as ``build_app``
    does: :func:`serve_app.planning.plan_deployment` for the config's engine)."""
    from deployments.engines.registry import engine_class
    from serve_app.config import parse_args
    from serve_app.planning import plan_deployment

    args = parse_args(raw_args)
    return plan_deployment(args, engine_class(args)).max_ongoing_requests
