"""The metrics module: naming rules, and merging several processes' expositions."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_app.metrics import COMMON_LABELS, PREFIX, SPECS, ProcessMetrics, merge_expositions

ALLOWED_LABELS = {"outcome", "reason", "route", "status", "side",
                  "tenant"}  # configured tenants only: a request's tenant is its key's
UNITS = ("_bytes", "_seconds", "_depth", "_factor", "_over_estimated", "_sequences", "_blocks",
         "_jobs", "_batches")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_names_carry_the_prefix_a_unit_and_bounded_labels(spec) -> None:
    assert spec.full_name.startswith(f"{PREFIX}_")
    assert set(spec.labels) <= ALLOWED_LABELS
    if spec.kind == "counter":
        assert not spec.name.endswith("_total")  # prometheus-client appends it
    else:
        assert spec.name.endswith(UNITS), f"{spec.name}: no unit in the name"
    if spec.kind == "histogram":
        assert list(spec.buckets) == sorted(spec.buckets) and len(spec.buckets) >= 5


def test_two_processes_merge_into_one_exposition_without_doubling() -> None:
    replicas = [ProcessMetrics("ModelServer", f"r{i}", use_ray=False, model="minilm")
                for i in range(2)]
    ingress = ProcessMetrics("Ingress", "i0", use_ray=False)
    replicas[0].inc("admission_decisions", outcome="admitted", reason="at_once")
    replicas[1].inc("admission_decisions", 3, outcome="rejected", reason="queue_full")
    replicas[1].observe("queue_wait_seconds", 0.003)
    replicas[0].set("budget_bytes", 2**30)
    ingress.inc("http_requests", route="/v1/embeddings", status="200")
    merged = merge_expositions(p.exposition() for p in [*replicas, ingress])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    decisions = families["vramgate_admission_decisions"]
    assert decisions.type == "counter"
    assert sorted((s.labels["replica"], s.labels["outcome"], s.value)
                  for s in decisions.samples) == [("r0", "admitted", 1.0),
                                                  ("r1", "rejected", 3.0)]
    waits = [s for s in families["vramgate_queue_wait_seconds"].samples
             if s.name.endswith("_count")]
    assert [(s.labels["replica"], s.value) for s in waits] == [("r1", 1.0)]
    bucket = {s.labels["le"]: s.value for s in families["vramgate_queue_wait_seconds"].samples
              if s.name.endswith("_bucket")}
    assert bucket["0.0025"] == 0 and bucket["0.005"] == 1
    [budget] = families["vramgate_budget_bytes"].samples
    assert budget.labels == {"deployment": "ModelServer", "replica": "r0", "model": "minilm"}
    assert budget.value == 2**30
    [http] = families["vramgate_http_requests"].samples
    assert set(http.labels) == {*COMMON_LABELS, "route", "status"}
    # Every family once (help and type not repeated), no *_created series.
    assert merged.count("# TYPE vramgate_admission_decisions_total counter") == 1
    assert "_created" not in merged


def test_a_malformed_exposition_is_refused() -> None:
    with pytest.raises(ValueError):
        merge_expositions(["vramgate_x{not valid\n"])


def test_zeroed_counters_are_exported_at_zero_from_the_start() -> None:
    metrics = ProcessMetrics("ModelServer", "r0", use_ray=False, zeroed=("ooms",))
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition())}
    [ooms] = families["vramgate_ooms"].samples
    assert ooms.value == 0 and ooms.labels == {"deployment": "ModelServer", "replica": "r0",
                                               "model": ""}
    assert families["vramgate_device_faults"].samples == []  # not asked for


def test_an_ingress_records_each_model_apart_in_one_exposition() -> None:
    ingress = ProcessMetrics("Ingress", "i0", use_ray=False)
    ingress.for_model("chat").inc("admission_decisions", outcome="rejected",
                                  reason="predicted_timeout")
    ingress.for_model("minilm").inc("admission_decisions", 2, outcome="rejected",
                                    reason="predicted_timeout")
    ingress.inc("http_requests", route="/metrics", status="200")
    families = {f.name: f for f in text_string_to_metric_families(ingress.exposition())}
    assert sorted((s.labels["model"], s.value)
                  for s in families["vramgate_admission_decisions"].samples) == [
        ("chat", 1.0), ("minilm", 2.0)]
    [http] = families["vramgate_http_requests"].samples
    assert http.labels["model"] == "" and http.labels["replica"] == "i0"
