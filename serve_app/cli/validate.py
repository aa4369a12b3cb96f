"""``vramgate validate CONFIG...``: every problem of every application of each ``serve run``
config, found without Ray (nothing here imports it; a test holds that).

For each file: what Ray Serve's schema would refuse (:mod:`.serve_config`); for each vramgate
application (``import_path: serve_app.app:build_app``), what ``serve run`` would refuse while
building it: the ``args:`` (:func:`serve_app.config.parse_args`: every invalid key at once;
checks relating two keys run once both keys are valid), the engine and its own checks
(:func:`deployments.engines.registry.engine_class`) and the deployment plan
(:func:`serve_app.planning.plan_deployment`, e.g. a profile that leaves no budget).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from serve_app.cli import EXIT_FAILED, EXIT_OK, CliError, config_problems, print_error
from serve_app.cli.serve_config import IMPORT_PATH, ServeApp, read_serve_config
from serve_app.config import AppArgs, ConfigError, parse_args
from serve_app.memory.budget import InsufficientMemoryError
from serve_app.planning import DeploymentPlan, plan_deployment

if TYPE_CHECKING:
    from deployments.engines.base import Engine


@dataclass
class CheckedApp:
    """One application of a config, checked.

    Attributes:
        app: the application as read.
        problems: every problem found, one line each (empty: valid).
        args: its validated ``args:`` (vramgate applications whose args are valid).
        engine: its engine class (idem).
        plan: its deployment plan (vramgate applications without problems).
    """

    app: ServeApp
    problems: list[str] = field(default_factory=list)
    args: AppArgs | None = None
    engine: type[Engine] | None = None
    plan: DeploymentPlan | None = None


def load_args(app: ServeApp) -> tuple[AppArgs, type[Engine]]:
    """A vramgate application's validated ``args:`` and its engine class, as ``serve run``
    resolves them.

    Raises:
        CliError: every invalid key, one line each, naming the file and application.
    """
    from deployments.engines.registry import engine_class  # the engine module: when asked

    try:
        args = parse_args(app.raw_args)
        return args, engine_class(args)
    except ConfigError as exc:
        raise CliError(*config_problems(exc, app.where)) from None


def check_application(app: ServeApp) -> CheckedApp:
    """Every problem of ``app``: Ray Serve's, then (for a vramgate application whose
    ``args:`` is a mapping) its args', its engine's and its plan's."""
    checked = CheckedApp(app, list(app.problems))
    if not app.is_vramgate or not isinstance(app.raw_args, dict):
        return checked
    try:
        checked.args, checked.engine = load_args(app)
        plan = plan_deployment(checked.args, checked.engine)
    except CliError as exc:
        checked.problems += exc.lines
    except InsufficientMemoryError as exc:
        checked.problems.append(f"{app.where}: insufficient memory: {exc}")
    else:
        checked.plan = plan if not checked.problems else None
    return checked


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
        for c in checked:
            if not c.problems:
                print(ok_line(c))
    return EXIT_FAILED if failed else EXIT_OK


def ok_line(checked: CheckedApp) -> str:
    """What ``validate`` prints for a valid application."""
    app = checked.app
    if checked.args is None:
        return (f"{app.where}: ok as a Ray Serve application (import_path "
                f"{app.entry.get('import_path')!r} is not {IMPORT_PATH}: its args are not "
                "checked)")
    args = checked.args
    return (f"{app.where}: ok ({args.model.engine_name} engine, model {args.model.name!r}, "
            f"num_gpus {args.deployment.num_gpus:g} per replica)")
