"""``vramgate profile --config CONFIG [--app NAME] [--out PATH]``: load the model of one
application of a ``serve run`` config in this process (no Ray), measure its memory exactly as
a model replica does at start-up (:func:`deployments.replica.profiling.measure_replica`), print what
it measured, the fitted cost model and the deployment options the measurement recommends
(:func:`serve_app.planning.plan_from_profile`), and save the profile for
``memory.profile_path``. It measures on the device the replicas will have, so a config whose
replicas run on a GPU is refused on a machine without CUDA."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from serve_app.admission.policy import policy_class
from serve_app.cli import EXIT_FAILED, EXIT_OK, CliError, shape_text
from serve_app.cli.plan import application_allocator, bytes_text
from serve_app.cli.serve_config import read_application
from serve_app.cli.validate import load_args
from serve_app.config import AppArgs
from serve_app.measurement import ALLOCATOR_ENV
from serve_app.planning import (
    DeploymentPlan,
    p95_request_shapes,
    plan_from_profile,
)

if TYPE_CHECKING:
    from deployments.engines.base import Engine
    from deployments.replica.profiling import MeasuredReplica


def profile_command(options: argparse.Namespace) -> int:
    """``vramgate profile``: see the module docstring."""
    app = read_application(options.config, options.app)
    args, engine = load_args(app, options.model)
    args = profiling_args(args)
    if not engine.profiled:
        print(f"vramgate profile: the {args.model.engine_name} engine is not profiled: it sizes "
              "its own KV cache and a replica's budget is that pool, read at start-up; no "
              "profile was written", file=sys.stderr)
        return EXIT_FAILED
    require_cuda_if_needed(args, engine, app.where)
    stem = app.name if options.model is None else f"{app.name}-{args.model.name}"
    out = (options.out or Path("profiles") / f"{stem}.json").expanduser().resolve()

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # Measured under the allocator setting the replicas run with (their runtime_env's): read
    # when CUDA first allocates, so setting it here, before the model loads, is in time.
    os.environ[ALLOCATOR_ENV] = application_allocator(app.entry)
    # torch + transformers: imported only once the arguments are known to be valid
    from deployments.replica.profiling import measure_replica

    progress(f"loading {engine.describe(args)} for application {app.name!r} of "
             f"{options.config} ({ALLOCATOR_ENV}={os.environ[ALLOCATOR_ENV]!r})")
    measured = measure_replica(args, on_progress=progress)  # an OOM leaves as InsufficientMemory
    must_fit = policy_class(args.admission.policy).budget_must_hold_largest
    plan = plan_from_profile(
        args, measured.profile, engine.kinds,
        # the whole card, for the recommended GPU share (CUDA's, or the simulated card's)
        card_bytes=getattr(measured.probe, "total_bytes", None),
        min_budget_bytes=measured.max_request_bytes if must_fit else 0,
        source="this measurement", context=measured.engine.max_seq_tokens)
    measured.profile.save(out)
    print(report(app.name, options.config, args, measured, plan, out))
    return EXIT_OK


def profiling_args(args: AppArgs) -> AppArgs:
    """``args`` as this command measures them: always afresh (``memory.profile_path``, which
    this command replaces, is cleared), and on the device the replica will have: with
    ``model.device: auto`` and ``deployment.num_gpus: 0`` a replica sees no GPU (Ray hides
    them from actors without ``num_gpus``), so neither does the measurement."""
    model = args.model
    if model.device == "auto" and args.deployment.num_gpus == 0:
        model = model.model_copy(update={"device": "cpu"})
    memory = args.memory.model_copy(update={"profile_path": ""})
    return args.model_copy(update={"model": model, "memory": memory})


def require_cuda_if_needed(args: AppArgs, engine: type[Engine], where: str) -> None:
    """Refuse to measure a GPU replica's model on a machine without CUDA: the profile would
    be of another device (a replica on a GPU profiles again), or the load would fail.

    Raises:
        CliError: the replicas run on CUDA (``deployment.num_gpus`` > 0 and ``model.device``
            ``cuda`` or ``auto``) and CUDA is not available here.
    """
    if engine.device_kind(args) != "cuda":
        return
    import torch

    if torch.cuda.is_available():
        return
    asked = ("model.device is cuda" if args.model.device == "cuda" else
             f"deployment.num_gpus is {args.deployment.num_gpus:g} (the replicas run on a GPU)")
    raise CliError(
        f"{where}: {asked} but this machine has no CUDA device; run vramgate profile on a GPU "
        "node of the cluster, or, to profile a CPU replica, set model.device: cpu and "
        "deployment.num_gpus: 0")


def report(name: str, config_path: Path, args: AppArgs, measured: MeasuredReplica,
           plan: DeploymentPlan, out: Path) -> str:
    """The text printed to stdout after a measurement."""
    profile, mem, largest = measured.profile, args.memory, measured.largest
    axes = profile.shape_axes
    p95 = " or ".join(shape_text(s, axes) for s in p95_request_shapes(
        args, measured.engine_class.kinds, measured.engine.max_seq_tokens))
    lines = [
        f"vramgate profile of application {name!r} in {config_path}",
        f"device:   {profile.device}",
        f"method:   {profile.method}",
        f"capacity: {bytes_text(measured.probe.capacity_bytes())}",
        f"held:     {bytes_text(profile.held_bytes)}   (the loaded model)",
        f"reserve:  {bytes_text(mem.reserve_bytes)}   (memory.reserve_bytes)",
        f"budget:   {bytes_text(measured.budget_bytes)}   " + (
            "(memory.budget_bytes)" if mem.budget_bytes is not None
            else f"((capacity - held - reserve) x safety_factor {mem.safety_factor:g})"),
        f"shape axes: {', '.join(axes)}",
        f"largest request ({shape_text(largest, axes)}): {bytes_text(measured.max_request_bytes)}",
        f"P95 request ({p95}): {bytes_text(plan.request_bytes)}",
        f"profiled in {profile.duration_s:.1f} s",
        "",
        "measurements:",
        profile.table(),
        "",
        *_cost_model_lines(measured),
        "",
        *_recommendation_lines(args, plan),
        "",
        f"profile written to {out}",
        "use it in the config's args (the replica then skips profiling if its device and "
        "model still match):",
        "  memory:",
        f"    profile_path: {out}",
    ]
    return "\n".join(lines)


def _cost_model_lines(measured: MeasuredReplica) -> list[str]:
    model = measured.profile.cost_model
    low, high = measured.profile.analytic_ratio_range
    units = {"const": "bytes per request", "batch_tokens": "bytes per input token",
             "batch_prompt": "bytes per prompt token", "batch_prompt_sq": "bytes per input "
             "x prompt token^2"}
    lines = ["cost model: bytes = sum(coefficient x feature)"]
    width = max(16, *(len(f) for f in model.features))
    lines += [f"  {f:<{width}} {c:>14.2f}  {units.get(f, f'bytes per unit of {f}')}"
              for f, c in zip(model.features, model.coefficients, strict=True)]
    lines.append(f"  held-out error: {model.held_out_error:.1%} (largest |fitted - measured| / "
                 "measured on shapes not used for the fit)")
    lines.append(f"analytic / measured: {low:.2f} .. {high:.2f}" if high > 0 else
                 "analytic / measured: none (the engine has no analytic estimate)")
    return lines


def _recommendation_lines(args: AppArgs, plan: DeploymentPlan) -> list[str]:
    queue = args.admission.max_queue_len
    running = f"{plan.max_running_estimate} running ({plan.running_set_by})"
    if plan.min_num_gpus == 0:
        gpus = "0   # CPU replica"
    elif plan.min_num_gpus is None:
        gpus = f"{args.deployment.num_gpus:g}   # card size unknown: keep the configured share"
    else:
        gpus = (f"{plan.min_num_gpus:g}   # smallest 0.05 of the card whose budget holds "
                f"{plan.max_running_estimate} P95 requests")
        if plan.min_num_gpus > 1:
            gpus += " (more than one card: lower the concurrency or the P95 request)"
    lines = [
        f"recommended deployment options (admission.policy {args.admission.policy}):",
        f"  max_ongoing_requests: {plan.max_ongoing_requests}   # "
        f"{plan.ongoing_text(queue)}; {running}",
        f"  budget_bytes: {plan.budget_bytes}   # {plan.budget_bytes / 2**20:.1f} MiB",
        f"  num_gpus: {gpus}",
    ]
    override = args.deployment.max_ongoing_requests
    if override is not None and override != plan.max_ongoing_requests:
        lines.append(f"  (the config sets deployment.max_ongoing_requests: {override})")
    return lines
