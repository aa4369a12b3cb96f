"""``vramgate plan CONFIG...``: what each model replica of each vramgate application will get
(its GPU share, byte budget, ``max_ongoing_requests`` and ``max_queued_requests``) and which
measurement or estimate the figures come from: :func:`serve_app.planning.plan_deployment`,
the computation ``serve run`` makes where it builds the application (from the measurement it
made on the cluster when that is cached where this machine can read it:
:func:`cached_measurement`), printed by :func:`plan_lines`. Without Ray; a config with any
problem (``vramgate validate``'s) is not planned."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from serve_app.cli import EXIT_FAILED, EXIT_OK, print_error, print_warning, shape_text
from serve_app.cli.serve_config import IMPORT_PATH, ServeApp
from serve_app.cli.validate import CheckedApp, check_config
from serve_app.config import AppArgs
from serve_app.measurement import (
    ALLOCATOR_ENV,
    Measurement,
    MeasurementCache,
    allocator_setting,
    measured_before_deploy,
    measurement_identity,
    measurement_key,
)
from serve_app.memory.budget import InsufficientMemoryError
from serve_app.placement import (
    FEWEST,
    INITIAL,
    MOST,
    gpu_packing,
    packing_problem,
    replica_count,
)
from serve_app.planning import (
    DeploymentPlan,
    model_context,
    p95_request_shapes,
    plan_deployment,
)

if TYPE_CHECKING:
    from serve_app.planning import EngineSpec

DEVICES = {"cpu": "CPU", "cuda": "a CUDA GPU", "simulated": "its simulated card"}
"""An engine's ``device_kind`` in words."""


def plan_command(options: argparse.Namespace) -> int:
    """``vramgate plan``: each vramgate application's plan (stdout); every problem of a
    config instead (stderr, one line each) and exit status 1."""
    failed = False
    for path in options.configs:
        problems, checked = check_config(path)
        problems += [line for c in checked for line in c.problems]
        planned = [c for c in checked if c.planned]
        if not problems and not planned:
            problems.append(f"{path}: no application has import_path {IMPORT_PATH}")
        for line in problems:
            print_error(line)
        for line in [w for c in checked for w in c.warnings]:
            print_warning(line)
        failed = failed or bool(problems)
        for c in planned if not problems else []:
            failed = not _print_plan(c, getattr(options, "gpus", None)) or failed
    return EXIT_FAILED if failed else EXIT_OK


def _print_plan(checked: CheckedApp, gpus: int | None = None) -> bool:
    """Print the plan of each model of a valid vramgate application (from the measurement
    ``serve run`` made, when it is cached here) and, for GPU models, how their shares pack
    onto cards; ``False`` when a measurement leaves no budget, or the most replicas the
    models may run (autoscaled to ``deployment.max_replicas``) cannot all be placed on
    ``gpus`` cards (``None``: not checked)."""
    app, several = checked.app, len(checked.models) > 1
    lines: list[str] = []
    for model in checked.models:
        args, engine, plan = model.args, model.engine, model.plan
        title = app.where + (f", model {args.model.name!r}" if several else "")
        if (measured := cached_measurement(app, args, engine)) is not None:
            try:
                plan = plan_deployment(args, engine, measured)
            except InsufficientMemoryError as exc:
                print_error(f"{title}: insufficient memory ({measured.describe()}): {exc}")
                return False
        lines += plan_lines(title, args, engine, plan)
        if measured is None and measured_before_deploy(args):
            lines.append("  (not measured yet: serve run measures the model on the cluster "
                         "with one replica's resources before deploying it, and plans from "
                         "that)")
    models = [m.args for m in checked.models]
    lines += packing_lines(models)
    print("\n".join(lines))
    if gpus is not None and (problem := packing_problem(models, gpus, MOST)):
        print_error(f"{app.where}: {problem}")
        return False
    return True


def packing_lines(models: list[AppArgs]) -> list[str]:
    """How the GPU shares of every model replica pack onto whole cards
    (:func:`serve_app.placement.gpu_packing`): with autoscaling, how many cards the fewest,
    the initial and the most replicas need, and how the most pack; nothing for an app
    without GPU replicas."""
    cards, _ = gpu_packing(models, when=MOST)
    if not cards:
        return []
    counts = {when: (len(gpu_packing(models, when=when)[0]),
                     sum(replica_count(m, when) for m in models if m.deployment.num_gpus > 0))
              for when in (FEWEST, INITIAL, MOST)}
    scaled = len(set(counts.values())) > 1
    needed = (f"{counts[FEWEST][0]} {FEWEST} ({counts[FEWEST][1]} replicas), "
              f"{counts[INITIAL][0]} {INITIAL} ({counts[INITIAL][1]}), "
              f"{counts[MOST][0]} {MOST} ({counts[MOST][1]})") if scaled else str(len(cards))
    lines = [f"  GPUs needed:          {needed}   (each replica's num_gpus is a share of "
             "one card)"]
    lines += [f"    {MOST + ', ' if scaled else ''}GPU {i}: "
              + ", ".join(f"{name} ({share:g})" for name, share in card)
              + f"   ({sum(share for _, share in card):g} of 1)"
              for i, card in enumerate(cards)]
    return lines


def cached_measurement(app: ServeApp, args: AppArgs, engine: EngineSpec) -> Measurement | None:
    """The measurement ``serve run`` made before deploying ``app`` (a GPU application,
    :mod:`deployments.cluster.build_measurement`), if it is cached where this machine reads
    ``memory.measurement_cache_dir`` (a directory every node mounts, or the head node's),
    under the key of this config and of the allocator setting the application's
    ``runtime_env`` gives its workers; as at build time without a free GPU share, the card
    is not checked. ``None`` where ``serve run`` would not measure (a CPU application,
    ``memory.measure_before_deploy: false``, a ``memory.profile_path`` of the operator's)."""
    mem = args.memory
    if not measured_before_deploy(args):
        return None
    identity = measurement_identity(args, engine.profile_identity(args))
    identity["allocator"] = application_allocator(app.entry)
    return MeasurementCache(mem.measurement_cache_dir).get(measurement_key(identity))


def application_allocator(entry: dict[str, Any]) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF`` as the application's workers see it: from its
    ``runtime_env.env_vars``, else as this process has it."""
    runtime_env = entry.get("runtime_env")
    env_vars = runtime_env.get("env_vars") if isinstance(runtime_env, dict) else None
    if isinstance(env_vars, dict) and ALLOCATOR_ENV in env_vars:
        return str(env_vars[ALLOCATOR_ENV])
    return allocator_setting()


def plan_lines(title: str, args: AppArgs, engine: EngineSpec,
               plan: DeploymentPlan) -> list[str]:
    """The printed plan of one application (``title``, e.g. ``FILE: application 'NAME'``)
    whose ``args`` serve ``engine`` (its class)."""
    dep, queue = args.deployment, args.admission.max_queue_len
    replicas = (f"{dep.num_replicas} initially, autoscaled {dep.min_replicas or 1} .. "
                f"{dep.max_replicas} on the admission queue" if dep.autoscaling
                else str(dep.num_replicas))
    p95 = " or ".join(shape_text(s, engine.shape_axes)
                     for s in p95_request_shapes(args, engine.kinds,
                                                 model_context(args, engine)))
    lines = [
        title,
        f"  model:                {args.model.name} ({args.model.engine_name} engine, on "
        f"{DEVICES.get(engine.device_kind(args), engine.device_kind(args))})",
        f"  model replicas:       {replicas}",
        f"  num_gpus:             {plan.num_gpus:g} per replica" + (
            "   (a CPU replica)" if plan.num_gpus == 0 else ""),
        "  budget_bytes:         " + (
            bytes_text(plan.budget_bytes) if plan.budget_bytes is not None
            else "unknown here: each replica measures its device at start-up"),
        f"  P95 request:          {p95}: " + (
            bytes_text(plan.request_bytes) if plan.request_bytes is not None else "unknown"),
        f"  running at once:      {plan.max_running_estimate}   ({plan.running_set_by})",
        f"  max_ongoing_requests: {plan.max_ongoing_requests}   ({plan.ongoing_text(queue)})",
        f"  max_queued_requests:  {plan.max_queued_requests}   (admission.max_queue_len "
        f"{queue} x {_replicas(dep.max_replicas or dep.num_replicas)}, at each caller)",
        f"  from:                 {plan.how}",
    ]
    if plan.min_num_gpus is not None and plan.min_num_gpus != plan.num_gpus:
        lines.insert(4, f"  recommended num_gpus: {plan.min_num_gpus:g}   (the smallest 0.05 "
                        "of the card whose budget holds the requests run at once)")
    return lines


def _replicas(count: int) -> str:
    return f"{count} replica" + ("" if count == 1 else "s")


def bytes_text(n: int | None) -> str:
    """``n`` bytes and MiB, or ``unknown``."""
    return "unknown" if n is None else f"{n} bytes ({n / 2**20:.1f} MiB)"
