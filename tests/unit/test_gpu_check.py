"""The GPU check (``python -m scripts.gpu_check``) on CPU, as CI runs it: its scenarios on the
simulated device pass (profile and held-out check, a concurrent burst through the gate,
batcher and inference thread, a forced out-of-memory error caught and recovered from), and
it needs neither Ray nor FastAPI nor Starlette, which the lent GPU machine does not have."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (scenario, start of the figure) of every row that must read "pass" in a --quick CPU run
# (one allocator setting there: "default").
MUST_PASS = [
    ("fake: profile", "held-out error"),
    ("fake: held-out vs device counters", "max allocated-peak error"),
    ("fake: burst", "answered ok"),
    ("fake: burst", "out-of-memory errors"),
    ("fake: burst", "gate peak reserved <= budget"),
    ("fake: burst", "device peak - idle <= budget (allocated)"),
    ("fake: burst", "device peak - idle <= budget / safety (reserved)"),
    ("fake: burst", "gate idle after"),
    ("fake: forced OOM", "forced request answered"),
    ("fake: forced OOM", "out-of-memory errors caught"),
    ("fake: forced OOM", "budget shrunk"),
    ("fake: forced OOM", "device fault"),
    ("fake: forced OOM", "answered ok after the memory came back"),
    ("fake: forced OOM", "gate idle after"),
    ("fake: throughput", "tokens (bare, replica)"),
    ("generate: burst", "answered ok"),
    ("generate: burst", "out-of-memory errors"),
    ("generate: burst", "gate idle after"),
]

BLOCKER = """
import importlib, sys
BLOCKED = ("ray", "fastapi", "starlette")
attempts = []
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
        return None
sys.meta_path.insert(0, Blocker())
for module in sys.argv[1:]:
    importlib.import_module(module)
print({"attempts": attempts,
       "loaded": [m for m in sys.modules if m.split(".")[0] in BLOCKED]})
"""
# Everything the check runs: its own modules, and what they load lazily (the engines).
CHECK_MODULES = ["scripts.gpu_check.__main__", "scripts.gpu_check.worker",
                 "scripts.gpu_check.scenarios", "scripts.gpu_check.models",
                 "scripts.gpu_check.throughput",
                 "deployments.engines.fake", "deployments.engines.generation",
                 "deployments.engines.embeddings", "tests.support"]


def test_the_quick_cpu_check_passes(tmp_path: Path) -> None:
    rows_path = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--device", "cpu",
                           "--quick", "--json", str(rows_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    print(done.stdout, done.stderr[-3000:])
    assert done.returncode == 0
    assert "scenario" in done.stdout and "gpu_check on cpu:" in done.stdout
    rows = json.loads(rows_path.read_text())
    assert not [row for row in rows if row["status"] == "FAIL"]
    for scenario, figure in MUST_PASS:
        found = [row for row in rows if row["setting"] == "default"
                 and row["scenario"] == scenario and row["figure"].startswith(figure)]
        assert [row["status"] for row in found] == ["pass"], (scenario, figure)


def test_the_check_imports_no_ray_fastapi_or_starlette() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKER, *CHECK_MODULES], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str({"attempts": [], "loaded": []})
