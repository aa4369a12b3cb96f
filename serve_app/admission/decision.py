"""What the admission queue answers (:mod:`serve_app.admission.queue`): a waiter, and the
decision on a request. Pure."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from serve_app.admission.budget import Lease
from serve_app.admission.fair import DEFAULT_TENANT
from serve_app.admission.priority import Priority
from serve_app.outcomes import Outcome, Reason


@dataclass(eq=False, kw_only=True)
class Waiter:
    """A request waiting for its lease. ``lease`` is set when it is admitted."""

    waiter_id: int
    nbytes: int
    enqueued_at: float
    deadline: float
    position: int
    predicted_wait_s: float | None = None
    lease: Lease | None = None
    expired: bool = False
    evicted: bool = False
    tenant: str = DEFAULT_TENANT
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True)
class Decision:
    """The answer to :meth:`AdmissionQueue.submit`.

    Exactly one of ``lease`` (admitted), ``waiter`` (queued) or ``reason`` (rejected) is set.
    ``retry_after_s`` (seconds, with its fraction) is set for retryable rejections.
    ``predicted_wait_s``: the wait predicted at arrival, ``None`` when none could be;
    ``margin_s``: the calibration margin added to it when it was refused by prediction.
    """

    outcome: Outcome
    nbytes: int
    _: KW_ONLY
    lease: Lease | None = None
    waiter: Waiter | None = None
    reason: Reason | None = None
    retry_after_s: float | None = None
    queue_position: int = 0
    predicted_wait_s: float | None = None
    margin_s: float = 0.0
    detail: str = ""
    """Why, in words, where the reason alone does not say (``tenant_quota``)."""
