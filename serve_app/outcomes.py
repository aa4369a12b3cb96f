"""Every value an ``outcome`` or ``reason`` label of a metric takes, as enums.

A metric's outcome and reason are recorded from these members only, never from a string
written at the call site (``tests/unit/test_code_shape.py`` holds it), so a label value
cannot be a typo. They are ``StrEnum`` s: a member *is* its label text
(``str(Reason.QUEUE_FULL) == "queue_full"``), which dashboards, alert rules and the docs'
metric reference read; renaming a value changes the exported series.

``vramgate_admission_decisions_total`` pairs an :class:`Outcome` with a reason from the enum
:data:`DECISION_REASONS` names for it: ``admitted`` with an :class:`AdmitReason`,
``rejected`` with a :class:`Reason`, ``cancelled`` with a :class:`CancelReason`.
``vramgate_jobs_finished_total`` takes a :class:`JobOutcome`,
``vramgate_idempotency_hits_total`` an :class:`IdempotencyHit`,
``vramgate_batches_finished_total`` a :class:`BatchOutcome` and
``vramgate_batch_lines_finished_total`` a :class:`BatchLineOutcome`.
"""

from __future__ import annotations

import enum

from serve_app.jobs.view import JobStatus


class Outcome(enum.StrEnum):
    """What admission made of a request.

    An :class:`~serve_app.admission.queue.AdmissionQueue` decision is ``admitted``,
    ``queued`` or ``rejected``; the ``admission_decisions`` metric counts ``admitted``,
    ``rejected`` and ``cancelled`` (the client left first), never ``queued``.
    """

    ADMITTED = "admitted"
    QUEUED = "queued"
    REJECTED = "rejected"
    CANCELLED = "cancelled"


class Reason(enum.StrEnum):
    """Why a request was refused (the ``code`` of its HTTP error)."""

    REQUEST_TOO_LARGE = "request_too_large"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    PREDICTED_TIMEOUT = "predicted_timeout"  # its predicted wait exceeds the time it has
    OOM = "oom"  # fits the measured budget, not the budget shrunk after an OOM
    DRAINING = "draining"  # the replica had a device fault and is being replaced
    NO_REPLICAS = "no_replicas"  # refused at the ingress: no model replica to send it to
    TENANT_QUOTA = "tenant_quota"  # its tenant's quota is in use (429, not 503)


class AdmitReason(enum.StrEnum):
    """How an admitted request got its lease: ``at_once``, or after waiting ``queued``."""

    AT_ONCE = "at_once"
    QUEUED = "queued"

    @classmethod
    def of(cls, queue_position: int) -> AdmitReason:
        """The reason of a request that had ``queue_position`` waiters ahead (0: none)."""
        return cls.QUEUED if queue_position else cls.AT_ONCE


class CancelReason(enum.StrEnum):
    """Why an admission ended without an answer on the replica's side."""

    CLIENT_GONE = "client_gone"  # the client left (queued, waiting, or half-way through)


DECISION_REASONS: dict[Outcome, type[enum.StrEnum]] = {
    Outcome.ADMITTED: AdmitReason, Outcome.REJECTED: Reason, Outcome.CANCELLED: CancelReason}
"""The ``reason`` label values of each ``outcome`` of ``admission_decisions``."""


class JobOutcome(enum.StrEnum):
    """How a durable job left its worker (``jobs_finished``)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # a cancel was requested while it ran
    REQUEUED = "requeued"  # a transient 503: back at the queue's head

    @classmethod
    def of(cls, status: JobStatus) -> JobOutcome:
        """The outcome of a job its worker left in ``status`` (``queued``: requeued)."""
        return cls.REQUEUED if status == JobStatus.QUEUED else cls(status)


class BatchLineOutcome(enum.StrEnum):
    """How a line of a Batch API batch ended (``batch_lines_finished``)."""

    COMPLETED = "completed"  # in the output file
    FAILED = "failed"  # in the error file (the job failed, or was cancelled or expired)


class BatchOutcome(enum.StrEnum):
    """The final status of a Batch API batch (``batches_finished``)."""

    COMPLETED = "completed"
    FAILED = "failed"  # refused in validation
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class IdempotencyHit(enum.StrEnum):
    """How a request with a known Idempotency-Key was answered (``idempotency_hits``)."""

    REPLAYED = "replayed"  # from the stored response
    COALESCED = "coalesced"  # joined the execution still running
