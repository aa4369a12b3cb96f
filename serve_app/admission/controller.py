"""Asyncio face of the admission queue: ``await acquire(nbytes)`` returns a lease or raises.

Uses asyncio only (no Ray, torch or FastAPI). Every path that leaves :meth:`acquire` without
returning a lease leaves nothing behind: a cancelled or timed-out waiter is withdrawn, and a
lease handed over in the same instant is released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from serve_app.admission.budget import Lease, MemoryBudget
from serve_app.admission.calibration import TenantCalibrations
from serve_app.admission.drain import DrainRateEstimator
from serve_app.admission.fair import DEFAULT_TENANT, FairShare, TenantQuota
from serve_app.admission.priority import Priority
from serve_app.admission.queue import AdmissionQueue, Decision, Outcome, Reason, Waiter
from serve_app.client_wait import NO_WAIT_BELOW_S
from serve_app.errors import OverloadedError, RequestTooLargeError, TenantQuotaError


@dataclass(frozen=True)
class Admission:
    """A granted request: its lease and how it got it.

    Attributes:
        lease: the bytes held; release with :meth:`AdmissionController.release`.
        queue_wait_s: seconds spent waiting for the lease, with any wait before the request
            reached the replica (``waited_s`` of :meth:`AdmissionController.acquire`).
        queue_position: waiters ahead of it when it was queued (0 if admitted at once).
        request_id: the request's id, for logs (set by the replica; empty if unknown).
        predicted_wait_s: the wait before it starts predicted at arrival, with any wait
            before it reached the replica, as ``queue_wait_s`` counts it (``None``: none
            could be), to be compared with the wait it got.
    """

    lease: Lease
    queue_wait_s: float
    queue_position: int
    request_id: str = ""
    predicted_wait_s: float | None = None


OnQueued = Callable[[int, float | None], None]
"""Told a waiting request's position (waiters ahead of it) and its predicted seconds to
admission (``None``: no drain rate measured), when it is queued and whenever it moves up."""


class AdmissionController:
    """Leases bytes of a replica's budget to requests, in fair order among tenants (FIFO
    within one), with bounded waits.

    Args:
        budget_bytes: the replica's byte budget (> 0).
        max_queue_len: requests that may wait at once; more get 503 ``queue_full``.
        max_queue_wait_s: longest wait for a lease; longer gets 503 ``queue_timeout``.
        clock: monotonic seconds, injected for tests.
        drain_window_s: window of the drain-rate estimate behind ``Retry-After``.
        thread_wait_s: the inference thread's backlog in seconds, for predictions
            (:meth:`AdmissionQueue.predicted_wait_s`).
        refuse_predicted: see :class:`AdmissionQueue`.
        prior_drain_bytes_per_s: the drain rate predictions use before one is measured
            (:class:`~serve_app.admission.drain.DrainRateEstimator`).
        weights: the tenants' weights (``auth.tenants``; one not named weighs 1).
        fair_queue: order waiters fairly among tenants (``admission.queue: fair``), or by
            arrival alone (``fifo``: every waiter queues as the default tenant).
        quotas: the tenants' quotas (429 ``tenant_quota`` beyond; ``fair_queue`` only).

    Must be used from one event loop (the replica's).
    """

    def __init__(self, budget_bytes: int, max_queue_len: int, max_queue_wait_s: float,
                 clock: Callable[[], float] = time.monotonic, drain_window_s: float = 10.0,
                 thread_wait_s: Callable[[], float] = lambda: 0.0,
                 refuse_predicted: bool = True,
                 prior_drain_bytes_per_s: float | None = None,
                 weights: Mapping[str, float] | None = None, fair_queue: bool = True,
                 quotas: Mapping[str, TenantQuota] | None = None):
        self._clock, self._fair_queue = clock, fair_queue
        self._futures: dict[int, asyncio.Future[Lease]] = {}
        self._watchers: dict[int, tuple[OnQueued, list[int]]] = {}
        self.queue = AdmissionQueue(
            MemoryBudget(budget_bytes), max_queue_len, max_queue_wait_s, clock=clock,
            drain=DrainRateEstimator(drain_window_s, clock, prior_drain_bytes_per_s),
            on_admit=self._wake,
            on_change=self._moved, thread_wait_s=thread_wait_s,
            refuse_predicted=refuse_predicted, fair=FairShare(weights, clock, quotas),
            calibration=TenantCalibrations({*(weights or {}), *(quotas or {})}))

    @property
    def budget(self) -> MemoryBudget:
        return self.queue.budget

    async def acquire(self, nbytes: int, waited_s: float = 0.0,
                      wait_limit_s: float | None = None,
                      on_queued: OnQueued | None = None,
                      after_in_flight: bool = False,
                      tenant: str = DEFAULT_TENANT,
                      priority: Priority = Priority.INTERACTIVE) -> Admission:
        """Wait for a lease of ``nbytes``. ``waited_s``: seconds the request already waited
        before it got here (see :meth:`AdmissionQueue.submit`); it shortens the wait allowed
        and counts in the admission's ``queue_wait_s``. ``wait_limit_s``: the client's own
        limit on its wait, if it gave one. ``on_queued``: told the request's position while
        it waits (:data:`OnQueued`). ``after_in_flight``: it runs after all the work admitted
        before it (forward passes; :meth:`AdmissionQueue.predicted_wait_s`). ``tenant``:
        whose request it is (its place in the fair order). ``priority``: its class (a batch
        request waits while any interactive one waits; :mod:`serve_app.admission.priority`).

        Raises:
            RequestTooLargeError: ``nbytes`` exceeds the whole measured budget (400, at once).
            OverloadedError: ``queue_full`` at arrival, ``predicted_timeout`` at arrival (its
                predicted wait exceeds the time it has), ``queue_timeout`` after that time,
                or ``oom`` when the budget, shrunk after an out-of-memory error, cannot hold
                it now (503, with ``retry_after_s``).
            asyncio.CancelledError: the caller was cancelled; nothing stays reserved.
        """
        waited_s = max(0.0, waited_s)
        decision = self.queue.submit(nbytes, waited_s, wait_limit_s, after_in_flight,
                                     self._fair_tenant(tenant), priority)
        if decision.outcome is Outcome.ADMITTED:
            return Admission(decision.lease, waited_s, 0,
                             predicted_wait_s=_after(waited_s, decision.predicted_wait_s))
        if decision.outcome is Outcome.REJECTED:
            raise _refusal(decision, self.queue.max_budget_bytes,
                           self.queue.time_left_s(waited_s, wait_limit_s), wait_limit_s == 0)
        waiter = decision.waiter
        if on_queued is not None:
            position, eta_s = self.queue.positions()[waiter.waiter_id]
            self._watchers[waiter.waiter_id] = (on_queued, [position])
            on_queued(position, eta_s)
        try:
            lease = await self._wait(waiter, waited_s)
        finally:
            self._watchers.pop(waiter.waiter_id, None)
        return Admission(lease, waited_s + self._clock() - waiter.enqueued_at, waiter.position,
                         predicted_wait_s=_after(waited_s, waiter.predicted_wait_s))

    async def _wait(self, waiter: Waiter, waited_s: float) -> Lease:
        """A queued waiter's lease, once admitted; raises as :meth:`acquire`."""
        future = asyncio.get_running_loop().create_future()
        self._futures[waiter.waiter_id] = future
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that arrives once the future is done (gh-86296), and the client would be served.
            async with asyncio.timeout(waiter.deadline - self._clock()):
                return await asyncio.shield(future)
        except (TimeoutError, asyncio.CancelledError) as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            if future.done() and future.exception() is not None:  # evicted in the same instant
                if cancelled:
                    raise
                raise future.exception() from None
            if future.done():
                lease = future.result()  # admitted in the same instant: keep or hand back
                if cancelled:
                    self.release(lease, ran=False)
                    raise
                return lease
            retry_after_s = self.queue.timeout_retry_after_s(waiter)
            self.queue.cancel(waiter)
            if cancelled:
                raise
            self.record_timeout(waited_s + self._clock() - waiter.enqueued_at,
                                _after(waited_s, waiter.predicted_wait_s), waiter.tenant,
                                waiter.priority)
            raise OverloadedError(
                f"waited {waiter.deadline - waiter.enqueued_at + waited_s:g} s for memory "
                "without being admitted", code=Reason.QUEUE_TIMEOUT.value,
                retry_after_s=retry_after_s, queue_position=waiter.position) from None
        finally:
            self._futures.pop(waiter.waiter_id, None)

    def has_spare_room(self) -> bool:
        """Whether work that waits elsewhere (a durable job, in its own queue) may start
        now: nobody waits here for a lease, and the inference thread's backlog is under half
        of ``max_queue_wait_s``, so it delays no request answered at once."""
        queue = self.queue
        return queue.queue_depth == 0 and queue.thread_wait_s() < queue.max_queue_wait_s / 2

    def spare_lease(self, nbytes: int, request_id: str = "",
                    tenant: str = DEFAULT_TENANT) -> Admission | None:
        """A durable job's lease of ``nbytes``, taken only if it is spare now
        (:meth:`has_spare_room`, and ``nbytes`` free in the budget); ``None`` otherwise: the
        job waits in its own queue, never in this one, and is never refused for memory.

        Raises:
            RequestTooLargeError: ``nbytes`` exceeds the whole measured budget (it never
                fits).
        """
        if nbytes > self.queue.max_budget_bytes:
            raise RequestTooLargeError(
                f"the job needs an estimated {nbytes} bytes of device memory, more than the "
                f"replica's whole budget of {self.queue.max_budget_bytes} bytes")
        lease = self.budget.try_reserve(nbytes, tenant) if self.has_spare_room() else None
        return None if lease is None else Admission(lease, 0.0, 0, request_id)

    def tenant_figures(self) -> dict[str, dict[str, float]]:
        """Each tenant's share of this replica now (``/v1/status``, and the ingress's fair
        predictions): its weight, requests waiting and their bytes, bytes held, byte-seconds
        served since start, and the seconds added to its interactive requests' predicted
        waits before refusing on them (``wait_margin_s``)."""
        fair, backlog = self.queue.fair, self.queue.backlog()
        now, margin_s = self._clock(), self.queue.calibration.margin_s
        return {t: {"weight": fair.weight(t), "waiting": backlog.get(t, (0, 0))[0],
                    "queued_bytes": backlog.get(t, (0, 0))[1], "held_bytes": fair.held_bytes(t),
                    "served_byte_s": round(fair.served_byte_s(t, now), 3),
                    "wait_margin_s": round(margin_s(self._fair_tenant(t)), 4)}
                for t in sorted({*fair.tenants(), *backlog, DEFAULT_TENANT})}

    def record_error(self, error_s: float, tenant: str = DEFAULT_TENANT,
                     priority: Priority = Priority.INTERACTIVE) -> None:
        """A request of ``tenant`` and ``priority`` waited ``error_s`` seconds longer (< 0:
        shorter) than predicted: the margin of its tenant's and class's predictions
        (:class:`~serve_app.admission.calibration.TenantCalibrations`; under ``fifo``, one
        for all)."""
        self.queue.calibration.record(error_s, self._fair_tenant(tenant), priority)

    def record_timeout(self, waited_s: float, predicted_wait_s: float | None,
                       tenant: str = DEFAULT_TENANT,
                       priority: Priority = Priority.INTERACTIVE) -> None:
        """A request of ``tenant`` and ``priority`` predicted to wait ``predicted_wait_s``
        gave up after ``waited_s`` (``queue_timeout``): its prediction fell short by at least
        the difference. Counted with the errors of admitted requests (:meth:`record_error`):
        left out, the worst misses, those that made a client wait its whole limit in vain,
        would never raise the margin."""
        if predicted_wait_s is not None:
            self.record_error(waited_s - predicted_wait_s, tenant, priority)

    def _fair_tenant(self, tenant: str) -> str:
        """The tenant ``tenant``'s requests queue as (under ``fifo``, the default one)."""
        return tenant if self._fair_queue else DEFAULT_TENANT

    def release(self, lease: Lease, *, ran: bool = True) -> None:
        """Return a lease's bytes (idempotent) and admit whoever now fits.

        ``ran=False`` for a lease whose request never used the device: its bytes do not count
        towards the measured drain rate.
        """
        if ran:
            self.queue.release(lease)
        else:
            lease.release()
            self.queue.pump()

    def retry_after_s(self, nbytes: int) -> float:
        """``Retry-After`` (seconds) for a request of ``nbytes`` refused now: the bytes queued
        ahead of it plus its own, less what is free, over the measured drain rate."""
        return self.queue.drain.wait_s(
            self.queue.queued_bytes + nbytes - self.budget.free_bytes,
            fallback_s=self.queue.max_queue_wait_s)

    def backlog_retry_after_s(self, nbytes: int) -> float:
        """``Retry-After`` for a request of ``nbytes`` refused for want of *time* (it held a
        lease but waited ``max_queue_wait_s`` for the inference thread): every byte leased or
        queued now, plus its own, over the measured drain rate, i.e. how long the work already
        admitted takes to finish. (:meth:`retry_after_s` would say 1 s there: the budget may
        have room while the thread has none.)"""
        return self.queue.drain.retry_after_s(
            self.budget.reserved_bytes + self.queue.queued_bytes + nbytes,
            fallback_s=self.queue.max_queue_wait_s)

    def set_budget_bytes(self, budget_bytes: int, retry_after_s: float) -> None:
        """Shrink or regrow the budget. Waiters too large for the new budget get 503 ``oom``
        with ``retry_after_s``; whoever now fits is admitted."""
        for waiter in self.queue.set_budget_bytes(budget_bytes):
            future = self._futures.get(waiter.waiter_id)
            if future is not None and not future.done():
                future.set_exception(OverloadedError(
                    "the replica's memory budget shrank after an out-of-memory error",
                    code=Reason.OOM.value, retry_after_s=retry_after_s,
                    queue_position=waiter.position))

    def _moved(self) -> None:
        """Waiters left the queue: tell every watched waiter that moved up its position."""
        if not self._watchers:
            return
        for waiter_id, (position, eta_s) in self.queue.positions().items():
            watched = self._watchers.get(waiter_id)
            if watched is not None and watched[1][0] != position:
                watched[1][0] = position
                watched[0](position, eta_s)

    def _wake(self, waiter: Waiter) -> None:
        future = self._futures.get(waiter.waiter_id)
        if future is not None and not future.done():
            future.set_result(waiter.lease)
        elif waiter.lease is not None:
            # Its caller is already gone (it cannot be: futures outlive their waiters); be safe.
            waiter.lease.release()


def _after(waited_s: float, predicted_wait_s: float | None) -> float | None:
    return None if predicted_wait_s is None else waited_s + predicted_wait_s


def _refusal(decision: Decision, budget_bytes: int, time_left_s: float,
             no_wait: bool = False) -> Exception:
    reason, nbytes = decision.reason, decision.nbytes
    retry_after_s, queue_position = decision.retry_after_s, decision.queue_position
    if reason is Reason.PREDICTED_TIMEOUT and no_wait:
        return OverloadedError(
            "refused at once: the client asked not to wait (Prefer: wait=0, or a limit under "
            f"{NO_WAIT_BELOW_S:g} s) and the request cannot start now", code=reason.value,
            retry_after_s=retry_after_s, queue_position=queue_position)
    if reason is Reason.PREDICTED_TIMEOUT:
        margin = (f" plus {decision.margin_s:.3g} s by which recent predictions fell short"
                  if decision.margin_s > 0 else "")
        return OverloadedError(
            f"refused at once: the predicted wait of {decision.predicted_wait_s:.3g} s{margin} "
            f"exceeds the {time_left_s:.3g} s this request may wait", code=reason.value,
            retry_after_s=retry_after_s, queue_position=queue_position)
    if reason is Reason.REQUEST_TOO_LARGE:
        return RequestTooLargeError(
            f"the request needs an estimated {nbytes} bytes of device memory, more than the "
            f"replica's whole budget of {budget_bytes} bytes; send fewer or shorter inputs")
    if reason is Reason.TENANT_QUOTA:
        return TenantQuotaError(decision.detail, retry_after_s=retry_after_s)
    if reason is Reason.OOM:
        return OverloadedError(
            "the replica's memory budget shrank after an out-of-memory error and cannot hold "
            "this request now", code=reason.value, retry_after_s=retry_after_s)
    return OverloadedError("the replica's admission queue is full",
                           code=reason.value, retry_after_s=retry_after_s,
                           queue_position=queue_position)
