"""The Grafana dashboard, the alert rules and docs/observability.md against ``SPECS``.

Every metric name a query or rule uses must be one the service exports, with each value of
the dashboard's ``prefix`` variable substituted (``""``: the ingress's ``/metrics``; ``ray_``:
Ray's metrics export); every metric must have a panel; the docs' metric table must list
exactly ``SPECS``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from serve_app.metrics import COMMON_LABELS, SPECS, MetricSpec, ProcessMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "vramgate.json"
ALERTS = ROOT / "dashboards" / "alerts.yaml"
DOC = ROOT / "docs" / "observability.md"

EXPORTED = {name: spec for spec in SPECS for name in spec.exported_names}
# A whole metric-name token that contains the project's prefix (so "ray_vramgate_x" is one
# token, and "vramgate_.+" in a variable's regex is none).
METRIC_TOKEN = re.compile(r"[A-Za-z0-9_:]*vramgate_[a-z_]+")
SELECTOR = re.compile(r"\$\{prefix\}vramgate_[a-z_]+(\{[^}]*\})?")
DURATION = re.compile(r"^[0-9]+[smhdwy]$")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _variable(name: str) -> dict[str, Any]:
    matches = [v for v in _dashboard()["templating"]["list"] if v["name"] == name]
    assert len(matches) == 1, f"one template variable {name!r} expected, got {len(matches)}"
    return matches[0]


def _grafana_custom_options(query: str) -> list[tuple[str, str]]:
    """(text, value) pairs as Grafana parses a custom variable's query: comma-separated
    entries (``\\,`` escapes a comma), each ``text : value`` or a bare value."""
    options = []
    for entry in re.findall(r"(?:\\,|[^,])+", query):
        entry = entry.replace("\\,", ",")
        pair = re.match(r"^(.+)\s:\s(.+)$", entry)
        if pair:
            options.append((pair.group(1).strip(), pair.group(2).strip()))
        else:
            options.append((entry.strip(), entry.strip()))
    return options


def _prefixes() -> list[str]:
    return [option["value"] for option in _variable("prefix")["options"]]


def _exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    return [(panel["title"], target["expr"])
            for panel in _dashboard()["panels"] for target in panel["targets"]]


def _used_specs(text: str) -> set[str]:
    return {EXPORTED[token].name for token in METRIC_TOKEN.findall(text) if token in EXPORTED}


def test_exported_names_are_what_the_exposition_really_serves() -> None:
    """``exported_names`` (what these checks trust) against prometheus-client's output."""
    metrics = ProcessMetrics("ModelServer", "r1", use_ray=False)
    for spec in SPECS:
        labels = dict.fromkeys(spec.labels, "x")
        if spec.kind == "counter":
            metrics.inc(spec.name, **labels)
        elif spec.kind == "gauge":
            metrics.set(spec.name, 1.0, **labels)
        else:
            metrics.observe(spec.name, 0.3, **labels)
    served = {line.split("{")[0].split(" ")[0] for line in metrics.exposition().splitlines()
              if line and not line.startswith("#")}
    assert served == set(EXPORTED)


# --- the dashboard's shape ----------------------------------------------------------------


def test_dashboard_has_the_top_level_fields_grafana_needs() -> None:
    dashboard = _dashboard()
    assert dashboard["title"].startswith("vramgate")
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    assert dashboard["schemaVersion"] >= 36
    assert isinstance(dashboard["panels"], list) and len(dashboard["panels"]) >= 10
    assert "ray_" in dashboard["description"] and "/metrics" in dashboard["description"]


def test_every_panel_has_type_title_grid_position_description_unit_and_queries() -> None:
    panels = _dashboard()["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = [panel["title"] for panel in panels]
    assert len(titles) == len(set(titles)), "panel titles must be unique"
    for panel in panels:
        title = panel["title"]
        assert panel["type"] in ("timeseries", "stat"), title
        assert title.strip(), panel["id"]
        assert len(panel["description"]) > 40, f"{title}: describe it and its unit"
        assert "unit" in panel["description"], f"{title}: the description states the unit"
        assert panel["fieldConfig"]["defaults"]["unit"], f"{title}: no unit"
        grid = panel["gridPos"]
        assert set(grid) >= {"x", "y", "w", "h"}, title
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, title
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], f"{title}: no query"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{title}: refIds must be unique"
        for target in panel["targets"]:
            assert target["expr"].strip(), title
            assert target["datasource"] == panel["datasource"], title


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in _dashboard()["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_template_variables_datasource_prefix_deployment_replica() -> None:
    assert _variable("datasource")["type"] == "datasource"
    assert _variable("datasource")["query"] == "prometheus"
    prefix = _variable("prefix")
    assert prefix["type"] == "custom"
    options = [(o["text"], o["value"]) for o in prefix["options"]]
    assert [value for _, value in options] == ["", "ray_"]
    # Grafana rebuilds the options from the query: it must give the same values.
    assert _grafana_custom_options(prefix["query"]) == options
    assert prefix["current"]["value"] == ""
    for name in ("deployment", "replica"):
        variable = _variable(name)
        assert variable["type"] == "query", name
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert re.fullmatch(rf"label_values\(.*\$\{{prefix\}}vramgate_.*, {name}\)",
                            variable["definition"]), variable["definition"]
        assert variable["query"]["query"] == variable["definition"]
        assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".*"
    assert '$deployment' in _variable("replica")["definition"]


# --- the queries against SPECS ------------------------------------------------------------


def _name_problems(expr: str, prefix: str) -> list[str]:
    """What is wrong with the metric names of ``expr`` once ``${prefix}`` is ``prefix``."""
    tokens = METRIC_TOKEN.findall(expr.replace("${prefix}", prefix))
    if not tokens:
        return ["no vramgate metric"]
    return [f"{token} is not {prefix!r} + an exported name" for token in tokens
            if not token.startswith(prefix) or token[len(prefix):] not in EXPORTED]


def test_prefix_variable_substitution_yields_only_exported_names() -> None:
    prefixes = _prefixes()
    assert prefixes == ["", "ray_"]
    for prefix in prefixes:
        for title, expr in _exprs():
            assert _name_problems(expr, prefix) == [], f"{title}: {expr}"


def test_every_query_filters_on_deployment_and_replica() -> None:
    for title, expr in _exprs():
        selectors = SELECTOR.findall(expr)
        assert selectors, f"{title}: every metric is named as ${{prefix}}vramgate_..."
        for labels in selectors:
            assert 'deployment=~"$deployment"' in labels, f"{title}: {expr}"
            assert 'replica=~"$replica"' in labels, f"{title}: {expr}"


def test_counters_and_buckets_are_only_used_through_rate_or_increase() -> None:
    for title, expr in _exprs():
        for match in METRIC_TOKEN.finditer(expr.replace("${prefix}", "")):
            name = match.group()
            if name.endswith(("_total", "_bucket", "_sum", "_count")):
                before = expr.replace("${prefix}", "")[:match.start()].rstrip()
                assert before.endswith(("rate(", "increase(")), f"{title}: {name} raw"


def test_quantiles_come_from_bucket_rates_summed_by_le() -> None:
    quantile_exprs = [(t, e) for t, e in _exprs() if "histogram_quantile" in e]
    assert len(quantile_exprs) >= 8
    for title, expr in quantile_exprs:
        assert re.search(r"histogram_quantile\(0\.\d+, sum by \(le(, [a-z]+)*\) "
                         r"\(rate\(\$\{prefix\}vramgate_[a-z_]+_bucket\{", expr), f"{title}"


def test_every_query_has_balanced_brackets_and_quotes() -> None:
    pairs = {")": "(", "]": "[", "}": "{"}
    exprs = _exprs() + [(rule["alert"], rule["expr"]) for rule in _rules()]
    for title, expr in exprs:
        stack: list[str] = []
        for char in re.sub(r'"[^"]*"', '""', expr):
            if char in "([{":
                stack.append(char)
            elif char in pairs:
                assert stack and stack.pop() == pairs[char], f"{title}: {expr}"
        assert not stack, f"{title}: unclosed {stack} in {expr}"
        assert expr.count('"') % 2 == 0, f"{title}: {expr}"


def test_every_metric_has_a_panel() -> None:
    used = _used_specs("\n".join(expr for _, expr in _exprs()))
    missing = [spec.name for spec in SPECS if spec.name not in used]
    assert not missing, f"metrics without a panel: {missing}"


def test_the_checks_catch_wrong_names() -> None:
    """The name check is not vacuous: misspelt names, a histogram named without its series
    suffix, and a name that ignores ${prefix} are all reported."""
    good = 'sum(rate(${prefix}vramgate_ooms_total{deployment=~"$deployment"}[5m]))'
    assert _name_problems(good, "") == [] and _name_problems(good, "ray_") == []
    assert _name_problems("${prefix}vramgate_budget_byte", "")
    assert _name_problems("rate(${prefix}vramgate_queue_wait_seconds[5m])", "")
    assert _name_problems("vramgate_ooms_total", "ray_")  # hard-coded, no ${prefix}
    assert _name_problems("up", "") == ["no vramgate metric"]
    assert METRIC_TOKEN.findall('{__name__=~"${prefix}vramgate_.+"}') == []
    assert _used_specs(good) == {"ooms"}


# --- the alert rules ----------------------------------------------------------------------


def test_alert_rules_are_a_valid_prometheus_rule_file() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"} and doc["groups"]
    for group in doc["groups"]:
        assert group["name"] and group["rules"], group
    rules = _rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations",
                             "keep_firing_for"}, rule["alert"]
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", rule["alert"])
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert DURATION.match(str(rule["for"])), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["description"].strip(), rule["alert"]


def test_alert_exprs_name_only_exported_metrics() -> None:
    for rule in _rules():
        tokens = METRIC_TOKEN.findall(rule["expr"])
        assert tokens, rule["alert"]
        for token in tokens:
            assert token in EXPORTED, f"{rule['alert']}: {token} is not exported"


@pytest.mark.parametrize("needle", [
    "absent(vramgate_budget_bytes)",
    "vramgate_ooms_total",
    "vramgate_device_faults_total",
    "vramgate_cost_correction_factor",
    "vramgate_request_measured_over_estimated_bucket",
    "vramgate_queue_wait_seconds_bucket",
    'outcome="rejected"',
])
def test_the_starter_alerts_are_there(needle: str) -> None:
    assert any(needle in rule["expr"] for rule in _rules()), needle


# --- docs/observability.md ----------------------------------------------------------------


def _doc_section(heading: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _table_rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in _doc_section("Metric reference").splitlines():
        if line.startswith("| `vramgate_"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            name = cells[0].strip("`")
            assert name not in rows, f"{name} listed twice"
            rows[name] = cells
    return rows


def _table_name(spec: MetricSpec) -> str:
    return spec.exported_names[0] if spec.kind == "counter" else spec.full_name


def test_doc_metric_table_lists_exactly_the_specs() -> None:
    rows = _table_rows()
    assert set(rows) == {_table_name(spec) for spec in SPECS}
    for spec in SPECS:
        name, kind, labels, unit, series, meaning = rows[_table_name(spec)]
        assert kind == spec.kind, name
        assert re.findall(r"`([a-z_]+)`", labels.split("(")[0]) == list(
            COMMON_LABELS + spec.labels), name
        assert re.findall(r"`([a-z_]+)`", series) == list(spec.exported_names), name
        assert meaning.startswith(spec.description), name
        if spec.name.endswith("_bytes"):
            assert unit == "bytes", name
        elif spec.name.endswith("_byte_seconds"):  # bytes held x seconds held
            assert unit == "byte-seconds", name
        elif spec.name.endswith("_seconds"):
            assert unit == "seconds", name
        else:
            assert unit, name


def test_doc_explains_every_panel_and_carries_the_alert_rules() -> None:
    text = DOC.read_text()
    headings = set(re.findall(r"^### (.+)$", _doc_section("The dashboard, panel by panel"),
                              re.MULTILINE))
    titles = {panel["title"] for panel in _dashboard()["panels"]}
    assert titles <= headings, f"panels without a section: {sorted(titles - headings)}"
    blocks = [yaml.safe_load(block)
              for block in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)]
    assert yaml.safe_load(ALERTS.read_text()) in blocks, "docs and alerts.yaml differ"
    assert "/tmp/ray/prom_metrics_service_discovery.json" in text
    assert "https://docs.ray.io/en/latest/cluster/metrics.html" in text
