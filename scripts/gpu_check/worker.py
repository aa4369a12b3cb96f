"""One allocator setting of the check, in its own process (``PYTORCH_CUDA_ALLOC_CONF`` is
read when CUDA initialises, so each setting needs a fresh process): builds the model
directories if an earlier setting did not, then for each engine of the plan loads it,
profiles it (``measure_replica``, as a replica at start-up), and runs the scenarios of
:mod:`.scenarios`; writes the rows as JSON.

``python -m scripts.gpu_check.worker --device cuda --setting expandable_segments
--workdir DIR --out rows.json [--quick]``. Run by ``python -m scripts.gpu_check``.

Ray, FastAPI and Starlette are made unimportable first, as on the GPU machine, which has
none of them: the check must not need them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import platform
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from .report import Row, check, info, save_rows, under

ABSENT_ON_DEVICE = ("ray", "fastapi", "starlette")
# "default" is PyTorch's own allocator, named explicitly: a replica otherwise defaults to
# expandable segments (deployments.engines.devices.DEFAULT_CUDA_ALLOC_CONF).
SETTINGS = {"default": "expandable_segments:False",
            "expandable_segments": "expandable_segments:True"}


def set_allocator(setting: str) -> None:
    """Set PyTorch's CUDA allocator configuration for this process (before torch is
    imported: it is read when CUDA initialises). ``PYTORCH_ALLOC_CONF``, its newer name,
    gets the same value, so that neither overrides the other."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        os.environ.pop(name, None)
        if SETTINGS[setting]:
            os.environ[name] = SETTINGS[setting]


def forbid_imports(names: tuple[str, ...] = ABSENT_ON_DEVICE) -> None:
    """``import ray`` (etc.) raises ModuleNotFoundError from now on, and
    ``importlib.util.find_spec`` says it is absent, as where it is not installed."""
    for name in names:
        if name in sys.modules:
            raise RuntimeError(f"{name} was imported before the check started")
        sys.modules[name] = None  # type: ignore[assignment]


def _progress(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def environment_rows(device: str, setting: str) -> list:
    """What ran: versions, the device, the allocator setting (checked on CUDA where the
    allocator's snapshot says whether its segments are expandable)."""
    import torch
    import transformers

    scenario = "environment"
    rows = [info(scenario, "python / torch / transformers",
                 f"{platform.python_version()} / {torch.__version__} / "
                 f"{transformers.__version__}"),
            info(scenario, "PYTORCH_CUDA_ALLOC_CONF",
                 os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or "(unset)")]
    if device != "cuda":
        return rows + [info(scenario, "device", "cpu (allocator settings do not apply)")]
    props = torch.cuda.get_device_properties(0)
    rows.append(info(scenario, "device", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
    rows.append(info(scenario, "driver / torch's CUDA", f"{driver_version()} / "
                                                       f"{torch.version.cuda}"))
    probe = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    segments = torch.cuda.memory._snapshot().get("segments", [])
    flags = {seg.get("is_expandable") for seg in segments}
    del probe
    torch.cuda.empty_cache()
    expected = setting == "expandable_segments"
    if flags <= {True, False} and flags:
        rows.append(check(scenario, "segments expandable", str(sorted(flags)),
                          flags == {expected}))
    return rows


def driver_version() -> str:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it, or ``"unknown"``."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "unknown"


def guarded(scenario: str, work: Callable[[], list]) -> list:
    """``work()``'s rows, or one FAIL row naming the exception it raised (its traceback on
    stderr), so that one broken scenario does not hide the others' figures."""
    try:
        return work()
    except Exception as exc:
        traceback.print_exc()
        return [Row(scenario, "raised", f"{type(exc).__name__}: {str(exc)[:100]}", "FAIL")]


def load_engine(spec, tag: str, device: str, models: Path):
    """Build the model directory if needed, load the engine and profile it on a new
    inference thread, as a replica does at start-up (``measure_replica``, on the thread that
    then serves). Returns the :class:`.scenarios.Loaded` engine."""
    from deployments.replica.profiling import measure_replica
    from serve_app.config import parse_args

    from .models import ensure_model
    from .scenarios import InferenceThread, Loaded

    raw = spec.raw_args
    if spec.model is not None:
        path = ensure_model(models, *spec.model, device)
        raw = {**raw, "model": {**raw["model"], "path": str(path)}}
    args = parse_args(raw)
    _progress(f"{tag}: loading and profiling")
    thread = InferenceThread()
    try:
        measured = thread.submit(measure_replica, args, lambda _: None).result()
    except BaseException:
        thread.close()
        raise
    _progress(f"{tag}: memory profile (MiB; the table behind its rows)\n"
              f"{measured.profile.table()}")
    return Loaded(args, measured, thread)


def run_engine(spec, tag: str, device: str, models: Path, rng: random.Random) -> list:
    """Load, profile and drive one engine of the plan; returns its rows."""
    loaded = guarded(f"{tag}: profile", lambda: [load_engine(spec, tag, device, models)])
    if isinstance(loaded[0], Row):
        return loaded
    try:
        return _scenarios(spec, tag, loaded[0], rng)
    finally:
        loaded[0].on_thread(loaded[0].measured.engine.close)
        loaded[0].executor.close()


def _scenarios(spec, tag: str, loaded, rng: random.Random) -> list:
    from . import scenarios
    from .meters import make_meter
    from .throughput import throughput_rows

    measured = loaded.measured
    meter = make_meter(spec.meter, measured.engine)
    rows = scenarios.profile_rows(tag, measured, spec)
    if meter is not None and spec.held_out:
        rows += guarded(f"{tag}: held-out", lambda: scenarios.held_out_rows(
            tag, loaded, meter, spec, rng))
    _progress(f"{tag}: burst of {spec.burst}")
    rows += guarded(f"{tag}: burst", lambda: asyncio.run(scenarios.burst_rows(
        tag, loaded, meter, spec, rng)))
    if spec.throughput is not None:
        _progress(f"{tag}: throughput, bare and through the replica")
        rows += guarded(f"{tag}: throughput", lambda: asyncio.run(throughput_rows(
            tag, loaded, meter, spec, rng)))
    if spec.oom:
        _progress(f"{tag}: forced out-of-memory error")
        rows += guarded(f"{tag}: forced OOM", lambda: asyncio.run(scenarios.oom_rows(
            tag, loaded, meter, rng)))
    return rows


def run(device: str, setting: str, workdir: Path, quick: bool) -> list:
    """Every engine of the device's plan under one allocator setting."""
    from .plan import cpu_plan, cuda_plan

    rows = guarded("environment", lambda: environment_rows(device, setting))
    plan = cuda_plan(quick) if device == "cuda" else cpu_plan(quick)
    for spec in plan:
        rows += run_engine(spec, spec.name, device, workdir / "models",
                           random.Random(f"{spec.name}-{setting}"))
        gc.collect()
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--setting", choices=tuple(SETTINGS), required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args(argv)
    if "torch" in sys.modules:
        raise RuntimeError("torch was imported before the allocator could be configured")
    set_allocator(options.setting)
    forbid_imports()
    # Models are built here; nothing is fetched (the GPU machine reaches no hub).
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                        ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(name, value)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    (options.workdir / "models").mkdir(parents=True, exist_ok=True)
    rows = run(options.device, options.setting, options.workdir, options.quick)
    save_rows(under(options.setting, rows), options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
