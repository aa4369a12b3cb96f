"""The pure core imports no Ray, torch or FastAPI, and unit tests cannot start Ray.

Every module of ``serve_app/`` claims to be pure (``serve_app/app.py``, the one place that
knows both sides, excepted), and so do the model-free parts of the engines: the protocol and
registry (the planner and the ingress read engine classes through them) and the fake engine.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import serve_app

NOT_PURE = {"serve_app.app"}
MODEL_FREE = ["deployments.engines.base", "deployments.engines.registry",
              "deployments.engines.words", "deployments.engines.fake"]
FORBIDDEN = ("ray", "torch", "fastapi")


def pure_modules() -> list[str]:
    found = [info.name for info in pkgutil.walk_packages(serve_app.__path__, "serve_app.")]
    return sorted(set(found) - NOT_PURE) + MODEL_FREE


def test_every_module_of_the_core_is_listed() -> None:
    modules = pure_modules()
    assert {"serve_app.request", "serve_app.kinds", "serve_app.pricing",
            "serve_app.replica_state", "serve_app.admission.ticket",
            "serve_app.admission.policy", "serve_app.__main__"} <= set(modules)


def test_the_pure_core_imports_no_ray_torch_or_fastapi() -> None:
    code = (f"import sys\nfor m in {pure_modules()!r}: __import__(m)\n"
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
