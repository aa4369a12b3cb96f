"""``python -m serve_app`` (or ``vramgate``): command-line tools for operators.

``validate CONFIG...`` checks every application of each ``serve run`` config without Ray and
prints every problem at once (file, application, key, what to change), or one ``ok`` line
per application (:mod:`serve_app.cli.validate`).

``plan CONFIG...`` prints what each model replica of each vramgate application will get:
its GPU share, byte budget, ``max_ongoing_requests`` and ``max_queued_requests``, and which
measurement or estimate they come from (:mod:`serve_app.cli.plan`).

``profile --config CONFIG [--app NAME] [--out PATH]`` loads an application's model in this
process (no Ray), measures its memory as a replica does at start-up, prints the cost model and
the deployment options the measurement recommends, and saves the profile for
``memory.profile_path`` (:mod:`serve_app.cli.profile`).

Exit status: 0 done (``validate``: no problem found); 1 any error: a bad command line, a
config file that cannot be read or is invalid (every problem is printed), a model that cannot
be loaded, a GPU replica profiled on a machine without CUDA, a device that cannot hold the
budget the config asks for (``insufficient memory: ...``); 130 interrupted. Errors go to
stderr, one line each, ``vramgate: ...``; never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from serve_app.cli import EXIT_FAILED, CliError, config_problems, print_error
from serve_app.cli.plan import plan_command
from serve_app.cli.profile import profile_command
from serve_app.cli.serve_config import IMPORT_PATH
from serve_app.cli.validate import validate_command
from serve_app.config import ConfigError
from serve_app.memory.budget import InsufficientMemoryError

EXIT_INTERRUPTED = 130


class UsageError(CliError):
    """A bad command line: one line, exit status 1 (argparse's own would be 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    # The library's warnings (e.g. planning without a readable model config), as one line.
    logging.basicConfig(format="vramgate: warning: %(message)s", level=logging.WARNING)
    try:
        options = _parser().parse_args(argv)
        return options.command(options)
    except CliError as exc:
        lines = exc.lines
    except ConfigError as exc:
        lines = config_problems(exc)
    except InsufficientMemoryError as exc:
        lines = [f"insufficient memory: {exc}"]
    except OSError as exc:
        lines = [str(exc)]
    except KeyboardInterrupt:
        print_error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # the last resort: still one line, never a traceback
        lines = [f"unexpected {type(exc).__name__}: {exc}"]
    for line in lines:
        print_error(line)
    return EXIT_FAILED


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vramgate", description=plain(__doc__.split("\n\n")[0]))
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    _configs_command(
        commands, "validate", validate_command,
        help="check serve configs without Ray; print every problem",
        description="Check every application of each serve run config as Ray Serve and "
        "vramgate would (without starting or importing Ray) and print every problem, one "
        "line each (file, application, key, message); exit status 1 if any.")
    plan = _configs_command(
        commands, "plan", plan_command,
        help="what each model replica will get, and from which measurement",
        description="For each vramgate application of each config, print what a model "
        "replica gets: num_gpus, budget bytes, max_ongoing_requests, max_queued_requests, "
        "the P95 request's bytes, and the measurement or estimate they come from; and how "
        "the models' GPU shares pack onto cards.")
    plan.add_argument("--gpus", type=int, default=None, metavar="N",
                      help="the GPUs of the cluster it will run on: refuse (exit status 1) "
                      "an application whose replicas, autoscaled to their most, cannot all "
                      "be placed on N cards")
    profile = commands.add_parser(
        "profile", help="measure a model's memory and recommend deployment options",
        description="Load the model of a serve config's application in this process (no "
        "Ray), measure its memory as a replica does at start-up, print the cost model and the "
        "recommended max_ongoing_requests, budget_bytes and num_gpus, and save the profile.")
    profile.add_argument("--config", required=True, type=Path,
                         help="serve run config YAML, e.g. configs/local.yaml")
    profile.add_argument("--app", default=None, help="application name (default: the first "
                         f"whose import_path is {IMPORT_PATH})")
    profile.add_argument("--model", default=None, help="which model of an application that "
                         "serves several (args.models), by model.name")
    profile.add_argument("--out", default=None, type=Path,
                         help="where to write the profile JSON (default: profiles/<app>.json, "
                         "profiles/<app>-<model>.json for one of several models)")
    profile.set_defaults(command=profile_command)
    return parser


def plain(text: str) -> str:
    """``text`` of a docstring as a terminal shows it: without reStructuredText's ````code````
    marks (argparse prints a description as it is)."""
    return text.replace("``", "")


def _configs_command(commands: Any, name: str, command: Callable[[argparse.Namespace], int],
                     **text: str) -> argparse.ArgumentParser:
    """A command over one or more config files (``vramgate NAME CONFIG...``)."""
    parser = commands.add_parser(name, **text)
    parser.add_argument("configs", nargs="+", type=Path, metavar="CONFIG",
                        help="serve run config YAML, e.g. configs/*.yaml")
    parser.set_defaults(command=command)
    return parser


if __name__ == "__main__":
    sys.exit(main())
