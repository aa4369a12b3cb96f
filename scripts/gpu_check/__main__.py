"""``python -m scripts.gpu_check``: run :mod:`.worker` once per allocator setting, each in
its own process, and print their rows as one table (see the package docstring)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .report import Row, load_rows, save_rows, table

REPO = Path(__file__).resolve().parents[2]
# Wall-clock limits for all settings together (the device call has 8 minutes in all), and
# what each setting after the first is kept at least (the first also builds the models).
TIMEOUT_S = {"cuda": 420, "cpu": 240}
KEEP_FOR_NEXT_S = {"cuda": 150, "cpu": 60}


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


SETTING_NAMES = ("default", "expandable_segments")  # scripts.gpu_check.worker.SETTINGS


def settings_for(device: str, quick: bool) -> list[str]:
    """Both allocator settings, except on CPU with ``--quick`` (they do not apply there; the
    full CPU run still runs both, to keep the per-setting processes working)."""
    if device == "cpu" and quick:
        return ["default"]
    return list(SETTING_NAMES)


def run_setting(device: str, setting: str, workdir: Path, quick: bool,
                timeout_s: float) -> list[Row]:
    """One worker process; a FAIL row when it fails or runs out of time."""
    out = workdir / f"rows-{setting}.json"
    command = [sys.executable, "-m", "scripts.gpu_check.worker", "--device", device,
               "--setting", setting, "--workdir", str(workdir), "--out", str(out)]
    scenario, started = "worker process", time.monotonic()
    try:
        done = subprocess.run(command + (["--quick"] if quick else []), cwd=REPO,
                              stdout=sys.stderr, timeout=max(1.0, timeout_s),
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return [Row(scenario, "finished", f"killed after {timeout_s:.0f} s", "FAIL", setting)]
    if done.returncode != 0 or not out.is_file():
        return [Row(scenario, "exit status", str(done.returncode), "FAIL", setting)]
    wall = Row(scenario, "wall time", f"{time.monotonic() - started:.0f} s", "info", setting)
    return [*load_rows(out), wall]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check",
                                     description="The GPU check without Ray; one table.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--quick", action="store_true", help="smaller models and bursts")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the rows here, and the table beside it (.txt)")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="for all settings together (default: 420 on cuda, 240 on cpu)")
    parser.add_argument("--settings", nargs="+", choices=SETTING_NAMES, default=None,
                        help="allocator settings to run (default: both; one on a --quick "
                             "CPU run)")
    options = parser.parse_args(argv)
    device = options.device or default_device()
    deadline = time.monotonic() + (options.timeout_s or TIMEOUT_S[device])
    rows: list[Row] = []
    settings = options.settings or settings_for(device, options.quick)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        for i, setting in enumerate(settings):
            kept = KEEP_FOR_NEXT_S[device] * (len(settings) - 1 - i)
            rows += run_setting(device, setting, Path(workdir), options.quick,
                                deadline - time.monotonic() - kept)
    failed = sum(row.failed for row in rows)
    text = f"{table(rows)}\ngpu_check on {device}: {len(rows) - failed} figures ok, {failed} failed"
    if options.json is not None:
        save_rows(rows, options.json)
        options.json.with_suffix(".txt").write_text(text + "\n")
    print(text)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
