"""The replica's inference thread: admitted work runs on one dedicated thread, one job at a
time, never on the event loop.

A job is one forward pass for one or more admitted requests (:class:`Ticket` s, whose leases
together cover its price). The thread claims their leases when it is given the job and
reports back when it has really finished with it (:meth:`Ticket.device_done`), also after a
timeout or a client disconnect; a job whose callers all left before the thread reached it is
skipped. What the device's failures mean is
:class:`deployments.replica.device_health.DeviceHealth`'s
business; this module only tells it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from deployments.replica.device_health import DeviceHealth
from deployments.replica.inference_job import InferenceJob
from deployments.replica.request_log import RequestLog
from serve_app.admission.controller import AdmissionController
from serve_app.admission.ticket import Ticket
from serve_app.config import AdmissionConfig
from serve_app.errors import InferenceTimeoutError, OverloadedError
from serve_app.memory.probes import DeviceProbe
from serve_app.metrics import ProcessMetrics
from serve_app.outcomes import AdmitReason, CancelReason, Outcome, Reason

OnExpired = Callable[[int, OverloadedError], None]
"""Told a pass member's index and its 503 ``queue_timeout``: it waited its whole bound."""

EXPIRY_SLACK_S = 0.001
"""Wait left (seconds) that counts as none: asyncio's timers may wake a little early."""

PASS_MEAN_WEIGHT = 0.2
"""Weight of the newest pass in the mean pass duration (:meth:`InferenceThread.backlog_wait_s`):
about the last five passes count, so the mean follows a change of load within seconds."""


class InferenceThread:
    """Runs leased work for one replica.

    Args:
        executor: the single-thread executor (the replica profiles on it first).
        probe: the device probe (a job's peak bytes).
        health: the replica's device health (told of every failed job).
        gate: the admission controller (``Retry-After`` of a queue timeout).
        admission: the ``admission.*`` knobs (timeouts).
        metrics: the replica's metrics (decisions, waits, inference times).
        log: the replica's request log.

    Use from the replica's event loop.
    """

    def __init__(self, executor: ThreadPoolExecutor, probe: DeviceProbe, health: DeviceHealth,
                 gate: AdmissionController, admission: AdmissionConfig,
                 metrics: ProcessMetrics, log: RequestLog) -> None:
        self._executor, self.probe, self.health = executor, probe, health
        self._gate, self._admission = gate, admission
        self._metrics, self._log = metrics, log
        self.running = 0  # jobs handed to the thread and not yet returned
        self.total = 0  # passes the thread ran (abandoned ones not counted), + completions
        # finished on continuous batching (once each, however many steps)
        self.running_since: float | None = None  # monotonic start of the running job
        self.mean_pass_s: float | None = None  # mean duration of a pass (or a decode step)

    def start(self, tickets: Sequence[Ticket],
              work: Callable[[], Any]) -> tuple[asyncio.Future, InferenceJob]:
        """Queue ``work`` for the thread on behalf of ``tickets``, claiming their leases
        until the thread is done with it, whatever happens to the callers meanwhile
        (timeout, cancellation); work whose callers left before the thread reached it is
        skipped. Failures are reported to the device health here, so that they are learnt
        from also when nobody waits any more."""
        loop = asyncio.get_running_loop()
        job = InferenceJob(work, loop, self)
        for ticket in tickets:
            ticket.claim()
        try:
            future = loop.run_in_executor(self._executor, job)
        except BaseException:
            for ticket in tickets:
                ticket.device_done(ran=False)
            raise
        for ticket in tickets:
            ticket.mark_handed_to_thread(len(tickets))
        self.running += 1
        future.add_done_callback(lambda done: self._finished(done, job, list(tickets)))
        return future, job

    def mark_running(self, started_at: float) -> None:
        """On the inference thread: a job started at ``started_at`` (monotonic) runs now."""
        self.running_since = started_at

    def completion_finished(self, ticket: Ticket, inference_s: float) -> None:
        """A completion on continuous batching finished, ``inference_s`` after it joined:
        logged, its lease given back (:meth:`Ticket.device_done`), counted once in
        :attr:`total` however many steps it took, and timed."""
        self.log_finished(ticket, "ok", inference_s)
        ticket.device_done(ran=True)
        self.total += 1
        self._metrics.observe("inference_seconds", inference_s)

    def _finished(self, done: asyncio.Future, job: InferenceJob, tickets: list[Ticket]) -> None:
        self.running -= 1
        if self.running_since == job.started_at:  # the thread may have moved on already
            self.running_since = None
        error = None if done.cancelled() else done.exception()
        ran = job.started_at is not None
        leased_bytes = sum(t.lease.nbytes for t in tickets)
        if error is not None:  # before the bytes go back
            self.health.after_failure(error, leased_bytes, job.oom_needed_bytes, job.canary_ok)
        outcome = "ok" if error is None else (
            "oom" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__)
        for index, ticket in enumerate(tickets):
            if ran:  # a member refused while the pass waited rode along: not answered
                self.log_finished(ticket, Reason.QUEUE_TIMEOUT.value if index in job.refused
                                  else outcome, job.duration_s, job.peak_bytes)
            ticket.device_done(ran)
        self.total += ran
        if ran:
            self._record_pass(job.duration_s)
        self._observe(job, ran, error, tickets, leased_bytes)

    def _observe(self, job: InferenceJob, ran: bool, error: BaseException | None,
                 tickets: list[Ticket], leased_bytes: int) -> None:
        for _ in range(len(tickets) - len(job.refused)) if ran else ():  # each answered
            self._metrics.observe("inference_seconds", job.duration_s)  # member spent it
        if ran and leased_bytes > 0 and (
                error is None or isinstance(error, torch.OutOfMemoryError)):
            # An OOM'd request counts with what it needed at least: leaving it out would
            # hide the worst under-prices.
            measured = job.peak_bytes if error is None else job.oom_needed_bytes
            if measured is not None:
                self._metrics.observe("request_measured_over_estimated",
                                      measured / leased_bytes)

    def log_finished(self, ticket: Ticket, outcome: str, inference_s: float,
                     peak_bytes: int | None = None) -> None:
        """The request log's ``finished`` event (``outcome``: ``ok``, ``oom`` or the error's
        type name)."""
        self._log.event("finished", ticket.lease.nbytes, ticket.admission.request_id,
                        outcome=outcome, batch=ticket.batch, inference_s=round(inference_s, 4),
                        peak_bytes=peak_bytes)

    async def wait_started(self, future: asyncio.Future, job: InferenceJob,
                           tickets: Sequence[Ticket], count_gone: bool = True,
                           on_expired: OnExpired | None = None,
                           expired: frozenset[int] = frozenset()) -> float:
        """Wait until the thread takes up ``job``; return the seconds waited. This is queue
        wait too: with the wait for the lease it is bounded by ``admission.max_queue_wait_s``
        (or the client's shorter limit), for each ticket by its own bound.

        A pass waits as long as any member may (``expired``: indexes already refused). Given
        ``on_expired``, a member out of time is refused alone at its bound (``on_expired``
        with 503 ``queue_timeout``); the pass runs for the others (the refused member's
        output dropped, its lease claimed until the pass is done). Without it, the first
        bound to run out refuses all: a request admitted with little time left then cost the
        fresh ones batched with it their answers (measured: a light tenant refused after 1 s).

        Raises:
            OverloadedError: ``queue_timeout`` when every member's bound ran out (the job is
                abandoned, never run).
            asyncio.CancelledError: the caller left (the job is abandoned, never run; its
                clients are :meth:`client_gone`, unless ``count_gone`` is false: the caller
                counts them).
        """
        waited_from = time.monotonic()
        live = [i for i in range(len(tickets)) if i not in expired]
        try:
            await self._until_started(future, job, tickets, live, on_expired)
        except asyncio.CancelledError:
            job.abandon()
            if job.started_at is None and count_gone:
                for index in live:
                    self.client_gone(tickets[index].lease.nbytes,
                                     tickets[index].admission.request_id)
            raise
        thread_wait_s = time.monotonic() - waited_from
        for index in live:
            tickets[index].add_wait(thread_wait_s)
            self.admitted(tickets[index], len(tickets))
        return thread_wait_s

    async def _until_started(self, future: asyncio.Future, job: InferenceJob,
                             tickets: Sequence[Ticket], live: list[int],
                             on_expired: OnExpired | None) -> None:
        """:meth:`wait_started`'s wait, until the thread takes ``job`` up; ``live`` (the
        indexes of ``tickets`` still waiting) loses each member refused at its own bound
        meanwhile."""
        started = asyncio.ensure_future(job.started.wait())
        waited_from = time.monotonic()
        try:
            while True:
                lefts_s = self._lefts_s(tickets, live, time.monotonic() - waited_from)
                done, _ = await asyncio.wait({future, started},
                                             timeout=max(0.0, min(lefts_s.values())),
                                             return_when=asyncio.FIRST_COMPLETED)
                if done:
                    return
                lefts_s = self._lefts_s(tickets, live, time.monotonic() - waited_from)
                ran_out = [i for i in live if lefts_s[i] <= EXPIRY_SLACK_S]
                if len(ran_out) == len(live) or on_expired is None:
                    job.abandon()
                    raise self.queue_timeout([tickets[i] for i in live])
                self._refuse(job, tickets, ran_out, on_expired)
                live[:] = [i for i in live if i not in ran_out]
        finally:
            started.cancel()

    def _refuse(self, job: InferenceJob, tickets: Sequence[Ticket], indexes: Sequence[int],
                on_expired: OnExpired) -> None:
        """Refuse ``tickets[indexes]`` (out of time) alone; ``job`` runs for the others."""
        for index in indexes:
            job.refused.add(index)
            on_expired(index, self.queue_timeout([tickets[index]]))

    def _lefts_s(self, tickets: Sequence[Ticket], indexes: Sequence[int],
                 elapsed_s: float) -> dict[int, float]:
        """Seconds each of ``tickets[indexes]`` may wait, ``elapsed_s`` into the thread wait."""
        return {i: self._wait_left_s(tickets[i]) - elapsed_s for i in indexes}

    def client_gone(self, leased_bytes: int, request_id: str = "") -> None:
        """A request's client left before its answer was whole (queued, waiting for the
        thread, or half-way through a stream): an ordinary outcome, counted as
        ``cancelled``/``client_gone`` and one INFO line of the request log."""
        self._metrics.inc("admission_decisions", outcome=Outcome.CANCELLED,
                          reason=CancelReason.CLIENT_GONE)
        self._log.event("client gone", leased_bytes, request_id)

    def admitted(self, ticket: Ticket, batch: int) -> None:
        self._metrics.inc("admission_decisions", outcome=Outcome.ADMITTED,
                          reason=AdmitReason.of(ticket.admission.queue_position))
        self._metrics.observe("queue_wait_seconds", ticket.queue_wait_s)
        self._metrics.observe("tenant_queue_wait_seconds", ticket.queue_wait_s,
                              tenant=ticket.request.tenant)
        predicted_s = ticket.admission.predicted_wait_s
        if predicted_s is not None:
            error_s = ticket.queue_wait_s - predicted_s
            self._gate.record_error(error_s, ticket.request.tenant, ticket.request.priority)
            self._metrics.observe("queue_wait_prediction_error_seconds", abs(error_s),
                                  side="longer" if error_s > 0 else "shorter")
        self._log.event("admitted", ticket.lease.nbytes, ticket.admission.request_id,
                        queue_wait_s=round(ticket.queue_wait_s, 4),
                        queue_position=ticket.admission.queue_position, batch=batch)

    async def run(self, tickets: Sequence[Ticket], work: Callable[[], Any],
                  on_expired: OnExpired | None = None) -> Any:
        """:meth:`start`; once the thread runs it, wait up to ``inference_timeout_s``.
        Returns the result; each ticket's ``waited_s`` grows by the wait for the thread.
        ``on_expired``: told of each member of a pass out of time (:meth:`wait_started`).

        Raises:
            InferenceTimeoutError: the thread is still running at the deadline (the leases
                stay claimed until it returns).
            OverloadedError: ``oom`` or ``draining`` (device fault), see
                :meth:`DeviceHealth.error_for`; ``queue_timeout`` when the work waited
                ``max_queue_wait_s`` in all (for the lease, a batch and the thread) before
                starting (every member's bound, given ``on_expired``); it never starts then.
        """
        expired = [i for i, t in enumerate(tickets) if self._wait_left_s(t) <= 0]
        if len(expired) == len(tickets) or (expired and on_expired is None):
            for ticket in tickets:  # waited its whole bound before reaching the thread
                ticket.device_done(ran=False)
            raise self.queue_timeout(tickets)
        future, job = self.start(tickets, work)
        if expired:  # they ride along in the pass; their outputs are dropped
            self._refuse(job, tickets, expired, on_expired)
        await self.wait_started(future, job, tickets, on_expired=on_expired,
                                expired=frozenset(expired))
        try:
            async with asyncio.timeout(self._admission.inference_timeout_s):
                return await asyncio.shield(future)
        except TimeoutError:
            raise self.timeout_error() from None
        except RuntimeError as exc:
            raise self.health.error_for(exc, sum(t.lease.nbytes for t in tickets)) from None

    def run_step(self, work: Callable[[], Any], leased_bytes: int) -> Awaitable[Any]:
        """Hand one step of continuous batching (:mod:`deployments.replica.decode_loop`) to the
        thread now, and return what to await for its result: the step is queued on the
        thread before the caller goes on (it may do other work while the step runs). No
        lease changes hands here (the loop holds its sequences' leases across steps), and
        nothing waits for the step to start. A failure is reported to the device health with
        ``leased_bytes`` (the leases of the step's sequences) before the awaiting caller
        sees it. Await the result exactly once.

        Raises (when awaited):
            OverloadedError: ``oom`` or ``draining``, as :meth:`run`; other errors pass.
        """
        loop = asyncio.get_running_loop()
        job = InferenceJob(work, loop, self, announce_start=False)
        self.running += 1
        try:
            future = loop.run_in_executor(self._executor, job)
        except BaseException:
            self.running -= 1
            raise
        return self._step_result(future, job, leased_bytes)

    async def _step_result(self, future: asyncio.Future, job: InferenceJob,
                           leased_bytes: int) -> Any:
        try:
            result = await future
            self._record_pass(job.duration_s)
            return result
        except Exception as exc:
            self.health.after_failure(exc, leased_bytes, job.oom_needed_bytes, job.canary_ok)
            raise self.health.error_for(exc, leased_bytes) from None
        finally:
            self.running -= 1
            if self.running_since == job.started_at:
                self.running_since = None

    def _wait_left_s(self, ticket: Ticket) -> float:
        """Seconds ``ticket``'s request may still wait before it starts (its bound, less
        what it waited)."""
        return ticket.request.wait_bound_s(self._admission.max_queue_wait_s) \
            - ticket.queue_wait_s

    def backlog_wait_s(self, pending_passes: int = 0) -> float:
        """Seconds a request handed to the thread now would wait for it: the passes on (or
        queued for) the thread, plus ``pending_passes`` not yet formed, times the mean pass
        duration measured so far (an exponentially weighted mean, weight
        ``PASS_MEAN_WEIGHT``); 0 before any pass ran."""
        return (self.running + pending_passes) * (self.mean_pass_s or 0.0)

    def _record_pass(self, duration_s: float) -> None:
        self.mean_pass_s = duration_s if self.mean_pass_s is None else (
            PASS_MEAN_WEIGHT * duration_s + (1 - PASS_MEAN_WEIGHT) * self.mean_pass_s)

    def queue_timeout(self, tickets: Sequence[Ticket]) -> OverloadedError:
        """503 ``queue_timeout`` for work that waited its whole bound (``max_queue_wait_s``
        or the client's shorter limit) without starting (counted as rejected here)."""
        self._metrics.inc("admission_decisions", len(tickets), outcome=Outcome.REJECTED,
                          reason=Reason.QUEUE_TIMEOUT)
        bounds_s = [t.request.wait_bound_s(self._admission.max_queue_wait_s) for t in tickets]
        for ticket, waited_s in zip(tickets, bounds_s, strict=True):
            self._gate.record_timeout(waited_s, ticket.admission.predicted_wait_s,
                                      ticket.request.tenant, ticket.request.priority)
        bound_s = min(bounds_s)
        return OverloadedError(
            f"waited {bound_s:g} s for the inference thread without starting",
            code=Reason.QUEUE_TIMEOUT.value,
            retry_after_s=self._gate.backlog_retry_after_s(
                sum(t.lease.nbytes for t in tickets)))

    def timeout_error(self) -> InferenceTimeoutError:
        return InferenceTimeoutError(
            f"inference ran longer than {self._admission.inference_timeout_s:g} s")

    def check_health(self) -> None:
        """Raises RuntimeError after a device fault or while a job is stuck
        (:meth:`DeviceHealth.check`)."""
        self.health.check(self.running_since)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
