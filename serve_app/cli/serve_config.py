"""Reading a ``serve run`` config file without Ray: its applications, and what Ray Serve 2.60's
own schema (``ray.serve.schema.ServeDeploySchema``) would refuse in it, checked here by hand
because importing that schema imports Ray.

Ray Serve ignores keys it does not know; so that a misspelt key is not silently dropped, they
are reported here (:data:`TOP_LEVEL_KEYS` and :data:`APPLICATION_KEYS` are the fields of Ray's
schema; tests/unit/test_cli_validate.py holds them to it). A key written twice in one mapping
is reported too (and the file's other problems with it): YAML wants keys unique, but PyYAML,
which ``serve run`` reads configs with, keeps the last value silently, so a second
``admission:`` section replaces the first whole.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from serve_app.cli import CliError

IMPORT_PATH = "serve_app.app:build_app"
"""The ``import_path`` of a vramgate application."""

TOP_LEVEL_KEYS = frozenset({
    "proxy_location", "http_options", "grpc_options", "controller_options", "logging_config",
    "tracing_config", "applications", "target_capacity"})
APPLICATION_KEYS = frozenset({
    "name", "route_prefix", "import_path", "runtime_env", "host", "port", "deployments",
    "autoscaling_policy", "args", "logging_config", "external_scaler_enabled"})
DEFAULT_APP_NAME = "default"  # Ray Serve's name for an application without one


@dataclass
class ServeApp:
    """One entry of a config's ``applications:`` list.

    Attributes:
        path: the config file.
        index: its position in the list.
        entry: the entry as written (a mapping; empty when it is not one).
        problems: what Ray Serve would refuse in it, one line each, naming the key.
    """

    path: Path
    index: int
    entry: dict[str, Any]
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.entry.get("name", DEFAULT_APP_NAME))

    @property
    def where(self) -> str:
        """``FILE: application 'NAME'``: how a message names the application."""
        name = self.entry.get("name", DEFAULT_APP_NAME)
        if self.entry and isinstance(name, str) and name:
            return f"{self.path}: application {name!r}"
        return f"{self.path}: applications[{self.index}]"

    @property
    def is_vramgate(self) -> bool:
        return self.entry.get("import_path") == IMPORT_PATH

    @property
    def raw_args(self) -> Any:
        """The entry's ``args:`` as written (``{}`` when absent)."""
        args = self.entry.get("args")
        return {} if args is None else args


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader that notes each key given twice in one mapping (YAML 1.2.2,
    section 3.2.1.1: "The content of a mapping node is an unordered set of key/value node
    pairs, with the restriction that each of the keys is unique") and, like ``serve run``,
    keeps the last value, so that the rest of the file is still checked."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.repeated_keys: list[str] = []
        """``LINE:COL: what`` for each repeat, in the order met."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # PyYAML refuses it itself
            mark = key_node.start_mark
            if key in first_line:
                self.repeated_keys.append(
                    f"{mark.line + 1}:{mark.column + 1}: {key!r} is given again in the same "
                    f"mapping (first at line {first_line[key]}); serve run would keep only "
                    "this one and drop the first without a word: merge them")
            else:
                first_line[key] = mark.line + 1
        return super().construct_mapping(node, deep)


def _load_yaml(path: Path) -> tuple[Any, list[str]]:
    """The YAML document at ``path`` and the keys given twice in it (``FILE:LINE:COL: ...``).

    Raises:
        OSError: the file cannot be read.
        yaml.YAMLError: it is not YAML.
    """
    loader = _UniqueKeyLoader(Path(path).read_text())
    try:
        raw = loader.get_single_data()
    finally:
        loader.dispose()
    return raw, [f"{path}:{where}" for where in loader.repeated_keys]


def read_serve_config(path: Path) -> tuple[list[ServeApp], list[str]]:
    """The applications of the ``serve run`` config at ``path``, each with what Ray Serve
    would refuse in it, and the problems of the file itself (unreadable, not YAML, a key given
    twice in one mapping, no ``applications:`` list, unknown top-level keys, names or route
    prefixes used twice). A key given twice is reported and its last value is checked, as
    ``serve run`` would use it.
    Nothing is raised: a file that cannot be read has no applications and one problem."""
    try:
        raw, problems = _load_yaml(path)
    except OSError as exc:
        return [], [f"{path}: cannot read it: {exc.strerror or exc}"]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        return [], [f"{path}{at}: not valid YAML: {getattr(exc, 'problem', None) or exc}"]
    if not isinstance(raw, dict):
        return [], [*problems, f"{path}: not a serve run config (expected a mapping with an "
                               "`applications:` list)"]
    problems += [f"{path}: {key}: unknown key (Ray Serve ignores it; check its spelling)"
                 for key in raw if key not in TOP_LEVEL_KEYS]
    entries = raw.get("applications")
    if not isinstance(entries, list) or not entries:
        return [], [*problems, f"{path}: applications: expected a non-empty list of "
                               "applications (is it a serve run config?)"]
    apps = [_application(path, i, entry) for i, entry in enumerate(entries)]
    return apps, problems + _duplicates(path, apps)


def read_application(path: Path, app_name: str | None) -> ServeApp:
    """The chosen vramgate application of the config at ``path``: the one named
    ``app_name``, else the first whose ``import_path`` is :data:`IMPORT_PATH`.

    Raises:
        CliError: the file cannot be read or is no serve config, has no such application, or
            the chosen one is not a vramgate application.
    """
    apps, problems = read_serve_config(path)
    if not apps:
        raise CliError(*problems)
    if app_name is None:
        if not (ours := [app for app in apps if app.is_vramgate]):
            raise CliError(f"{path}: no application has import_path {IMPORT_PATH}")
        return ours[0]
    named = [app for app in apps if app.name == app_name]
    if not named:
        names = ", ".join(repr(app.name) for app in apps)
        raise CliError(f"{path}: no application named {app_name!r} (it has {names})")
    if not named[0].is_vramgate:
        raise CliError(f"{path}: application {app_name!r} has import_path "
                       f"{named[0].entry.get('import_path')!r}, not {IMPORT_PATH}")
    return named[0]


def _application(path: Path, index: int, entry: Any) -> ServeApp:
    if not isinstance(entry, dict):
        app = ServeApp(path, index, {})
        app.problems.append(f"{app.where}: expected a mapping with an import_path")
        return app
    app = ServeApp(path, index, entry)
    app.problems += [f"{app.where}: {key}: unknown key (Ray Serve ignores it; check its "
                     "spelling)" for key in entry if key not in APPLICATION_KEYS]
    app.problems += [f"{app.where}: {key}: set it at the top level of the file (Ray Serve "
                     "refuses it in an application)" for key in ("host", "port")
                     if key in entry]
    checks = {"name": _name_problem, "import_path": _import_path_problem,
              "route_prefix": _route_prefix_problem, "args": _args_problem}
    for key, check in checks.items():
        if (problem := check(entry)) is not None:
            app.problems.append(f"{app.where}: {key}: {problem}")
    return app


def _name_problem(entry: dict[str, Any]) -> str | None:
    name = entry.get("name", DEFAULT_APP_NAME)
    return None if isinstance(name, str) and name else "must be a non-empty string"


def _import_path_problem(entry: dict[str, Any]) -> str | None:
    """Ray Serve's rule: ``module:attribute`` (one colon, neither end), or a dotted path."""
    value = entry.get("import_path")
    if value is None:
        return f"missing (a vramgate application's is {IMPORT_PATH})"
    if not isinstance(value, str):
        return "must be a string such as package.module:attribute"
    separator = ":" if ":" in value else "."
    if value.count(":") > 1 or separator not in value:
        return f"{value!r} must be module:attribute (one colon) or module.attribute"
    if value.startswith(separator) or value.endswith(separator):
        return f"{value!r} may not start or end with {separator!r}"
    return None


def _route_prefix_problem(entry: dict[str, Any]) -> str | None:
    """Ray Serve's rule: starts with ``/``, ends with none (unless just ``/``), no ``{}``."""
    value = entry.get("route_prefix", "/")
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/"):
        return f"{value!r} must start with '/'"
    if len(value) > 1 and value.endswith("/"):
        return f"{value!r} may not end with '/' (unless it is just '/')"
    if "{" in value or "}" in value:
        return f"{value!r} may not contain '{{' or '}}'"
    return None


def _args_problem(entry: dict[str, Any]) -> str | None:
    args = entry.get("args")
    return None if args is None or isinstance(args, dict) else "must be a mapping"


def _duplicates(path: Path, apps: list[ServeApp]) -> list[str]:
    """Ray Serve refuses two applications of one name, or of one route prefix."""
    problems = []
    for key, default in (("name", DEFAULT_APP_NAME), ("route_prefix", "/")):
        values = [app.entry.get(key, default) for app in apps if app.entry]
        seen = {v for v in values if isinstance(v, str) and values.count(v) > 1}
        problems += [f"{path}: {key} {v!r} is used by more than one application (Ray Serve "
                     "refuses it)" for v in sorted(seen)]
    return problems
