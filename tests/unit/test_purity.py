"""The pure core imports no Ray, torch or FastAPI, and unit tests cannot start Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE_MODULES = [
    "serve_app.admission.budget", "serve_app.admission.drain", "serve_app.admission.queue",
    "serve_app.admission.controller", "serve_app.errors", "serve_app.config",
    "serve_app.memory.cost_model", "serve_app.memory.budget", "serve_app.memory.profiler",
    "serve_app.planning", "serve_app.memory.simulated", "serve_app.admission.batching",
    "serve_app.routing", "serve_app.autoscaling", "serve_app.metrics",
    # model-free: torch only when it raises its OOM
    "deployments.engines.fake",
    # the CLI imports the model code only once its arguments are valid
    "serve_app.__main__",
]
FORBIDDEN = ("ray", "torch", "fastapi")


def test_the_pure_core_imports_no_ray_torch_or_fastapi() -> None:
    code = (f"import sys\nfor m in {PURE_MODULES!r}: __import__(m)\n"
            f"print(sorted(m for m in {FORBIDDEN!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_ray_init_is_refused_in_unit_tests() -> None:
    ray = sys.modules.get("ray")
    if ray is None:
        pytest.skip("ray is not installed")
    with pytest.raises(RuntimeError, match="unit tests must not start Ray"):
        ray.init()
