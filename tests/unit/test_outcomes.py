"""The label enums of :mod:`serve_app.outcomes`: the exact text each records, the values the
docs' metric reference lists, and the refusal codes that become a ``reason``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments.http.http_errors import as_serve_app_error
from deployments.replica.device_health import draining_error
from serve_app.admission import queue
from serve_app.admission.controller import _refusal
from serve_app.jobs.view import JobStatus
from serve_app.metrics import ProcessMetrics
from serve_app.outcomes import (
    DECISION_REASONS,
    AdmitReason,
    CancelReason,
    IdempotencyHit,
    JobOutcome,
    Outcome,
    Reason,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def _documented_values(metric: str) -> set[str]:
    """The backticked words of the ``Label values:`` sentence of ``metric``'s table row."""
    [row] = [line for line in DOC.read_text().splitlines()
             if line.startswith(f"| `{metric}` |")]
    sentence = row.split("Label values:")[1].split("Refusals before")[0]
    return set(re.findall(r"`([a-z_]+)`", sentence))


def test_the_label_texts_are_those_dashboards_and_alerts_read() -> None:
    assert [str(o) for o in Outcome] == ["admitted", "queued", "rejected", "cancelled"]
    assert [str(r) for r in Reason] == ["request_too_large", "queue_full", "queue_timeout",
                                        "predicted_timeout", "oom", "draining", "no_replicas",
                                        "tenant_quota"]
    assert [str(r) for r in AdmitReason] == ["at_once", "queued"]
    assert [str(r) for r in CancelReason] == ["client_gone"]
    assert [str(o) for o in JobOutcome] == ["succeeded", "failed", "cancelled", "requeued"]
    assert [str(o) for o in IdempotencyHit] == ["replayed", "coalesced"]
    assert f"{Reason.QUEUE_FULL}" == "queue_full" and Reason.QUEUE_FULL == "queue_full"
    assert (queue.Outcome, queue.Reason) == (Outcome, Reason)  # still importable from there


def test_the_docs_list_exactly_the_enum_values() -> None:
    decisions = {"outcome", "reason", *map(str, DECISION_REASONS)} | {
        str(reason) for enum in DECISION_REASONS.values() for reason in enum}
    assert _documented_values("vramgate_admission_decisions_total") == decisions
    assert Outcome.QUEUED not in DECISION_REASONS  # a queue decision, never counted
    assert _documented_values("vramgate_jobs_finished_total") == {
        "outcome", *map(str, JobOutcome)}
    assert _documented_values("vramgate_idempotency_hits_total") == {
        "outcome", *map(str, IdempotencyHit)}


def test_a_member_records_the_same_series_as_its_text() -> None:
    typed, spelled = (ProcessMetrics("ModelServer", "r0", use_ray=False) for _ in range(2))
    typed.inc("admission_decisions", 2, outcome=Outcome.REJECTED, reason=Reason.QUEUE_FULL)
    typed.inc("admission_decisions", outcome=Outcome.ADMITTED, reason=AdmitReason.of(0))
    typed.inc("jobs_finished", outcome=JobOutcome.of(JobStatus.QUEUED))
    spelled.inc("admission_decisions", 2, outcome="rejected", reason="queue_full")
    spelled.inc("admission_decisions", outcome="admitted", reason="at_once")
    spelled.inc("jobs_finished", outcome="requeued")
    assert typed.exposition() == spelled.exposition()
    samples = [s for f in text_string_to_metric_families(typed.exposition())
               if f.name == "vramgate_admission_decisions" for s in f.samples]
    assert {(s.labels["outcome"], s.labels["reason"], s.value) for s in samples} == {
        ("rejected", "queue_full", 2.0), ("admitted", "at_once", 1.0)}


@pytest.mark.parametrize(("position", "expected"), [(0, "at_once"), (1, "queued"),
                                                    (7, "queued")])
def test_an_admission_is_at_once_only_with_nobody_ahead(position, expected) -> None:
    assert AdmitReason.of(position) == expected


@pytest.mark.parametrize(("status", "expected"), [
    (JobStatus.QUEUED, "requeued"), (JobStatus.SUCCEEDED, "succeeded"),
    (JobStatus.FAILED, "failed"), (JobStatus.CANCELLED, "cancelled"), ("succeeded", "succeeded"),
])
def test_a_job_left_queued_was_requeued(status, expected) -> None:
    assert JobOutcome.of(status) is JobOutcome(expected)


def test_every_refusal_recorded_from_its_code_has_a_reason() -> None:
    """The replica records a refusal's ``reason`` from its error's ``code``
    (``Reason(exc.code)``): the codes admission and a device fault refuse with, and the
    ingress's ``no_replicas`` and handle ``queue_full``."""
    for reason in (Reason.REQUEST_TOO_LARGE, Reason.QUEUE_FULL, Reason.PREDICTED_TIMEOUT,
                   Reason.OOM):
        for no_wait in (False, True):
            refusal = _refusal(queue.Decision(Outcome.REJECTED, 10, reason=reason,
                                               predicted_wait_s=3.0), 5, 1.0,
                               no_wait)
            assert Reason(refusal.code) is reason
    assert Reason(draining_error().code) is Reason.DRAINING
    assert Reason(as_serve_app_error(DeploymentUnavailableError("m")).code) is \
        Reason.NO_REPLICAS
    assert Reason(as_serve_app_error(BackPressureError(num_queued_requests=1,
                                                       max_queued_requests=1)).code) is \
        Reason.QUEUE_FULL
