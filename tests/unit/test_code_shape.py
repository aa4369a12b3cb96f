"""The shape of the code, held: lint clean, small files and functions, narrow classes (at most
15 public methods), no kind or policy switched on by name outside its registry, nothing
dispatched by a name built from a string nor an engine probed for a capability, metric
outcomes and reasons recorded from their enums only, no import cycles, the replica side never
importing the HTTP side.

Product code is ``serve_app/`` and ``deployments/``; tests, load tests and benchmarks are held
to the lint and the import-cycle rule only.
"""

from __future__ import annotations

import ast
import enum
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app import outcomes
from serve_app.metrics import SPECS

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("serve_app", "deployments")
PACKAGES = (*PRODUCT, "loadtest", "benchmarks", "tests")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 50
# The one place each is chosen by name.
REGISTRIES = {"deployments/engines/registry.py", "serve_app/admission/policy.py"}
ENGINE_AND_POLICY_NAMES = {"embed", "generate", "fake", "budget", "semaphore", "none", "pow2"}
NAMED_ATTRIBUTES = {"task", "engine", "engine_name", "policy", "request_router"}


def python_files(*packages: str) -> Iterator[Path]:
    for package in packages:
        yield from sorted((REPO / package).rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_ruff_finds_nothing() -> None:
    """pyflakes, pycodestyle, import order, pyupgrade, bugbear and (product code)
    complexity <= 10, as configured in pyproject.toml."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_product_files_and_functions_are_small() -> None:
    too_long = []
    for path in python_files(*PRODUCT):
        source = path.read_text()
        if (lines := len(source.splitlines())) > MAX_FILE_LINES:
            too_long.append(f"{relative(path)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{relative(path)}:{node.lineno} {node.name}: "
                                    f"{length} lines")
    assert not too_long


def _named_comparisons(tree: ast.AST) -> Iterator[ast.Compare]:
    """Comparisons of a kind, engine or policy by name: with one of their names as a string
    constant, or of an attribute such as ``.task`` / ``.policy`` against anything."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        constants = {n.value for side in sides for n in ast.walk(side)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        attributes = {side.attr for side in sides if isinstance(side, ast.Attribute)}
        if constants & ENGINE_AND_POLICY_NAMES or attributes & NAMED_ATTRIBUTES:
            yield node


def test_no_kind_engine_or_policy_is_switched_on_by_name_outside_its_registry() -> None:
    found = [f"{relative(path)}:{node.lineno}: {ast.unparse(node)}"
             for path in python_files(*PRODUCT) if relative(path) not in REGISTRIES
             for node in _named_comparisons(ast.parse(path.read_text()))]
    assert not found


def test_the_name_check_would_see_a_switch() -> None:
    tree = ast.parse("if args.model.task == 'fake': pass\nif policy.name != 'budget': pass\n"
                     "if kind in ('embed', 'generate'): pass\nif args.model.engine == wanted: pass")
    assert len(list(_named_comparisons(tree))) == 4


ATTRIBUTE_BY_NAME = {"getattr", "hasattr", "setattr", "delattr"}


def _built_name(value: ast.expr) -> bool:
    """Whether ``value`` is a name made at run time from pieces: an f-string, ``+`` or ``%``
    of strings, ``.format(...)``/``.join(...)``."""
    if isinstance(value, ast.JoinedStr):
        return True
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add | ast.Mod):
        return True
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
        and value.func.attr in {"format", "join"}


def _dispatch_by_name(tree: ast.AST) -> Iterator[str]:
    """Every ``getattr``-family call on a name built from a string (``getattr(self,
    f"run_{kind}")``), and every one that probes an engine for a capability
    (``getattr(engine, "decode_steps", False)``): capabilities are types."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ATTRIBUTE_BY_NAME and len(node.args) >= 2):
            continue
        if _built_name(node.args[1]) or "engine" in ast.unparse(node.args[0]).lower():
            yield f"{node.lineno}: {ast.unparse(node)}"


def test_nothing_is_dispatched_by_a_built_name_or_probed_on_an_engine() -> None:
    found = [f"{relative(path)}:{where}" for path in python_files(*PRODUCT)
             for where in _dispatch_by_name(ast.parse(path.read_text()))]
    assert not found


def test_the_dispatch_check_would_see_a_built_name_and_a_probe() -> None:
    tree = ast.parse('getattr(self, f"run_{kind}")(requests)\n'
                     'getattr(engine, "decode_steps", False)\n'
                     'hasattr(self._engine, "abort")\n'
                     'getattr(module, "stream_" + kind)\n'
                     'setattr(obj, "{}_total".format(name), 1)\n'
                     # none of these
                     'getattr(importlib.import_module(name), attribute)\n'
                     'getattr(self, "_publisher", None)\n')
    assert sorted(line.split(":")[0] for line in _dispatch_by_name(tree)) == list("12345")


MAX_PUBLIC_METHODS = 15


def _exempt(node: ast.ClassDef) -> bool:
    """Errors and config values: wide by nature (fields and accessors, not behaviour)."""
    bases = {ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases}
    return any(b.endswith(("Error", "Exception")) or b == "BaseModel" for b in bases)


def _wide_classes(tree: ast.AST) -> Iterator[str]:
    """Classes defining more than ``MAX_PUBLIC_METHODS`` public methods in their body."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and not _exempt(node):
            public = [n.name for n in node.body
                      if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                      and not n.name.startswith("_")]
            if len(public) > MAX_PUBLIC_METHODS:
                yield f"{node.lineno} {node.name}: {len(public)} public methods"


def test_no_class_has_more_than_fifteen_public_methods() -> None:
    found = [f"{relative(path)}:{where}" for path in python_files(*PRODUCT)
             for where in _wide_classes(ast.parse(path.read_text()))]
    assert not found


def test_the_width_check_would_see_a_wide_class() -> None:
    methods = "".join(f"    def m{i}(self): pass\n" for i in range(16))
    tree = ast.parse(f"class Wide:\n{methods}\n"
                     f"class Narrow:\n{methods.replace('def m0', 'def _m0')}\n"
                     f"class Config(BaseModel):\n{methods}\n"
                     f"class BadThing(ServeAppError):\n{methods}")
    assert list(_wide_classes(tree)) == ["1 Wide: 16 public methods"]


LABELS = ("outcome", "reason")
METRICS = {spec.name for spec in SPECS}
# The enums of serve_app.outcomes, by name: what a metric's outcome or reason is built from.
LABEL_ENUMS = {name for name, value in vars(outcomes).items()
               if isinstance(value, type) and issubclass(value, enum.StrEnum)}


def _spelled_out(value: ast.expr) -> list[ast.expr]:
    """The string constants and f-strings ``value`` can evaluate to (through conditionals,
    ``or``/``and`` and calls), not those it only compares against."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return [value]
    if isinstance(value, ast.JoinedStr):
        return [value]
    if isinstance(value, ast.IfExp):
        return _spelled_out(value.body) + _spelled_out(value.orelse)
    if isinstance(value, ast.BoolOp):
        return [found for v in value.values for found in _spelled_out(v)]
    if isinstance(value, ast.Call):
        return [found for arg in (*value.args, *(k.value for k in value.keywords))
                for found in _spelled_out(arg)]
    return []


def _of_an_enum(value: ast.expr) -> bool:
    """Whether ``value`` is an enum member: ``Enum.MEMBER``, ``Enum(...)``,
    ``Enum.of(...)``, or a conditional between such."""
    if isinstance(value, ast.IfExp):
        return _of_an_enum(value.body) and _of_an_enum(value.orelse)
    target = value.func if isinstance(value, ast.Call) else value
    if isinstance(target, ast.Attribute):
        target = target.value
    return isinstance(target, ast.Name) and target.id in LABEL_ENUMS


def _labels_by_hand(tree: ast.AST) -> Iterator[str]:
    """Every ``outcome=``/``reason=`` keyword of a call that spells a label out as a string,
    and every such label of a metric call (``metrics.inc("admission_decisions", ...)``)
    that is not an enum member."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        metric = (isinstance(node.func, ast.Attribute) and node.args
                  and isinstance(node.args[0], ast.Constant)
                  and node.args[0].value in METRICS)
        for keyword in node.keywords:
            if keyword.arg in LABELS and (_spelled_out(keyword.value) or (
                    metric and not _of_an_enum(keyword.value))):
                yield f"{node.lineno}: {keyword.arg}={ast.unparse(keyword.value)}"


def test_metric_outcomes_and_reasons_come_from_their_enums() -> None:
    """Every call site's outcome and reason is a member of :mod:`serve_app.outcomes`."""
    found = [f"{relative(path)}:{where}" for path in python_files(*PRODUCT)
             for where in _labels_by_hand(ast.parse(path.read_text()))]
    assert not found
    assert LABEL_ENUMS >= {"Outcome", "Reason", "AdmitReason", "CancelReason", "JobOutcome",
                           "IdempotencyHit"}


def test_the_label_check_would_see_a_string() -> None:
    tree = ast.parse(
        'metrics.inc("admission_decisions", outcome="rejected", reason=Reason.OOM)\n'
        'metrics.inc("admission_decisions", 2, outcome=Outcome.REJECTED, reason=exc.code)\n'
        'metrics.inc("jobs_finished", outcome="requeued" if s == "queued" else str(s))\n'
        'metrics.inc("idempotency_hits", outcome=f"{action}d")\n'
        'Decision(Outcome.REJECTED, 1, reason=code or "oom")\n'
        # typed: none of these
        'metrics.inc("admission_decisions", outcome=Outcome.ADMITTED,\n'
        '            reason=AdmitReason.of(position))\n'
        'metrics.inc("admission_decisions", outcome=Outcome.REJECTED, reason=Reason(exc.code))\n'
        'metrics.inc("idempotency_hits", outcome=IdempotencyHit.COALESCED if action == "wait"\n'
        '            else IdempotencyHit.REPLAYED)\n'
        'log.event("finished", 1, outcome=outcome)\n')
    assert [line.split(":")[0] for line in _labels_by_hand(tree)] == ["1", "2", "3", "4", "5"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports (anywhere in it, functions
    included: a lazy import is still a dependency)."""
    modules = {_module_name(p): p for p in python_files(*PACKAGES)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                targets.add(base)
                targets |= {f"{base}.{alias.name}" for alias in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "deployments.engines.registry" in graph["deployments.http.served_models"]
    assert not cycles(graph)


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_check_would_see_a_cycle(graph, expected) -> None:
    assert cycles(graph) == expected


# The model replica runs requests (durable jobs included) as the ingress built them: it
# imports nothing of the HTTP side (routes, request factory, clients of the replicas).
# By folder (deployments/replica/, deployments/http/), so a new file is held by the rule too.
REPLICA_SIDE = ("deployments.replica", "deployments.engines")
HTTP_SIDE = ("deployments.http",)


def _within(module: str, names: tuple[str, ...]) -> bool:
    """``module`` is one of ``names`` or inside one of those packages."""
    return any(module == name or module.startswith(name + ".") for name in names)


def replica_imports_of_http_side(graph: dict[str, set[str]]) -> list[str]:
    """Each replica-side module that imports an HTTP-side one, directly or through other
    modules, as the chain of imports that gets there (``a -> b -> c``)."""
    found = []
    for start in sorted(m for m in graph if _within(m, REPLICA_SIDE)):
        chains, seen = [[start]], {start}
        while chains:
            chain = chains.pop(0)
            if _within(chain[-1], HTTP_SIDE):
                found.append(" -> ".join(chain))
                continue
            for successor in sorted(graph.get(chain[-1], ())):
                if successor not in seen:
                    seen.add(successor)
                    chains.append([*chain, successor])
    return found


def test_the_replica_side_imports_nothing_of_the_http_side() -> None:
    graph = import_graph()
    for name in (*REPLICA_SIDE, *HTTP_SIDE):  # a renamed folder must not empty the rule
        assert name in graph, name
    assert "deployments.replica.jobs_worker" in graph["deployments.replica.model_server"]
    assert replica_imports_of_http_side(graph) == []


def test_the_replica_side_check_would_see_an_import_of_the_http_side() -> None:
    graph = {"deployments.replica.model_server": {"deployments.replica.jobs_worker",
                                                  "serve_app.kinds"},
             "deployments.replica.jobs_worker": {"deployments.helper"},
             "deployments.helper": {"deployments.http.routes.base"},
             "deployments.http.routes.base": {"deployments.http.request_factory"},
             "deployments.engines.fake": {"deployments.http.request_factory"},
             "deployments.http.ingress": {"deployments.replica.parts"}, "serve_app.kinds": set()}
    assert replica_imports_of_http_side(graph) == [
        "deployments.engines.fake -> deployments.http.request_factory",
        "deployments.replica.jobs_worker -> deployments.helper -> deployments.http.routes.base",
        "deployments.replica.model_server -> deployments.replica.jobs_worker -> "
        "deployments.helper -> deployments.http.routes.base"]
