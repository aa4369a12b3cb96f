"""``python -m serve_app`` (or ``vramgate``): command-line tools.

``profile --config CONFIG [--app NAME] [--out PATH]`` loads the model of one application of a
``serve run`` config in this process (no Ray), measures its memory exactly as a model replica
does at start-up (:func:`deployments.profiling.measure_replica`), prints what it measured, the
fitted cost model and the deployment options the measurement recommends
(:func:`serve_app.planning.plan_from_profile`), and saves the profile for
``memory.profile_path``.

Exit status: 0 done; 1 the model could not be loaded (the message says why); 2 bad command
line, config file or ``args:`` (the message names the key); 3 the device cannot hold the
budget the config asks for (:class:`~serve_app.memory.budget.InsufficientMemoryError`), or ran
out of memory while profiling the largest request the limits allow.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from serve_app.admission.policy import policy_class
from serve_app.config import AppArgs, ConfigError, parse_args
from serve_app.memory.budget import InsufficientMemoryError
from serve_app.planning import (
    MAX_ONGOING_REQUESTS_CAP,
    DeploymentPlan,
    p95_request_shapes,
    plan_from_profile,
)

if TYPE_CHECKING:
    from deployments.profiling import MeasuredReplica

IMPORT_PATH = "serve_app.app:build_app"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INSUFFICIENT_MEMORY = 0, 1, 2, 3


class UsageError(Exception):
    """Bad command line or config file: printed without a traceback, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = _parser()
    options = parser.parse_args(argv)  # exits 2 itself on a bad command line
    try:
        return options.command(options)
    except (UsageError, ConfigError) as exc:
        print(f"vramgate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InsufficientMemoryError as exc:
        print(f"vramgate: insufficient memory: {exc}", file=sys.stderr)
        return EXIT_INSUFFICIENT_MEMORY
    except OSError as exc:
        print(f"vramgate: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vramgate", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    profile = commands.add_parser(
        "profile", help="measure a model's memory and recommend deployment options",
        description="Load the model of a serve config's application in this process (no "
        "Ray), measure its memory as a replica does at start-up, print the cost model and the "
        "recommended max_ongoing_requests, budget_bytes and num_gpus, and save the profile.")
    profile.add_argument("--config", required=True, type=Path,
                         help="serve run config YAML, e.g. configs/local.yaml")
    profile.add_argument("--app", default=None, help="application name (default: the first "
                         f"whose import_path is {IMPORT_PATH})")
    profile.add_argument("--out", default=None, type=Path,
                         help="where to write the profile JSON (default: profiles/<app>.json)")
    profile.set_defaults(command=profile_command)
    return parser


def profile_command(options: argparse.Namespace) -> int:
    """``vramgate profile``: see the module docstring."""
    name, raw_args = read_application(options.config, options.app)
    args = profiling_args(parse_args(raw_args))
    out = (options.out or Path("profiles") / f"{name}.json").expanduser().resolve()

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # torch + transformers: imported only once the arguments are known to be valid
    from deployments.engines.registry import engine_class
    from deployments.profiling import measure_replica

    engine = engine_class(args)
    progress(f"loading {engine.describe(args)} for application {name!r} of {options.config}")
    measured = measure_replica(args, on_progress=progress)  # an OOM leaves as InsufficientMemory
    must_fit = policy_class(args.admission.policy).budget_must_hold_largest
    plan = plan_from_profile(
        args, measured.profile, engine.kinds,
        # the whole card, for the recommended GPU share (CUDA's, or the simulated card's)
        card_bytes=getattr(measured.probe, "total_bytes", None),
        min_budget_bytes=measured.max_request_bytes if must_fit else 0,
        source="this measurement")
    measured.profile.save(out)
    print(report(name, options.config, args, measured, plan, out))
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


def read_application(config_path: Path, app_name: str | None) -> tuple[str, dict[str, Any]]:
    """The ``(name, args)`` of the chosen vramgate application of a serve config.

    Raises:
        UsageError: the file is missing or not YAML, has no such application, or the chosen
            one is not a vramgate application (``import_path`` other than ``IMPORT_PATH``).
    """
    try:
        raw = yaml.safe_load(Path(config_path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read config {config_path}: {exc}") from None
    apps = raw.get("applications") if isinstance(raw, dict) else None
    if not isinstance(apps, list) or not all(isinstance(a, dict) for a in apps):
        raise UsageError(f"{config_path}: no `applications:` list (is it a serve run config?)")
    names = [str(a.get("name", "default")) for a in apps]
    if app_name is None:
        ours = [a for a in apps if a.get("import_path") == IMPORT_PATH]
        if not ours:
            raise UsageError(f"{config_path}: no application has import_path {IMPORT_PATH}")
        chosen = ours[0]
    else:
        if app_name not in names:
            raise UsageError(f"{config_path}: no application named {app_name!r} "
                             f"(it has {', '.join(map(repr, names)) or 'none'})")
        chosen = apps[names.index(app_name)]
        if chosen.get("import_path") != IMPORT_PATH:
            raise UsageError(f"{config_path}: application {app_name!r} has import_path "
                             f"{chosen.get('import_path')!r}, not {IMPORT_PATH}")
    return str(chosen.get("name", "default")), chosen.get("args") or {}


def report(name: str, config_path: Path, args: AppArgs, measured: MeasuredReplica,
           plan: DeploymentPlan, out: Path) -> str:
    """The text printed to stdout after a measurement."""
    profile, mem, largest = measured.profile, args.memory, measured.largest
    p95 = " or ".join(_shape(s) for s in p95_request_shapes(args,
                                                             measured.engine_class.kinds))
    lines = [
        f"vramgate profile of application {name!r} in {config_path}",
        f"device:   {profile.device}",
        f"method:   {profile.method}",
        f"capacity: {_bytes(measured.probe.capacity_bytes())}",
        f"held:     {_bytes(profile.held_bytes)}   (the loaded model)",
        f"reserve:  {_bytes(mem.reserve_bytes)}   (memory.reserve_bytes)",
        f"budget:   {_bytes(measured.budget_bytes)}   " + (
            "(memory.budget_bytes)" if mem.budget_bytes is not None
            else f"((capacity - held - reserve) x safety_factor {mem.safety_factor:g})"),
        f"largest request ({_shape(largest)}): {_bytes(measured.max_request_bytes)}",
        f"P95 request ({p95}): {_bytes(plan.request_bytes)}",
        f"profiled in {profile.duration_s:.1f} s",
        "",
        "measurements (MiB):",
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
    lines += [f"  {f:<16} {c:>14.2f}  {units.get(f, '')}"
              for f, c in zip(model.features, model.coefficients, strict=True)]
    lines.append(f"  held-out fit error: {model.fit_error:.1%} (largest |fitted - measured| / "
                 "measured on shapes not used for the fit)")
    lines.append(f"analytic / measured: {low:.2f} .. {high:.2f}")
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
    capped = (f", capped at {MAX_ONGOING_REQUESTS_CAP}"
              if plan.max_ongoing_requests < plan.max_running_estimate + queue else "")
    lines = [
        f"recommended deployment options (admission.policy {args.admission.policy}):",
        f"  max_ongoing_requests: {plan.max_ongoing_requests}   # {running} + {queue} queued "
        f"(admission.max_queue_len){capped}",
        f"  budget_bytes: {plan.budget_bytes}   # {plan.budget_bytes / 2**20:.1f} MiB",
        f"  num_gpus: {gpus}",
    ]
    override = args.deployment.max_ongoing_requests
    if override is not None and override != plan.max_ongoing_requests:
        lines.append(f"  (the config sets deployment.max_ongoing_requests: {override})")
    return lines


def _shape(shape: tuple[int, int, int]) -> str:
    batch, prompt, new = shape
    return f"{batch} x {prompt} tokens" + (f" + {new} new" if new else "")


def _bytes(n: int | None) -> str:
    return "unknown" if n is None else f"{n} bytes ({n / 2**20:.1f} MiB)"


if __name__ == "__main__":
    sys.exit(main())
