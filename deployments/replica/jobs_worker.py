"""A model replica's puller of durable jobs: it takes the next job from the app's queue in
Redis only when the job's price fits the replica's budget now, so a job never gets a 503 for
memory: it waits in the durable queue instead.

Jobs yield to requests answered at once: a replica pulls only while its admission controller
has spare room (:meth:`AdmissionController.has_spare_room`: nobody waits in its admission
queue and its inference thread's backlog is under half of ``admission.max_queue_wait_s``).
The job's record holds its request as the ingress validated, tokenized and priced it, and how
its result renders (:mod:`serve_app.jobs.payload`): the replica prices that request as it
prices any request (its cost model and policy), takes the lease from the controller
(:meth:`AdmissionController.spare_lease`), then claims the job (one claimer wins,
:meth:`JobStore.claim`), and runs it through the request lifecycle with that lease: batching,
timeouts, OOM handling and lease accounting are the same as for any request. A transient
refusal (503) puts the job back at the queue's head; a 4xx or 5xx fails it with the error
body; a cancel that comes while it runs stops it within ``jobs.poll_interval_s``, as a client
that left stops a request (vLLM aborts it), and records it ``cancelled``; an outcome the store
cannot take now (its Redis restarting) is written again until it can. A record it cannot
read (stored by an earlier release and not rebuilt by an ingress yet, or by another release)
stays at the head for ``UNREADABLE_WAIT_S``, then fails with 500
``job_format``. Heartbeats tell others the replica is alive; a replica that stops beating
has its running jobs queued again by the others (:meth:`JobStore.recover_orphans`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from deployments.replica.parts import Replica
from serve_app.admission.controller import Admission
from serve_app.errors import InternalError, OverloadedError, ServeAppError
from serve_app.jobs.config import JobsConfig
from serve_app.jobs.payload import StoredJob, StoredRefusal, UnreadableJobError, decode
from serve_app.jobs.store import JobStore
from serve_app.jobs.view import JobView
from serve_app.outcomes import JobOutcome
from serve_app.pricing import shape_bytes

logger = logging.getLogger("ray.serve")
T = TypeVar("T")

MAX_RETRY_PAUSE_S = 10.0
"""Longest pause between two tries while the job store fails."""
UNREADABLE_WAIT_S = 60.0
"""How long a job whose record this replica cannot read stays at the queue's head, for an
ingress to rebuild it (:meth:`deployments.http.jobs_http.JobsFront.rebuild_stored`) or a replica
of its release to take it, before it fails with 500 ``job_format``."""


class _CancelRequested(Exception):
    """A running job was cancelled (``DELETE /v1/jobs/{id}``)."""


@dataclass(frozen=True)
class _Unreadable:
    """The head's record could not be read, first at ``since`` (the worker's clock)."""

    since: float


class JobWorker:
    """Pulls and runs jobs for one replica (see module docstring).

    Args:
        store: the app's job store.
        replica: the replica (its gate, prices, lifecycle).
        worker_id: the replica's id (its heartbeat and running list).
        config: ``jobs.*``.
        clock: monotonic seconds (injected for tests).
    """

    def __init__(self, store: JobStore, replica: Replica, worker_id: str, config: JobsConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store, self._replica = store, replica
        self._worker_id, self._config, self._clock = worker_id, config, clock
        self._running: set[asyncio.Task] = set()
        self._head: tuple[str, StoredJob | StoredRefusal | _Unreadable] | None = None
        self._beat_at = -float("inf")

    async def run_forever(self) -> None:
        """Pull and start jobs until cancelled, even when a call cancelled on its way lost
        the cancellation (it finished, or raised an error of its own, as it came): the task is
        still marked cancelling, and stops. While Redis fails (restarting, or gone before this
        replica at shutdown) it retries with a doubling pause up to ``MAX_RETRY_PAUSE_S``,
        logging the first failure with its traceback and then one line per pause."""
        pause_s, task = self._config.poll_interval_s, asyncio.current_task()
        while True:
            started = False
            try:
                await self._beat()
                started = await self._start_next()
                pause_s = self._config.poll_interval_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if pause_s == self._config.poll_interval_s:
                    logger.exception("job worker: the job store failed; retrying")
                else:
                    logger.warning("job worker: the job store still fails (%s); next try in "
                                   "%.1f s", exc, pause_s)
                pause_s = min(MAX_RETRY_PAUSE_S, pause_s * 2)
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            if not started:
                await asyncio.sleep(pause_s)

    async def _beat(self) -> None:
        """Every third of ``heartbeat_ttl_s``: the heartbeat, orphans of gone replicas back
        in the queue, and the queue's length for the autoscaler."""
        now = time.monotonic()
        if now - self._beat_at < self._config.heartbeat_ttl_s / 3:
            return
        self._beat_at = now
        await self._store.heartbeat(self._worker_id, self._config.heartbeat_ttl_s)
        if recovered := await self._store.recover_orphans():
            logger.info("job worker: %d jobs of gone replicas queued again", len(recovered))
        queued = await self._store.figures.queued_count()
        self._replica.record_jobs_queued(queued)
        head = await self._store.head()
        metrics = self._replica.metrics
        metrics.set("job_queue_depth", queued)
        metrics.set("job_queue_oldest_age_seconds",
                    0.0 if head is None else max(0.0, self._store.figures.now() - head.created_at))

    async def _start_next(self) -> bool:
        """Start the queue's head if it fits now; whether another try may follow at once."""
        gate = self._replica.gate
        if not gate.has_spare_room():
            return False
        job = await self._store.head()
        if job is None:
            return False
        stored = self._read(job)
        if isinstance(stored, StoredRefusal):
            return await self._refuse(job, json.dumps(stored.error), stored.status_code)
        if stored is None:
            return False
        replica = self._replica
        units = replica.policy.units(shape_bytes(replica.cost_model, stored.request.shape))
        try:
            lease = gate.spare_lease(units, job.id, stored.request.tenant)
        except ServeAppError as exc:
            return await self._refuse(job, json.dumps(exc.to_body()), exc.status_code)
        if lease is None:
            return False
        claimed = await self._store.claim(job.id, self._worker_id)
        if claimed is None:  # another replica took it, or it was cancelled
            gate.release(lease.lease, ran=False)
            return True
        task = asyncio.ensure_future(self._run(claimed, stored, lease))
        self._running.add(task)
        task.add_done_callback(self._finished_task)
        self._replica.metrics.set("running_jobs", len(self._running))
        return True

    def _read(self, job: JobView) -> StoredJob | StoredRefusal | None:
        """What the head ``job`` runs (read once while it stays the head; a completion
        stamped ``created`` then, as the route does when it prepares a request), or why it
        cannot run; ``None`` while a record this replica cannot read waits to be rebuilt
        (:data:`UNREADABLE_WAIT_S`)."""
        if self._head is None or self._head[0] != job.id:
            try:
                stored: StoredJob | StoredRefusal | _Unreadable = decode(job.request)
            except UnreadableJobError as exc:
                logger.warning("job %s: its record cannot be read here (%s); it waits %g s "
                               "for an ingress to rebuild it", job.id, exc, UNREADABLE_WAIT_S)
                stored = _Unreadable(self._clock())
            if isinstance(stored, StoredJob):
                stored = StoredJob(stored.request, stored.render.as_of(int(time.time())))
            self._head = (job.id, stored)
        stored = self._head[1]
        if not isinstance(stored, _Unreadable):
            return stored
        if self._clock() - stored.since < UNREADABLE_WAIT_S:
            return None
        error = InternalError(
            "this job was stored by another release of vramgate, and no ingress of this "
            f"release rebuilt it within {UNREADABLE_WAIT_S:g} s; submit it again",
            code="job_format")
        return StoredRefusal(error.to_body(), error.status_code)

    def _finished_task(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._replica.metrics.set("running_jobs", len(self._running))

    async def _refuse(self, job: JobView, error_json: str, status_code: int) -> bool:
        """Fail ``job`` with the error body ``error_json`` (if it is still queued)."""
        if await self._store.claim(job.id, self._worker_id) is not None:
            await self._store.fail(job.id, self._worker_id, error_json, status_code)
        return True

    async def _run(self, job: JobView, stored: StoredJob, admission: Admission) -> None:
        """Run a claimed job with its lease; record its outcome (a 503 queues it again)."""
        store, worker = self._store, self._worker_id
        outcome: Callable[[], Awaitable[Any]]
        try:
            result = await self._unless_cancelled(
                job.id, self._replica.lifecycle.infer(stored.request, admission))
            body: Any = stored.render(result)
        except _CancelRequested:  # requeue records a cancelled job as cancelled
            outcome = partial(store.requeue, job.id, worker)
        except OverloadedError:
            outcome = partial(store.requeue, job.id, worker)
        except ServeAppError as exc:
            outcome = partial(store.fail, job.id, worker, json.dumps(exc.to_body()),
                              exc.status_code)
        except Exception:
            logger.exception("job %s failed", job.id)
            error = InternalError("internal error")
            outcome = partial(store.fail, job.id, worker, json.dumps(error.to_body()),
                              error.status_code)
        else:
            outcome = partial(store.finish, job.id, worker, json.dumps(body))
        status = await store_outcome(job.id, outcome, self._config.poll_interval_s)
        if status is not None:  # None: another outcome was recorded first
            self._replica.metrics.inc("jobs_finished", outcome=JobOutcome.of(status))

    async def _unless_cancelled(self, job_id: str, work: Awaitable[T]) -> T:
        """``work``'s result, unless a cancel of ``job_id`` comes first (asked every
        ``jobs.poll_interval_s``): then ``work`` is cancelled as a client that left is (an
        engine that schedules itself aborts the request; the lease goes back once the device
        let go of it) and :class:`_CancelRequested` is raised. A store that does not answer
        now is asked again at the next poll.

        Raises:
            _CancelRequested: the job was cancelled while it ran.
        """
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait({task}, timeout=self._config.poll_interval_s))[0]:
                with contextlib.suppress(RedisConnectionError, RedisTimeoutError, OSError):
                    if await self._store.cancel_requested(job_id):
                        raise _CancelRequested(job_id)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def close(self) -> None:
        """Stop pulling (jobs running finish, or are re-run after the heartbeat lapses)."""
        for task in list(self._running):
            task.cancel()


async def store_outcome(job_id: str, write: Callable[[], Awaitable[Any]],
                        first_pause_s: float) -> Any:
    """Store a job's outcome (``write``), trying again while the store does not answer
    (redis-py's own :class:`~redis.asyncio.retry.Retry`, without limit), with a pause doubling
    from ``first_pause_s`` up to ``MAX_RETRY_PAUSE_S``. Given up, the job would stay
    ``running`` for as long as its replica lives and beats: only the jobs of gone replicas are
    queued again. A retry is safe: a job's first outcome wins (:meth:`JobStore.finish`).
    Returns what ``write`` returned (the status recorded)."""

    async def log(exc: Exception) -> None:
        logger.warning("job %s: its outcome could not be stored (%s); trying again", job_id, exc)

    # ExponentialBackoff pauses base * 2**failures after the n-th failure: half, so the first
    # pause is first_pause_s.
    retry = Retry(ExponentialBackoff(cap=MAX_RETRY_PAUSE_S, base=first_pause_s / 2),
                  retries=-1, supported_errors=(RedisConnectionError, RedisTimeoutError, OSError))
    return await retry.call_with_retry(write, log)
