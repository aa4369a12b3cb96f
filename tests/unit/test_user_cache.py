"""The suite keeps out of the user's caches: every test run has its own measurement cache and
job store directories (``VRAMGATE_CACHE_DIR``, set in ``tests/conftest.py`` for the test
process and every process it starts), so what a user's ``serve run`` left in
``~/.cache/vramgate`` changes no test, and no test leaves anything there."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from deployments.engines.registry import engine_class
from serve_app.cli.plan import application_allocator
from serve_app.config import parse_args
from serve_app.measurement import (
    Measurement,
    MeasurementCache,
    measurement_identity,
    measurement_key,
)
from serve_app.user_cache import CACHE_DIR_ENV, user_cache_dir

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "configs" / "fake.yaml"
PLAN_TEST = ("tests/unit/test_cli_validate.py::"
             "test_plan_prints_what_plan_deployment_derives")


def test_each_test_run_has_its_own_caches(tmp_path_factory) -> None:
    root = Path(os.environ[CACHE_DIR_ENV])
    assert root.is_relative_to(tmp_path_factory.getbasetemp())
    args = parse_args({"model": {"task": "fake"}})
    assert Path(args.memory.measurement_cache_dir) == root / "measurements"
    assert Path(args.jobs.data_dir) == root / "jobs"
    assert user_cache_dir("jobs") == str(root / "jobs")


def _poison(home: Path) -> None:
    """What ``serve run configs/fake.yaml`` on a machine that declared a GPU leaves in
    ``home``'s ``~/.cache/vramgate``: a measurement under the key of ``configs/fake.yaml``
    (the profile of a smaller fake model: its figures differ from the analytic estimate),
    and a job store directory of the model ``fake``."""
    from deployments.replica.profiling import measure_replica

    entry = yaml.safe_load(FAKE.read_text())["applications"][0]
    args = parse_args(entry["args"])
    identity = {**measurement_identity(args, engine_class(args).profile_identity(args)),
                "allocator": application_allocator(entry)}
    small = parse_args({"model": {"task": "fake"}, "deployment": {"num_gpus": 0.5},
                        "fake": {"latency_per_token_s": 0},
                        "limits": {"max_inputs": 2, "max_input_tokens": 32, "max_tokens": 8}})
    measured = measure_replica(small, on_progress=lambda line: None)
    cache = home / ".cache" / "vramgate"
    MeasurementCache(cache / "measurements").put(Measurement(
        key=measurement_key(identity), identity=identity, device_name="NVIDIA H200",
        card_bytes=150 << 30, profile=measured.profile,
        max_request_bytes=measured.max_request_bytes, measured_at=time.time()))
    (cache / "jobs" / "fake").mkdir(parents=True)


def test_what_a_user_cached_changes_no_test(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _poison(home)
    env = {**{k: v for k, v in os.environ.items() if k != CACHE_DIR_ENV}, "HOME": str(home)}
    # Outside the suite the poison bites: plan reads the user's measurement.
    plan = subprocess.run([sys.executable, "-m", "serve_app", "plan", str(FAKE)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert "  from:                 cached measurement " in plan.stdout, plan.stdout
    # Inside it, not: the test that expects the analytic estimate passes.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          PLAN_TEST], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
    # ... and it left nothing in the user's caches.
    assert sorted(p.name for p in (home / ".cache" / "vramgate").iterdir()) == \
        ["jobs", "measurements"]
    assert [p.name for p in (home / ".cache" / "vramgate" / "jobs").iterdir()] == ["fake"]
    assert not any((home / ".cache" / "vramgate" / "jobs" / "fake").iterdir())
