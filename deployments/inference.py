"""The replica's inference thread and what it learns when the device fails.

Admitted work runs on one dedicated thread, one job at a time, never on the event loop. A
lease is released only when the thread has really finished with its job, also after a timeout
or a client disconnect. What goes wrong on the device becomes the replica's state here:

- an out-of-memory error frees PyTorch's cached blocks, runs a canary inference that checks
  the output for NaN/Inf, corrects the cost model from the observed point, and shrinks the
  budget (AIMD, :mod:`serve_app.admission.aimd`);
- a canary with non-finite output, or a non-OOM CUDA error ("device-side assert", "illegal
  memory access"), marks a device fault: the replica admits nothing more and fails its health
  check so Ray Serve replaces it; the budget is not shrunk;
- an inference running past ``admission.stuck_after_timeouts`` x ``inference_timeout_s``
  fails the health check too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from serve_app.admission.aimd import AimdBudget
from serve_app.admission.controller import Admission, AdmissionController
from serve_app.config import AdmissionConfig
from serve_app.errors import InferenceTimeoutError, OverloadedError
from serve_app.memory.cost_model import CorrectedCostModel, failed_allocation_bytes
from serve_app.memory.probes import DeviceProbe
from serve_app.metrics import ProcessMetrics

logger = logging.getLogger("ray.serve")

# Substrings of the CUDA errors after which a process's CUDA context is unusable. PyTorch raises
# them as RuntimeError carrying CUDA's own message, e.g. "CUDA error: an illegal memory access
# was encountered" or "CUDA error: device-side assert triggered".
DEVICE_FAULT_MARKS = ("CUDA error", "illegal memory access", "device-side assert")


def is_device_fault(exc: BaseException) -> bool:
    """A non-OOM CUDA error that leaves the CUDA context unusable."""
    return (isinstance(exc, RuntimeError) and not isinstance(exc, torch.OutOfMemoryError)
            and any(mark in str(exc) for mark in DEVICE_FAULT_MARKS))


class InferenceThread:
    """Runs leased work for one replica and keeps its device state.

    Args:
        executor: the single-thread executor (the replica profiles on it first).
        engine: the loaded engine; its ``canary()`` runs after an OOM.
        probe: the replica's device probe (bytes in use when a job starts and when it fails).
        gate: the replica's admission controller; leases go back to it.
        cost_model: the prices; corrected from observed OOM points.
        aimd: the adaptive budget under ``admission.policy: budget``, else ``None``.
        admission: the ``admission.*`` knobs (timeouts).
        metrics: the replica's metrics (decisions, waits, inference times, OOMs).

    Use from the replica's event loop, except what the docstrings say runs on the thread.
    """

    def __init__(self, executor: ThreadPoolExecutor, engine: Any, probe: DeviceProbe,
                 gate: AdmissionController, cost_model: CorrectedCostModel,
                 aimd: AimdBudget | None, admission: AdmissionConfig,
                 metrics: ProcessMetrics) -> None:
        self._executor, self._engine, self._probe = executor, engine, probe
        self._gate, self._cost_model, self._aimd = gate, cost_model, aimd
        self._admission, self._metrics = admission, metrics
        self.running = 0  # jobs handed to the thread and not yet returned
        self.total = 0  # jobs the thread ran (abandoned ones not counted)
        self.running_since: float | None = None  # monotonic start of the running job
        self.oom_count = 0
        self.device_fault: str | None = None
        self._allocator_summary_logged = False

    # --- running work --------------------------------------------------------------------

    def start(self, admissions: Admission | Sequence[Admission],
              work: Callable[[], Any]) -> tuple[asyncio.Future, _Job]:
        """Queue ``work`` for the thread: one request's, or one batch's (``admissions``: its
        members, whose leases together cover the batch's price). The leases are released when
        the thread is done with the work, whatever happens to the callers meanwhile (timeout,
        cancellation); work whose callers left before the thread reached it is skipped. The
        OOM and device-fault bookkeeping happens here too, so it also runs for work nobody
        waits for any more."""
        members = _members(admissions)
        leased_bytes = sum(m.lease.nbytes for m in members)
        loop = asyncio.get_running_loop()
        job = _Job(work, loop, self)
        try:
            future = loop.run_in_executor(self._executor, job)
        except BaseException:
            for member in members:
                self._gate.release(member.lease, ran=False)
            raise
        self.running += 1

        def finished(done: asyncio.Future) -> None:
            self.running -= 1
            if self.running_since == job.started_at:  # the thread may have moved on already
                self.running_since = None
            error = None if done.cancelled() else done.exception()
            ran = job.started_at is not None
            if isinstance(error, torch.OutOfMemoryError):
                self._after_oom(leased_bytes, job)  # before the bytes go back
            elif error is not None and is_device_fault(error):
                self.mark_device_fault(str(error))
            outcome = "ok" if error is None else (
                "oom" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__)
            for member in members:
                if ran:
                    self.log_event("finished", member.lease.nbytes, member.request_id,
                                   outcome=outcome, batch=len(members),
                                   inference_s=round(job.duration_s, 4),
                                   peak_bytes=job.peak_bytes)
                self._gate.release(member.lease, ran=ran)
                self.log_event("lease released", member.lease.nbytes, member.request_id,
                               ran=ran, batch=len(members))
            self.total += ran
            for _ in members if ran else ():  # each member spent this on the thread
                self._metrics.observe("inference_seconds", job.duration_s)
            if ran and leased_bytes > 0 and (
                    error is None or isinstance(error, torch.OutOfMemoryError)):
                # An OOM'd request counts with what it needed at least: leaving it out would
                # hide the worst under-prices.
                measured = job.peak_bytes if error is None else job.oom_needed_bytes
                if measured is not None:
                    self._metrics.observe("request_measured_over_estimated",
                                          measured / leased_bytes)

        future.add_done_callback(finished)
        return future, job

    async def wait_started(self, future: asyncio.Future, job: _Job,
                           admissions: Admission | Sequence[Admission]) -> float:
        """Wait until the thread takes up ``job``; return the seconds waited. This is queue
        wait too: with the wait for the lease it is bounded by ``admission.max_queue_wait_s``
        (for a batch, by its member that has waited longest).

        Raises:
            OverloadedError: ``queue_timeout`` (the job is abandoned, never run).
            asyncio.CancelledError: the caller left (the job is abandoned, never run).
        """
        members = _members(admissions)
        started = asyncio.ensure_future(job.started.wait())
        waited_from = time.monotonic()
        limit_s = max(0.0, self._admission.max_queue_wait_s
                      - max(m.queue_wait_s for m in members))
        try:
            done, _ = await asyncio.wait({future, started}, timeout=limit_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.abandoned = True
            if job.started_at is None:
                self._metrics.inc("admission_decisions", len(members), outcome="cancelled",
                                  reason="client_gone")
            raise
        finally:
            started.cancel()
        if not done:
            job.abandoned = True
            raise self._queue_timeout(members)
        thread_wait_s = time.monotonic() - waited_from
        for member in members:
            self._metrics.inc("admission_decisions", outcome="admitted",
                              reason="queued" if member.queue_position else "at_once")
            queue_wait_s = member.queue_wait_s + thread_wait_s
            self._metrics.observe("queue_wait_seconds", queue_wait_s)
            self.log_event("admitted", member.lease.nbytes, member.request_id,
                           queue_wait_s=round(queue_wait_s, 4),
                           queue_position=member.queue_position, batch=len(members))
        return thread_wait_s

    def log_event(self, event: str, estimated_bytes: int, request_id: str = "",
                  level: int = logging.INFO, **fields: Any) -> None:
        """Log one moment of a request (``arrived``, ``admitted``, ``finished``, ``lease
        released``) with the replica, the request's estimated bytes, ``fields`` and a device
        memory snapshot. The request id is Ray Serve's (it adds it within the request's
        context) or ``request_id`` (a batch runs outside its members' contexts); fields that
        are ``None`` (a peak not measured) are left out; under
        ``logging.encoding: JSON`` every field is a JSON key (Ray's JSON formatter keeps
        ``extra`` attributes)."""
        if not logger.isEnabledFor(level):
            return
        extra = {"event": event, "replica": self._metrics.common["replica"],
                 "estimated_bytes": estimated_bytes,
                 **{k: v for k, v in fields.items() if v is not None},
                 **self._probe.memory_snapshot()}
        if request_id:
            extra["request_id"] = request_id
        logger.log(level, "request %s: %s", event,
                   " ".join(f"{k}={v}" for k, v in extra.items() if k != "event"), extra=extra)

    async def run(self, admission: Admission | Sequence[Admission],
                  work: Callable[[], Any]) -> tuple[Any, float]:
        """:meth:`start`; once the thread runs it, wait up to ``inference_timeout_s``.
        Returns the result and the seconds spent waiting for the thread (queue wait).

        Raises:
            InferenceTimeoutError: the thread is still running at the deadline (its lease
                stays held until it returns).
            OverloadedError: ``oom`` or ``draining`` (device fault), see :meth:`failure`;
                ``queue_timeout`` when the work waited ``max_queue_wait_s`` in all (for the
                lease, a batch and the thread) before starting; it never starts then.
        """
        members = _members(admission)
        if max(m.queue_wait_s for m in members) >= self._admission.max_queue_wait_s:
            for member in members:  # waited its whole bound before reaching the thread
                self._gate.release(member.lease, ran=False)
            raise self._queue_timeout(members)
        future, job = self.start(admission, work)
        thread_wait_s = await self.wait_started(future, job, admission)
        try:
            async with asyncio.timeout(self._admission.inference_timeout_s):
                return await asyncio.shield(future), thread_wait_s
        except TimeoutError:
            raise self.timeout_error() from None
        except RuntimeError as exc:
            raise self.failure(exc, admission) from None

    def _queue_timeout(self, members: list[Admission]) -> OverloadedError:
        """503 ``queue_timeout`` for work that waited ``max_queue_wait_s`` without starting
        (counted as rejected here)."""
        self._metrics.inc("admission_decisions", len(members), outcome="rejected",
                          reason="queue_timeout")
        return OverloadedError(
            f"waited {self._admission.max_queue_wait_s:g} s for the inference thread without "
            "starting", code="queue_timeout",
            retry_after_s=self._gate.backlog_retry_after_s(
                sum(m.lease.nbytes for m in members)))

    def failure(self, exc: RuntimeError,
                admission: Admission | Sequence[Admission]) -> Exception:
        """What the caller of a failed job raises: 503 ``oom`` with ``Retry-After`` for an
        out-of-memory error, 503 ``draining`` for a device fault; other errors are bugs and
        pass through."""
        if isinstance(exc, torch.OutOfMemoryError):
            return OverloadedError("the device ran out of memory; retry later", code="oom",
                                   retry_after_s=self._gate.retry_after_s(
                                       sum(m.lease.nbytes for m in _members(admission))))
        if is_device_fault(exc):
            return self.draining_error()
        return exc

    def timeout_error(self) -> InferenceTimeoutError:
        return InferenceTimeoutError(
            f"inference ran longer than {self._admission.inference_timeout_s:g} s")

    @staticmethod
    def draining_error() -> OverloadedError:
        return OverloadedError("the model replica hit a device fault and is being replaced",
                               code="draining", retry_after_s=1)

    # --- device state --------------------------------------------------------------------

    def mark_device_fault(self, reason: str) -> None:
        """Stop admitting and fail health checks from now on (Ray Serve replaces the
        replica). The budget is left as it is."""
        if self.device_fault is None:
            logger.error("device fault, the replica will be replaced: %s", reason)
            self.device_fault = reason
            self._metrics.inc("device_faults")

    def check_health(self) -> None:
        """Raises RuntimeError after a device fault, or while a job has run longer than
        ``stuck_after_timeouts`` x ``inference_timeout_s``."""
        if self.device_fault is not None:
            raise RuntimeError(f"device fault: {self.device_fault}")
        stuck_after_s = self._admission.stuck_after_timeouts * self._admission.inference_timeout_s
        if self.running_since is not None:
            running_s = time.monotonic() - self.running_since
            if running_s > stuck_after_s:
                raise RuntimeError(f"an inference has run for {running_s:.0f} s "
                                   f"(stuck after {stuck_after_s:g} s)")

    def regrow_budget(self) -> None:
        """One AIMD regrowth step if a quiet period has passed (called periodically)."""
        if self._aimd is not None and (budget := self._aimd.regrow()) is not None:
            self._gate.set_budget_bytes(budget, retry_after_s=1)
            self._metrics.inc("budget_regrowths")
            logger.info("budget regrown to %d bytes", budget)

    def _after_oom(self, priced_bytes: int, job: _Job) -> None:
        self.oom_count += 1
        self._metrics.inc("ooms")
        if job.canary_ok is False:
            self.mark_device_fault("the canary inference after an out-of-memory error gave "
                                   "NaN/Inf output")
            return
        if self._cost_model.observe_oom(priced_bytes, job.oom_needed_bytes):
            logger.warning("out of memory: a request priced %d bytes needed at least %d; "
                           "prices now x%.2f of the profile (profile again if this recurs)",
                           priced_bytes, job.oom_needed_bytes, self._cost_model.factor)
        if self._aimd is not None:
            budget = self._aimd.on_oom()
            self._gate.set_budget_bytes(budget, self._gate.retry_after_s(priced_bytes))
            self._metrics.inc("budget_shrinks")
            logger.warning("out of memory: budget shrunk to %d bytes (%d OOMs so far)",
                           budget, self.oom_count)

    def recover_after_oom(self) -> bool | None:
        """On the thread, after an OOM: return cached blocks to the device
        (``torch.cuda.empty_cache``) and run the engine's canary. Returns ``True`` (finite
        output), ``False`` (NaN/Inf, or the canary failed otherwise) or ``None`` (the canary
        itself ran out of memory: inconclusive)."""
        if not self._allocator_summary_logged:  # once per replica: it is long
            self._allocator_summary_logged = True
            summary = (torch.cuda.memory_summary() if torch.cuda.is_available()
                       else f"{self._probe.device}: {self._probe.memory_snapshot()}")
            logger.warning("first out-of-memory error of this replica; allocator state:\n%s",
                           summary)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            return bool(self._engine.canary())
        except torch.OutOfMemoryError:
            logger.warning("the canary inference after an OOM ran out of memory too")
            return None
        except Exception:
            logger.exception("the canary inference after an OOM failed")
            return False

    def status(self) -> dict[str, Any]:
        return {"inferences_running": self.running, "inferences_total": self.total,
                "oom_count": self.oom_count, "device_fault": self.device_fault,
                "cost_correction_factor": round(self._cost_model.factor, 4),
                "cost_corrections": self._cost_model.corrections}

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _members(admissions: Admission | Sequence[Admission]) -> list[Admission]:
    return [admissions] if isinstance(admissions, Admission) else list(admissions)


class _Job:
    """One request's work for the thread: says when the thread took it up, is skipped if its
    caller left before that, and measures its time and peak bytes (the probe's per-request
    peak). After an out-of-memory error it records how many bytes the work needed at least
    (its peak so far + the allocation that failed) and the canary's verdict, then re-raises
    the error without the failed work's frames, so their tensors are freed before the cache
    is emptied."""

    def __init__(self, work: Callable[[], Any], loop: asyncio.AbstractEventLoop,
                 thread: InferenceThread) -> None:
        self._work, self._loop, self._thread = work, loop, thread
        self.started = asyncio.Event()
        self.started_at: float | None = None
        self.abandoned = False
        self.duration_s = 0.0
        self.peak_bytes: int | None = None  # None: not measured (the host probe samples)
        self.oom_needed_bytes = 0
        self.canary_ok: bool | None = None

    def __call__(self) -> Any:  # on the inference thread
        if self.abandoned:
            return None
        self.started_at = self._thread.running_since = time.monotonic()
        self._loop.call_soon_threadsafe(self.started.set)
        probe = self._thread._probe
        probe.begin_request()
        try:
            return self._work()
        except torch.OutOfMemoryError as exc:
            message = str(exc)
            self.oom_needed_bytes = (probe.request_peak_bytes() or 0) \
                + failed_allocation_bytes(message)
        finally:
            self.peak_bytes = probe.request_peak_bytes()
            self.duration_s = time.monotonic() - self.started_at
        self.canary_ok = self._thread.recover_after_oom()
        raise torch.OutOfMemoryError(message)
