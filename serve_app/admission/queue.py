"""Admission decisions: lease now, wait in a bounded FIFO, or refuse.

Pure and synchronous: the caller passes nothing but byte counts and reads decisions back; time
comes from the injected clock. :mod:`serve_app.admission.controller` puts asyncio around it.

Semantics (README, "How admission works", step 4):

* a request larger than the whole budget is refused at once (``request_too_large``), it never
  waits out a timeout;
* fair, then FIFO: while anyone waits, newcomers queue behind them even if they would fit; the
  next admitted is the head of the backlogged tenant with the least byte-seconds of service
  per weight (:mod:`serve_app.admission.fair`; with one tenant, plain FIFO), first come first
  served within a tenant, and a head that does not fit blocks the queue, so large requests are
  never starved by small ones;
* one deadline per waiter, fixed at arrival (``max_queue_wait_s``), never restarted;
* cancelled or expired waiters leave the queue at once, and whatever they were blocking is
  admitted in the same call;
* ``queue_position`` is the number of waiters ahead at arrival in the fair order (its own
  tenant's, and the others' within its share), not a count that includes the running
  requests; :meth:`AdmissionQueue.positions` gives every waiter's position now;
* refused at once by prediction (``predicted_timeout``): a request whose predicted wait
  (:meth:`AdmissionQueue.predicted_wait_s`) exceeds the time it has left would only wait in
  vain; while no drain rate is measured nothing is refused on a guess.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from serve_app.admission.budget import Lease, MemoryBudget
from serve_app.admission.calibration import TenantCalibrations
from serve_app.admission.decision import Decision, Waiter
from serve_app.admission.drain import (
    MAX_RETRY_AFTER_S,
    MIN_WAIT_S,
    DrainRateEstimator,
    predicted_wait_s,
)
from serve_app.admission.fair import DEFAULT_TENANT, FairShare
from serve_app.admission.lanes import TenantLanes
from serve_app.admission.priority import PRIORITIES, Priority
from serve_app.outcomes import Outcome, Reason


@dataclass
class AdmissionQueue:
    """A :class:`MemoryBudget` behind a bounded FIFO queue with per-request deadlines.

    Args:
        budget: the byte budget leases are taken from.
        max_queue_len: waiters allowed at once; more are refused with ``queue_full``.
        max_queue_wait_s: longest wait before a waiter expires with ``queue_timeout``.
        clock: monotonic seconds (injected for tests).
        drain: completion-rate estimator behind ``Retry-After``.
        on_admit: called with each waiter the moment it is admitted (whatever call admitted
            it), so an async wrapper can wake it.
        on_change: called whenever waiters leave the queue (admitted, withdrawn, expired or
            evicted), i.e. whenever the positions of those behind them change.
        thread_wait_s: seconds a request admitted now would wait for the inference thread
            (its backlog of passes; see :meth:`predicted_wait_s`), ``0`` when unknown.
        refuse_predicted: refuse by prediction every request (``True``), or only those whose
            client gave a wait limit (``False``; ``admission.refuse_predicted_waits``).
        fair: the tenants' service and weights (one tenant: FIFO).
    """

    budget: MemoryBudget
    max_queue_len: int
    max_queue_wait_s: float
    _: KW_ONLY
    clock: Callable[[], float] = time.monotonic
    drain: DrainRateEstimator | None = None
    on_admit: Callable[[Waiter], None] | None = None
    on_change: Callable[[], None] | None = None
    thread_wait_s: Callable[[], float] = lambda: 0.0
    refuse_predicted: bool = True
    calibration: TenantCalibrations = field(default_factory=TenantCalibrations)
    fair: FairShare = None  # type: ignore[assignment]  # default: equal weights, ``clock``
    _waiters: OrderedDict[int, Waiter] = field(default_factory=OrderedDict, init=False)
    _classes: dict[Priority, TenantLanes] = field(
        default_factory=lambda: {p: TenantLanes() for p in PRIORITIES}, init=False)
    _predicted_refusals: deque = field(default_factory=deque, init=False)
    _queued_bytes: int = field(default=0, init=False)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1), init=False)

    def __post_init__(self) -> None:
        self.max_budget_bytes = self.budget.budget_bytes
        if self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        if self.drain is None:
            self.drain = DrainRateEstimator(clock=self.clock)
        if self.fair is None:
            self.fair = FairShare(clock=self.clock)
        self.budget.on_busy = self.drain.set_busy
        self.budget.on_lease = self._on_lease

    def _on_lease(self, lease: Lease, taken: bool) -> None:
        if taken:
            self.fair.leased(lease.lease_id, lease.tenant, lease.nbytes)
        else:
            self.fair.returned(lease.lease_id)

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def backlog(self) -> dict[str, tuple[int, int]]:
        """Each backlogged tenant's waiters and queued bytes (every class)."""
        found: dict[str, tuple[int, int]] = {}
        for lanes in self._classes.values():
            for tenant, lane in lanes.lanes.items():
                count, nbytes = found.get(tenant, (0, 0))
                found[tenant] = (count + len(lane), nbytes + lanes.bytes[tenant])
        return found

    def _before(self, priority: Priority, *, inclusive: bool = False) -> tuple[int, int]:
        """Waiters and bytes of the classes admitted before ``priority`` (and of
        ``priority`` itself when ``inclusive``)."""
        count = nbytes = 0
        for p in PRIORITIES[:PRIORITIES.index(priority) + inclusive]:
            count, nbytes = count + self._classes[p].count, nbytes + self._classes[p].total_bytes
        return count, nbytes

    def waiters(self) -> list[Waiter]:
        """The waiters, in arrival order."""
        return list(self._waiters.values())

    def submit(self, nbytes: int, waited_s: float = 0.0,
               wait_limit_s: float | None = None, after_in_flight: bool = False,
               tenant: str = DEFAULT_TENANT,
               priority: Priority = Priority.INTERACTIVE) -> Decision:
        """Admit ``nbytes`` now, queue it, or refuse it. Never blocks.

        ``waited_s``: how long the request already waited before reaching this queue (in
        Ray Serve's handle queue, say). ``wait_limit_s``: the longest the client will wait
        (``Prefer: wait``, its SDK's read timeout), if it said so. The request has
        ``min(max_queue_wait_s, wait_limit_s) - waited_s`` left: a queued request's deadline
        is that long after it arrived here, and one predicted to wait longer is refused now
        (``predicted_timeout``). ``after_in_flight``: it runs after all the work admitted
        before it (see :meth:`predicted_wait_s`). ``tenant``: whose it is (the fair order);
        ``priority``: its class (:mod:`serve_app.admission.priority`): it waits behind every
        waiter of the classes before it, and bypasses those of the classes after it.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        refused = self._refused_whatever_the_wait(nbytes, tenant)
        if refused is not None:
            return refused
        if wait_limit_s == 0:
            return self._at_once_or_refused(nbytes, after_in_flight, tenant, priority)
        left_s = self.time_left_s(waited_s, wait_limit_s)
        predicted_s = self.predicted_wait_s(nbytes, after_in_flight, tenant, priority)
        position = self._newcomer_position(tenant, nbytes, priority)
        refusal = self._refusal_by_prediction(nbytes, predicted_s, left_s, position,
                                              wait_limit_s, tenant, priority)
        if refusal is not None:
            return refusal
        if not self._before(priority, inclusive=True)[0]:
            lease = self.budget.try_reserve(nbytes, tenant)
            if lease is not None:
                return Decision(Outcome.ADMITTED, nbytes, lease=lease,
                                predicted_wait_s=predicted_s)
        if len(self._waiters) >= self.max_queue_len:
            needed = self._queued_bytes + nbytes - self.budget.free_bytes
            return Decision(Outcome.REJECTED, nbytes, reason=Reason.QUEUE_FULL,
                            retry_after_s=self._retry_after_s(needed),
                            queue_position=len(self._waiters))
        now = self.clock()
        waiter = Waiter(waiter_id=next(self._ids), nbytes=nbytes, enqueued_at=now,
                        deadline=now + left_s, position=position,
                        predicted_wait_s=predicted_s, tenant=tenant, priority=priority)
        self._enqueue(waiter)
        return Decision(Outcome.QUEUED, nbytes, waiter=waiter, queue_position=waiter.position,
                        predicted_wait_s=predicted_s)

    def _refused_whatever_the_wait(self, nbytes: int, tenant: str) -> Decision | None:
        """The refusal of a request too large for the budget, for the budget shrunk after an
        OOM, or over its tenant's quota; ``None`` when it may wait."""
        if nbytes > self.max_budget_bytes:
            return Decision(Outcome.REJECTED, nbytes, reason=Reason.REQUEST_TOO_LARGE)
        if not self.budget.fits_ever(nbytes):
            return Decision(Outcome.REJECTED, nbytes, reason=Reason.OOM,
                            retry_after_s=self._retry_after_s(nbytes))
        self.expire()
        over = self.fair.over_quota(tenant, nbytes, self.backlog().get(tenant, (0, 0)),
                                    self.max_budget_bytes)
        if over is None:
            return None
        return Decision(Outcome.REJECTED, nbytes, reason=Reason.TENANT_QUOTA,
                        retry_after_s=self._retry_after_s(over[1]), detail=over[0])

    def _refusal_by_prediction(self, nbytes: int, predicted_s: float | None, left_s: float,
                               position: int, wait_limit_s: float | None, tenant: str,
                               priority: Priority) -> Decision | None:
        """``predicted_timeout`` for a request predicted to wait ``predicted_s`` plus its
        tenant's and class's margin, with ``left_s`` to wait; ``None`` if it may wait."""
        if predicted_s is None or not (self.refuse_predicted or wait_limit_s is not None):
            return None
        margin_s = self.calibration.margin_s(tenant, priority)
        if (over_s := predicted_s + margin_s - left_s) <= 0:
            return None
        self._predicted_refusals.append(self.clock())
        return Decision(Outcome.REJECTED, nbytes, reason=Reason.PREDICTED_TIMEOUT,
                        retry_after_s=min(MAX_RETRY_AFTER_S, max(MIN_WAIT_S, over_s)),
                        queue_position=position, predicted_wait_s=predicted_s,
                        margin_s=margin_s)

    def _at_once_or_refused(self, nbytes: int, after_in_flight: bool, tenant: str,
                            priority: Priority) -> Decision:
        """A request that will not wait (``wait_limit_s`` 0): its lease now if nothing is
        queued ahead of it, nothing it would run after is leased (``after_in_flight``) and
        it fits; else ``predicted_timeout`` at once, with the wait it would have had as
        ``Retry-After``."""
        ahead = self._before(priority, inclusive=True)[0] > 0 or (
            after_in_flight and self.budget.reserved_bytes > 0)
        lease = None if ahead else self.budget.try_reserve(nbytes, tenant)
        predicted_s = self.predicted_wait_s(nbytes, after_in_flight, tenant, priority)
        if lease is not None:
            return Decision(Outcome.ADMITTED, nbytes, lease=lease, predicted_wait_s=0.0)
        self._predicted_refusals.append(self.clock())
        wait_s = predicted_s if predicted_s else self._retry_after_s(
            self._queued_bytes + nbytes - self.budget.free_bytes)
        return Decision(Outcome.REJECTED, nbytes, reason=Reason.PREDICTED_TIMEOUT,
                        retry_after_s=min(MAX_RETRY_AFTER_S, max(MIN_WAIT_S, wait_s)),
                        queue_position=self._newcomer_position(tenant, nbytes, priority),
                        predicted_wait_s=predicted_s)

    def refused_by_prediction(self, window_s: float) -> int:
        """Requests refused by prediction in the last ``window_s`` seconds: demand that did
        not wait, which the autoscaler counts with the waiters."""
        since = self.clock() - window_s
        while self._predicted_refusals and self._predicted_refusals[0] < since:
            self._predicted_refusals.popleft()
        return len(self._predicted_refusals)

    def time_left_s(self, waited_s: float = 0.0, wait_limit_s: float | None = None) -> float:
        """Seconds a request that already waited ``waited_s`` may still wait: the smaller of
        ``max_queue_wait_s`` and the client's ``wait_limit_s``, less ``waited_s`` (>= 0)."""
        limit_s = self.max_queue_wait_s if wait_limit_s is None \
            else min(self.max_queue_wait_s, wait_limit_s)
        return max(0.0, limit_s - max(0.0, waited_s))

    def predicted_wait_s(self, nbytes: int, after_in_flight: bool = False,
                         tenant: str = DEFAULT_TENANT,
                         priority: Priority = Priority.INTERACTIVE) -> float | None:
        """Seconds a request of ``tenant`` and ``priority`` of ``nbytes`` arriving now should
        wait before it starts (:func:`serve_app.admission.drain.predicted_wait_s` of the bytes
        admitted ahead of it: every waiter of the classes before its own, and in its class
        those ahead of it in the fair order, :meth:`FairShare.share_ahead`,
        with, when ``after_in_flight`` (forward passes, run in order on the one thread), the
        bytes leased now as well, and of the thread's backlog); ``None`` when nothing is
        measured yet. A request is refused when this plus the margin of its tenant's recent
        errors (``calibration``, :mod:`serve_app.admission.calibration`) exceeds its time;
        its ``Retry-After`` is how much shorter the wait must get."""
        lanes = self._classes[priority]
        ahead = self._before(priority)[1] + self.fair.share_ahead(
            tenant, lanes.bytes.get(tenant, 0) + nbytes, lanes.bytes)
        in_flight = self.budget.reserved_bytes + ahead - nbytes if after_in_flight else None
        return predicted_wait_s(ahead - self.budget.free_bytes,
                                self.drain.busy_bytes_per_s(), self.thread_wait_s(), in_flight)

    def positions(self) -> dict[int, tuple[int, float | None]]:
        """Every waiter's position now (waiters ahead of it in the fair order) and its
        predicted wait to be admitted (bytes admitted before it and its own, less what is
        free, over the drain rate; ``None`` while no rate is measured), by ``waiter_id``."""
        positions = {}
        free_bytes = self.budget.free_bytes
        for priority, lanes in self._classes.items():
            count_before, bytes_before = self._before(priority)
            for tenant, waiters in lanes.lanes.items():
                through = 0
                for own_ahead, waiter in enumerate(waiters.values()):
                    through += waiter.nbytes
                    ahead = bytes_before + self.fair.share_ahead(tenant, through, lanes.bytes)
                    position = count_before + self._position(lanes, tenant, through, own_ahead)
                    positions[waiter.waiter_id] = (position,
                                                   self.drain.drain_s(ahead - free_bytes))
        return positions

    def _position(self, lanes: TenantLanes, tenant: str, through_bytes: int,
                  own_ahead: int) -> int:
        """:meth:`FairShare.waiters_ahead` in one class of this queue."""
        return self.fair.waiters_ahead(tenant, through_bytes, own_ahead,
                                       lanes.sizes_of_others(tenant))

    def _newcomer_position(self, tenant: str, nbytes: int, priority: Priority) -> int:
        """Waiters ahead of a request of ``tenant`` and ``priority`` of ``nbytes`` queued
        now: every waiter of the classes before it, and :meth:`_position` in its own."""
        lanes = self._classes[priority]
        own = len(lanes.lanes.get(tenant, ()))
        return self._before(priority)[0] + self._position(
            lanes, tenant, lanes.bytes.get(tenant, 0) + nbytes, own)

    def release(self, lease: Lease) -> list[Waiter]:
        """Release ``lease`` (idempotent) and return the waiters admitted as a result."""
        if lease.release():
            self.drain.record(lease.nbytes)
        return self.pump()

    def cancel(self, waiter: Waiter) -> list[Waiter]:
        """Withdraw a waiter (client gone, or its wait timed out at the caller).

        If it had already been admitted, its lease is released. Returns the waiters admitted
        because it left.
        """
        if waiter.waiter_id in self._waiters:
            self._remove(waiter)
            self._changed()
            return self.pump()
        if waiter.lease is not None:
            # Admitted but never used: the bytes did not run, so they say nothing about drain.
            waiter.lease.release()
        return self.pump()

    def expire(self) -> list[Waiter]:
        """Remove every waiter whose deadline has passed; mark them ``expired``."""
        now = self.clock()
        gone = [w for w in self._waiters.values() if w.deadline <= now]
        for waiter in gone:
            self._remove(waiter)
            waiter.expired = True
        if gone:
            self._changed()
            self.pump()
        return gone

    def set_budget_bytes(self, budget_bytes: int) -> list[Waiter]:
        """Change the budget (AIMD after an OOM), at most to the budget the queue started
        with. Waiters that no longer fit even an idle replica are removed and marked
        ``evicted`` (returned); whoever now fits is admitted (via ``on_admit``)."""
        self.budget.set_budget_bytes(min(budget_bytes, self.max_budget_bytes))
        evicted = [w for w in self._waiters.values() if not self.budget.fits_ever(w.nbytes)]
        for waiter in evicted:
            self._remove(waiter)
            waiter.evicted = True
        if evicted:
            self._changed()
        self.pump()
        return evicted

    def timeout_retry_after_s(self, waiter: Waiter) -> float:
        """``Retry-After`` for a waiter that timed out: the time for the whole queue (itself
        included) to drain. Not just the bytes ahead of it: waiters time out in arrival order,
        so the first to give up has nothing ahead, yet everyone behind it will retry too."""
        own = 0 if waiter.waiter_id in self._waiters else waiter.nbytes
        return self._retry_after_s(self._queued_bytes + own - self.budget.free_bytes)

    def pump(self) -> list[Waiter]:
        """Admit waiters while the next one fits: in the first class with anyone waiting, the
        head of the backlogged tenant with the least service per weight
        (:meth:`FairShare.next_tenant`). Returns those admitted."""
        admitted = []
        while self._waiters:
            lanes = next(lanes for lanes in self._classes.values() if lanes)
            tenant = self.fair.next_tenant(lanes.lanes)
            head = lanes.head(tenant)
            lease = self.budget.try_reserve(head.nbytes, tenant)
            if lease is None:
                break
            self._remove(head)
            head.lease = lease
            admitted.append(head)
            if self.on_admit is not None:
                self.on_admit(head)
        if admitted:
            self._changed()
        return admitted

    def _enqueue(self, waiter: Waiter) -> None:
        """``waiter`` at the tail of its tenant's queue in its class; a tenant that was not
        backlogged in any class joins (:meth:`FairShare.joined`)."""
        backlogged = {t for lanes in self._classes.values() for t in lanes.lanes}
        if waiter.tenant not in backlogged:
            self.fair.joined(waiter.tenant, backlogged)
        self._classes[waiter.priority].add(waiter)
        self._waiters[waiter.waiter_id] = waiter
        self._queued_bytes += waiter.nbytes

    def _remove(self, waiter: Waiter) -> None:
        """``waiter`` out of the queue (admitted, withdrawn, expired or evicted)."""
        del self._waiters[waiter.waiter_id]
        self._queued_bytes -= waiter.nbytes
        self._classes[waiter.priority].remove(waiter)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _retry_after_s(self, bytes_needed: int) -> float:
        return self.drain.wait_s(bytes_needed, fallback_s=self.max_queue_wait_s)
