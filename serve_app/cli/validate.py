"""``vramgate validate CONFIG...``: every problem of every application of each ``serve run``
config, found without Ray (nothing here imports it; a test holds that).

For each file: what Ray Serve's schema would refuse (:mod:`.serve_config`); for each vramgate
application (``import_path: serve_app.app:build_app``), what ``serve run`` would refuse while
building it: the ``args:`` (:func:`serve_app.app_config.parse_models`: every invalid key of
every model at once; checks relating two keys run once both keys are valid), each engine and
its own checks
(:func:`deployments.engines.registry.engine_class`) and the deployment plan
(:func:`serve_app.planning.plan_deployment`, e.g. a profile that leaves no budget) of each
model.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from serve_app.app_config import parse_models
from serve_app.cli import (
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    config_problems,
    print_error,
    print_warning,
    shape_text,
)
from serve_app.cli.serve_config import IMPORT_PATH, ServeApp, read_serve_config
from serve_app.config import AppArgs, ConfigError
from serve_app.kinds import context_problems
from serve_app.memory.budget import InsufficientMemoryError
from serve_app.planning import (
    DeploymentPlan,
    model_context,
    p95_request_shapes,
    plan_deployment,
)

if TYPE_CHECKING:
    from deployments.engines.base import Engine


@dataclass
class CheckedModel:
    """One model of a valid vramgate application: its validated ``args``, its engine class
    and (when it has no problem) its deployment plan."""

    args: AppArgs
    engine: type[Engine]
    plan: DeploymentPlan | None = None


@dataclass
class CheckedApp:
    """One application of a config, checked.

    Attributes:
        app: the application as read.
        problems: every problem found, one line each (empty: valid).
        models: its models (``args.models``, or the one model), once their args are valid.
        warnings: what is served otherwise than the config reads, one line each (not a
            problem), e.g. limits the model's context cannot hold.
    """

    app: ServeApp
    problems: list[str] = field(default_factory=list)
    models: list[CheckedModel] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def planned(self) -> bool:
        return bool(self.models) and not self.problems


def load_models(app: ServeApp) -> list[tuple[AppArgs, type[Engine]]]:
    """A vramgate application's models (:func:`serve_app.app_config.parse_models`): each
    one's validated args and engine class, as ``serve run`` resolves them.

    Raises:
        CliError: every invalid key, one line each, naming the file and application.
    """
    from deployments.engines.registry import engine_class  # the engine module: when asked

    try:
        models = parse_models(app.raw_args)
        return [(args, engine_class(args)) for args in models]
    except ConfigError as exc:
        raise CliError(*config_problems(exc, app.where)) from None


def load_args(app: ServeApp, model: str | None = None) -> tuple[AppArgs, type[Engine]]:
    """One model of a vramgate application: the one named ``model``, or its only one.

    Raises:
        CliError: invalid args (:func:`load_models`), no model of that name, or several
            models and no name.
    """
    models = load_models(app)
    names = [args.model.name for args, _ in models]
    if model is None and len(models) == 1:
        return models[0]
    found = [m for m in models if m[0].model.name == model]
    if not found:
        raise CliError(f"{app.where}: " + (
            f"no model {model!r}; it serves {names}" if model is not None
            else f"it serves {names}: name one with --model"))
    return found[0]


def check_application(app: ServeApp) -> CheckedApp:
    """Every problem of ``app``: Ray Serve's, then (for a vramgate application whose
    ``args:`` is a mapping) its args', its engines' and its plans'."""
    checked = CheckedApp(app, list(app.problems))
    if not app.is_vramgate or not isinstance(app.raw_args, dict):
        return checked
    try:
        checked.models = [CheckedModel(args, engine) for args, engine in load_models(app)]
    except CliError as exc:
        checked.problems += exc.lines
    for model in checked.models:
        where = app.where + (f", model {model.args.model.name!r}"
                             if len(checked.models) > 1 else "")
        try:
            model.plan = plan_deployment(model.args, model.engine)
        except InsufficientMemoryError as exc:
            checked.problems.append(f"{where}: insufficient memory: {exc}")
        checked.warnings += context_warnings(where, model)
    return checked


def context_warnings(where: str, model: CheckedModel) -> list[str]:
    """A warning for each limit the model's context cannot hold
    (:func:`serve_app.planning.context_problems`), saying what the plan prices instead."""
    args, engine = model.args, model.engine
    p95 = " or ".join(shape_text(s, engine.shape_axes)
                      for s in p95_request_shapes(args, engine.kinds,
                                                  model_context(args, engine)))
    return [f"{where}: {problem}, so requests are planned within it (P95: {p95})"
            for problem in context_problems(args.limits, engine.kinds,
                                            engine.planned_context(args))]


def check_config(path: Path) -> tuple[list[str], list[CheckedApp]]:
    """The problems of the file at ``path`` itself, and each of its applications checked."""
    apps, problems = read_serve_config(path)
    return problems, [check_application(app) for app in apps]


def validate_command(options: argparse.Namespace) -> int:
    """``vramgate validate``: print every problem of each config (stderr, one line each) and
    one ``ok`` line (stdout) per valid application; exit status 1 if any problem."""
    failed = False
    for path in options.configs:
        problems, checked = check_config(path)
        for line in problems + [p for c in checked for p in c.problems]:
            print_error(line)
            failed = True
        for line in [w for c in checked for w in c.warnings]:
            print_warning(line)
        for c in checked:
            if not c.problems:
                print(ok_line(c))
    return EXIT_FAILED if failed else EXIT_OK


def ok_line(checked: CheckedApp) -> str:
    """What ``validate`` prints for a valid application."""
    app = checked.app
    if not checked.models:
        return (f"{app.where}: ok as a Ray Serve application (import_path "
                f"{app.entry.get('import_path')!r} is not {IMPORT_PATH}: its args are not "
                "checked)")
    return f"{app.where}: ok (" + "; ".join(
        f"{m.args.model.engine_name} engine, model {m.args.model.name!r}, num_gpus "
        f"{m.args.deployment.num_gpus:g} per replica{_unplanned(m)}"
        for m in checked.models) + ")"


def _unplanned(model: CheckedModel) -> str:
    """``, but ...`` when the model's plan is a fallback because its files cannot be read
    here (a path that exists only on the cluster, or a placeholder left in the config);
    ``, planned without a price ...`` when its engine has no analytic cost model."""
    how = "" if model.plan is None else model.plan.how
    if how.startswith("no analytic cost model"):
        return (f", planned without a price: the {model.args.model.engine_name} engine has no "
                "analytic cost model, so each replica measures its own at start-up")
    if not how.startswith("fallback (model config"):
        return ""
    return (", but its model config cannot be read on this machine (a placeholder path, or one "
            "that only the cluster has?): its plan is a fallback")
