"""A model replica's puller of durable jobs: it takes the next job from the app's queue in
Redis only when the job's price fits the replica's budget now, so a job never gets a 503 for
memory: it waits in the durable queue instead.

Jobs yield to requests answered at once: a replica pulls only while nobody waits in its
admission queue and its inference thread's backlog is under half of
``admission.max_queue_wait_s``. It prices the job as it prices any request (the route's own
:meth:`~deployments.routes.base.Route.prepare`, then its cost model and policy), reserves the
lease, then claims the job (one claimer wins, :meth:`JobStore.claim`), and runs it through the
request lifecycle with that lease: batching, timeouts, OOM handling and lease accounting are
the same as for any request. A transient refusal (503) puts the job back at the queue's head;
a 4xx or 5xx fails it with the route's error body; an outcome the store cannot take now (its
Redis restarting) is written again until it can. Heartbeats tell others the replica is
alive; a replica that stops beating has its running jobs queued again by the others
(:meth:`JobStore.recover_orphans`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from deployments.replica import Replica
from deployments.routes.base import Prepared, Route
from serve_app.admission.controller import Admission
from serve_app.errors import InternalError, OverloadedError, RequestTooLargeError, ServeAppError
from serve_app.jobs.config import JobsConfig
from serve_app.jobs.store import JobStore
from serve_app.jobs.view import JobView
from serve_app.outcomes import JobOutcome
from serve_app.pricing import shape_bytes

logger = logging.getLogger("ray.serve")

MAX_RETRY_PAUSE_S = 10.0
"""Longest pause between two tries while the job store fails."""


class JobWorker:
    """Pulls and runs jobs for one replica (see module docstring).

    Args:
        store: the app's job store.
        replica: the replica (its gate, prices, lifecycle).
        routes: the routes jobs may name, by path, built on the replica's own request
            factory.
        worker_id: the replica's id (its heartbeat and running list).
        config: ``jobs.*``.
    """

    def __init__(self, store: JobStore, replica: Replica, routes: Mapping[str, Route],
                 worker_id: str, config: JobsConfig) -> None:
        self._store, self._replica, self._routes = store, replica, routes
        self._worker_id, self._config = worker_id, config
        self._running: set[asyncio.Task] = set()
        self._prepared: tuple[str, Prepared | ServeAppError] | None = None
        self._beat_at = -float("inf")

    async def run_forever(self) -> None:
        """Pull and start jobs until cancelled. While Redis fails (restarting, or gone
        before this replica at shutdown) it retries with a doubling pause up to
        ``MAX_RETRY_PAUSE_S``, logging the first failure with its traceback and then one line
        per pause."""
        pause_s = self._config.poll_interval_s
        while True:
            try:
                await self._beat()
                started = await self._start_next()
                pause_s = self._config.poll_interval_s
                if started:
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if pause_s == self._config.poll_interval_s:
                    logger.exception("job worker: the job store failed; retrying")
                else:
                    logger.warning("job worker: the job store still fails (%s); next try in "
                                   "%.1f s", exc, pause_s)
                pause_s = min(MAX_RETRY_PAUSE_S, pause_s * 2)
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
        self._replica.jobs_queued = await self._store.queued_count()
        head = await self._store.head()
        metrics = self._replica.metrics
        metrics.set("job_queue_depth", self._replica.jobs_queued)
        metrics.set("job_queue_oldest_age_seconds",
                    0.0 if head is None else max(0.0, self._store.now() - head.created_at))

    def _room(self) -> bool:
        """Whether jobs may start now: nobody waits for a lease and the thread is free
        enough."""
        replica = self._replica
        return replica.gate.queue.queue_depth == 0 \
            and replica.thread_wait_s() < replica.args.admission.max_queue_wait_s / 2

    async def _start_next(self) -> bool:
        """Start the queue's head if it fits now; whether another try may follow at once."""
        if not self._room():
            return False
        job = await self._store.head()
        if job is None:
            return False
        prepared = await self._prepare(job)
        if isinstance(prepared, ServeAppError):
            return await self._refuse(job, prepared)
        replica = self._replica
        units = replica.policy.units(shape_bytes(replica.cost_model, prepared.request.shape))
        if units > replica.gate.queue.max_budget_bytes:
            return await self._refuse(job, RequestTooLargeError(
                f"the job needs an estimated {units} bytes of device memory, more than the "
                f"replica's whole budget of {replica.gate.queue.max_budget_bytes} bytes"))
        if not self._room():
            return False
        lease = replica.gate.budget.try_reserve(units)
        if lease is None:
            return False
        claimed = await self._store.claim(job.id, self._worker_id)
        if claimed is None:  # another replica took it, or it was cancelled
            replica.gate.release(lease, ran=False)
            return True
        task = asyncio.ensure_future(self._run(claimed, prepared, Admission(lease, 0.0, 0,
                                                                            claimed.id)))
        self._running.add(task)
        task.add_done_callback(self._finished_task)
        self._replica.metrics.set("running_jobs", len(self._running))
        return True

    def _finished_task(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._replica.metrics.set("running_jobs", len(self._running))

    async def _prepare(self, job: JobView) -> Prepared | ServeAppError:
        """The job's request (kept for the head while it waits), or why it cannot run."""
        if self._prepared is not None and self._prepared[0] == job.id:
            return self._prepared[1]
        route = self._routes.get(job.route)
        try:
            if route is None:
                raise InternalError(f"this app serves no route {job.route}")
            body = route.body_model.model_validate_json(job.body_json)
            prepared: Prepared | ServeAppError = await route.prepare(body, job.id)
        except ServeAppError as exc:
            prepared = exc
        self._prepared = (job.id, prepared)
        return prepared

    async def _refuse(self, job: JobView, error: ServeAppError) -> bool:
        if await self._store.claim(job.id, self._worker_id) is not None:
            await self._store.fail(job.id, self._worker_id, json.dumps(error.to_body()),
                                   error.status_code)
        return True

    async def _run(self, job: JobView, prepared: Prepared, admission: Admission) -> None:
        """Run a claimed job with its lease; record its outcome (a 503 queues it again)."""
        store, worker = self._store, self._worker_id
        outcome: Callable[[], Awaitable[Any]]
        try:
            result = await self._replica.lifecycle.infer(prepared.request, admission)
            body: Any = prepared.render(result)
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
