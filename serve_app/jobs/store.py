"""Durable asynchronous inference jobs in Redis: submit, claim, finish, cancel, recover.

Pure storage (redis-py's asyncio client; no Ray, FastAPI or torch). Every key starts with
``base = f"{prefix}:{namespace}:"`` (``namespace``: the served app or model name), so several
apps share one Redis:

- ``job:{id}`` (hash): ``id``, ``route``, ``body`` (the client's JSON text), ``request``
  (opaque bytes: what the replica runs, :mod:`serve_app.jobs.payload`; empty in jobs stored
  by releases before it, until :meth:`JobStore.set_request`), ``price_bytes``, ``status``
  (:class:`~serve_app.jobs.view.JobStatus`), ``created_at`` / ``started_at`` /
  ``finished_at`` (unix seconds), ``attempts`` (claims), ``worker`` (last claimer),
  ``cancel_requested`` (``"1"`` once cancelled while running), ``result`` (JSON text),
  ``error`` (JSON text, ``{"error": {...}}``), ``status_code``, ``idempotency_key``. No TTL
  until the job is final, then ``result_ttl_s``.
- ``queued`` (list): ids waiting, oldest first (submit pushes right, claim removes any).
- ``running:{worker}`` (list): ids a worker claimed and has not finished.
- ``worker:{worker}`` (string, TTL): the worker's heartbeat; once it expired,
  :meth:`JobStore.recover_orphans` puts that worker's running jobs back at the queue's head.
- ``key:{idempotency_key}`` (hash): ``job_id``, ``body_hash`` (sha256 of route and body);
  expires with its job.
- ``completions`` (sorted set): job id scored by finish time, the last hour kept, and
  ``rate_since`` (string): the first claim's time; together the cluster's completion rate.

Every change touching more than one key is one Lua script (:mod:`serve_app.jobs.lua`), so two
stores (replicas, nodes, apps) racing on the same job see one winner. The client must return
bytes (``decode_responses=False``, redis-py's default).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from serve_app.admission.drain import retry_after_s
from serve_app.errors import IdempotencyKeyReusedError, OverloadedError
from serve_app.jobs import lua
from serve_app.jobs.view import JobStatus, JobView, view_from_reply

# Completion times older than this are dropped: the longest rate window, seconds.
RATE_HORIZON_S = 3600.0


class JobQueueFullError(OverloadedError):
    """503 ``jobs_full``: ``max_queued`` jobs are already waiting; ``retry_after_s`` is the
    time the measured completion rate needs to make room, in [1, 60] (1 when unmeasured)."""

    default_code = "jobs_full"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "\\*?[]" else c for c in text)


def new_job_id() -> str:
    """A new job id: ``"job-"`` and 32 hex digits."""
    return f"job-{uuid.uuid4().hex}"


def body_hash(route: str, body_json: str) -> str:
    """sha256 hex of ``route`` and ``body_json``: same key + same hash = the same job."""
    return hashlib.sha256(f"{route}\0{body_json}".encode()).hexdigest()


class JobQueueFigures:
    """Read-only figures of one namespace's job queue, from the keys a :class:`JobStore`
    writes (``queued``, ``job:{id}``, ``completions``, ``rate_since``); reached as
    :attr:`JobStore.figures`.

    Args:
        client: a ``redis.asyncio.Redis`` returning bytes (``decode_responses=False``).
        base: the namespace's key prefix, ``f"{prefix}:{namespace}:"``.
        clock: unix seconds (the store's clock).

    Raises:
        redis.exceptions.RedisError: from any method, when Redis cannot be reached.
    """

    def __init__(self, client: aioredis.Redis, base: str, clock: Callable[[], float]) -> None:
        self._client, self._base, self._clock = client, base, clock
        self._queued = self._key("queued")

    def _key(self, *parts: str) -> str:
        return self._base + ":".join(parts)

    def now(self) -> float:
        """Unix seconds by the store's clock (what its jobs' times are in)."""
        return float(self._clock())

    async def queued_bytes_through(self, position: int) -> int:
        """The prices of the queue's first ``position + 1`` jobs, summed (bytes): what must
        drain before the job at ``position`` has run."""
        ids = await self._client.lrange(self._queued, 0, max(0, position))
        if not ids:
            return 0
        async with self._client.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(self._key("job", job_id.decode()), "price_bytes")
            prices = await pipe.execute()
        return sum(int(price) for price in prices if price is not None)

    async def queued_count(self) -> int:
        """Jobs waiting in the queue."""
        return int(await self._client.llen(self._queued))

    async def completions_per_s(self, window_s: float = 60.0) -> float | None:
        """Jobs finished per second, cluster-wide: completions in the last ``window_s`` seconds
        over ``min(window_s, time since the first claim)`` (so a young store is not read as
        slow). ``None`` when none finished in the window. ``window_s`` <= 3600."""
        now = float(self._clock())
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.zcount(self._key("completions"), f"({now - window_s!r}", "+inf")
            pipe.get(self._key("rate_since"))
            count, since = await pipe.execute()
        if not count:
            return None
        span_s = window_s if since is None else min(window_s, now - float(since))
        return count / max(span_s, 1e-3)


class JobStore:
    """Jobs of one namespace in one Redis.

    Args:
        client: a ``redis.asyncio.Redis`` returning bytes (``decode_responses=False``).
        namespace: the served app or model name; keys of other namespaces are never touched.
        prefix: first part of every key.
        result_ttl_s: seconds a final job (and its idempotency key) is kept, > 0.
        max_queued: most jobs waiting at once; :meth:`submit` refuses beyond, >= 1.
        heartbeat_ttl_s: the heartbeat a worker gets on its first claim when it has none, and
            the default of :meth:`heartbeat`.
        clock: unix seconds (injected for tests).

    Attributes:
        figures: the queue's figures (:class:`JobQueueFigures`): its length, the prices
            queued ahead of a job, the completion rate, the clock.

    Raises:
        ValueError: the client decodes responses, or a bound is out of range.
    """

    def __init__(self, client: aioredis.Redis, namespace: str, *, prefix: str = "vramgate",
                 result_ttl_s: float = 3600.0, max_queued: int = 1000,
                 heartbeat_ttl_s: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("JobStore needs a Redis client with decode_responses=False "
                             "(requests are stored as bytes)")
        if result_ttl_s <= 0 or heartbeat_ttl_s <= 0 or max_queued < 1:
            raise ValueError(f"need result_ttl_s > 0, heartbeat_ttl_s > 0, max_queued >= 1; "
                             f"got {result_ttl_s}, {heartbeat_ttl_s}, {max_queued}")
        self.namespace, self.base = namespace, f"{prefix}:{namespace}:"
        self._client, self._clock = client, clock
        self._ttl_ms = max(1, round(result_ttl_s * 1000))
        self._heartbeat_ttl_s, self._max_queued = heartbeat_ttl_s, max_queued
        self._queued = self.key("queued")
        self.figures = JobQueueFigures(client, self.base, clock)
        self._scripts = {name: client.register_script(getattr(lua, name))
                         for name in ("SUBMIT", "GET", "HEAD", "CLAIM", "CANCEL", "FINISH",
                                      "REQUEUE", "RECOVER", "SET_REQUEST")}

    @property
    def client(self) -> aioredis.Redis:
        """The Redis client the store uses (the Batch API keeps its files there too)."""
        return self._client

    def key(self, *parts: str) -> str:
        """The full key of ``parts``: ``key("job", id)`` -> ``"{prefix}:{namespace}:job:{id}"``."""
        return self.base + ":".join(parts)

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts[script](keys=keys, args=args)

    async def submit(self, route: str, body_json: str, request: bytes, price_bytes: int,
                     idempotency_key: str | None = None,
                     job_id: str | None = None) -> tuple[JobView, bool]:
        """Queue a new job at the tail, or find the one this idempotency key made.
        ``job_id``: the new job's id (:func:`new_job_id`; default: a new one).

        Returns:
            ``(view, True)`` for a new job; ``(view, False)`` when ``idempotency_key`` already
            names a job (in any status, until it expires) with the same route and body.

        Raises:
            IdempotencyKeyReusedError: the key names a job with a different route or body.
            JobQueueFullError: ``max_queued`` jobs are waiting (not raised for a known key).
        """
        job_id, digest = job_id or new_job_id(), body_hash(route, body_json)
        keys = [self.key("job", job_id), self._queued]
        fields: dict[str, Any] = {
            "id": job_id, "route": route, "body": body_json, "request": request,
            "price_bytes": int(price_bytes), "status": str(JobStatus.QUEUED),
            "created_at": repr(float(self._clock())), "attempts": 0}
        if idempotency_key:
            keys.append(self.key("key", idempotency_key))
            fields["idempotency_key"] = idempotency_key
        args = [job_id, self.base, self._max_queued, digest,
                *(item for pair in fields.items() for item in pair)]
        outcome, *rest = await self._run("SUBMIT", keys, args)
        if outcome == b"mismatch":
            raise IdempotencyKeyReusedError(
                "this Idempotency-Key was used with a different request body")
        if outcome == b"full":
            queued = int(rest[0])
            rate = await self.figures.completions_per_s()
            wait_s = retry_after_s(queued + 1, rate, fallback_s=1.0)
            raise JobQueueFullError(f"the job queue is full ({queued} jobs waiting)",
                                    retry_after_s=wait_s)
        return await self._view(rest[0]), outcome == b"created"

    async def _view(self, reply: list[Any]) -> JobView:
        """Decode ``reply``; a queued job gets ``eta_s = (position + 1) / completions_per_s``."""
        view = view_from_reply(reply)
        if view.position is None or (rate := await self.figures.completions_per_s()) is None:
            return view
        return dataclasses.replace(view, eta_s=(view.position + 1) / rate)

    async def get(self, job_id: str) -> JobView | None:
        """The job, with ``position`` and ``eta_s`` while queued; ``None`` if unknown or
        expired."""
        reply = await self._run("GET", [self.key("job", job_id), self._queued], [job_id])
        return None if reply is None else await self._view(reply)

    async def cancel_requested(self, job_id: str) -> bool:
        """Whether a cancel came for ``job_id`` while it runs (one ``HGET``: cheap enough for
        a running job's worker to ask every poll)."""
        return await self._client.hget(self.key("job", job_id), "cancel_requested") == b"1"

    async def head(self) -> JobView | None:
        """The next queued job (position 0, with ``request`` and ``price_bytes``; ``eta_s`` not
        computed), left in the queue; ``None`` when the queue is empty."""
        reply = await self._run("HEAD", [self._queued], [self.base])
        return None if reply is None else view_from_reply(reply)

    async def cancel(self, job_id: str) -> JobView | None:
        """Cancel: a queued job leaves the queue as ``cancelled``; a running one gets
        ``cancel_requested`` (its worker sees it within a poll, stops it and records it
        ``cancelled``, without result: :meth:`cancel_requested`); a final one is unchanged. Returns
        the job after that, ``None`` if unknown."""
        reply = await self._run("CANCEL", [self.key("job", job_id), self._queued],
                                [job_id, self.base, repr(float(self._clock())), self._ttl_ms])
        return None if reply is None else await self._view(reply)

    async def claim(self, job_id: str, worker_id: str) -> JobView | None:
        """Take a queued job to run: it leaves ``queued`` for ``running:{worker_id}``, becomes
        ``running``, ``attempts`` + 1. Gives the worker a heartbeat of ``heartbeat_ttl_s`` if it
        has none. ``None`` when the job is not queued (claimed by another, or cancelled)."""
        now = repr(float(self._clock()))
        keys = [self.key("job", job_id), self._queued, self.key("running", worker_id),
                self.key("worker", worker_id), self.key("rate_since")]
        args = [job_id, worker_id, now, max(1, round(self._heartbeat_ttl_s * 1000))]
        reply = await self._run("CLAIM", keys, args)
        return None if reply is None else view_from_reply(reply)

    async def finish(self, job_id: str, worker_id: str, result_json: str) -> JobStatus | None:
        """Record a success: ``succeeded`` with ``result_json`` (the route's response body), or
        ``cancelled`` without it when a cancel was requested meanwhile. See :meth:`_record`."""
        return await self._record(job_id, worker_id, JobStatus.SUCCEEDED, "result",
                                  result_json, None)

    async def fail(self, job_id: str, worker_id: str, error_json: str,
                   status_code: int) -> JobStatus | None:
        """Record a failure: ``failed`` with ``error_json`` (``{"error": {...}}``) and its HTTP
        ``status_code``, or ``cancelled`` when a cancel was requested. See :meth:`_record`."""
        return await self._record(job_id, worker_id, JobStatus.FAILED, "error", error_json,
                                  status_code)

    async def _record(self, job_id: str, worker_id: str, status: JobStatus, field: str,
                      payload: str, status_code: int | None) -> JobStatus | None:
        """The first outcome of a non-final job wins, whoever holds it (a worker presumed dead
        whose job was requeued may still finish it: it then leaves the queue, runs no more).
        The job and its idempotency key expire after ``result_ttl_s``; the completion counts
        for the rate. Returns the status recorded, ``None`` if the job was unknown or final."""
        now = float(self._clock())
        keys = [self.key("job", job_id), self._queued, self.key("completions")]
        args = [job_id, self.base, repr(now), self._ttl_ms, worker_id, str(status), field,
                payload, "" if status_code is None else int(status_code),
                repr(now - RATE_HORIZON_S)]
        final = await self._run("FINISH", keys, args)
        return None if final is None else JobStatus(final.decode())

    async def requeue(self, job_id: str, worker_id: str) -> JobStatus | None:
        """Give a running job back: to the head of the queue, ``queued`` (the worker could not
        run it now, e.g. a transient 503; not a failure). Returns ``queued``, ``cancelled`` when
        a cancel was requested meanwhile, ``None`` when it is not running on ``worker_id``."""
        keys = [self.key("job", job_id), self._queued, self.key("running", worker_id)]
        args = [job_id, self.base, repr(float(self._clock())), self._ttl_ms, worker_id]
        status = await self._run("REQUEUE", keys, args)
        return None if status is None else JobStatus(status.decode())

    async def heartbeat(self, worker_id: str, ttl_s: float | None = None) -> None:
        """Say ``worker_id`` is alive for ``ttl_s`` seconds (default ``heartbeat_ttl_s``);
        call it well within that period while the worker holds jobs."""
        ttl_ms = max(1, round((ttl_s or self._heartbeat_ttl_s) * 1000))
        await self._client.set(self.key("worker", worker_id), repr(float(self._clock())),
                               px=ttl_ms)

    async def recover_orphans(self) -> list[str]:
        """Put the running jobs of every worker whose heartbeat expired back at the head of
        the queue, in their order (a cancel requested meanwhile makes them ``cancelled``).
        Safe with concurrent recoverers: each list moves once. Returns the ids requeued."""
        pattern = _glob_escape(self.key("running", "")) + "*"
        lists = [key async for key in self._client.scan_iter(match=pattern, count=500)]
        moved: list[str] = []
        running_prefix = len(self.key("running", "").encode())
        for running in lists:
            worker_id = running[running_prefix:].decode()
            keys = [running, self.key("worker", worker_id), self._queued]
            args = [self.base, repr(float(self._clock())), self._ttl_ms, worker_id]
            ids = await self._run("RECOVER", keys, args)
            moved.extend(i.decode() for i in reversed(ids))
        return moved

    async def without_request(self) -> list[str]:
        """The ids of the jobs queued or running whose ``request`` is empty (stored by a
        release before :mod:`serve_app.jobs.payload`), queued ones first, in queue order."""
        pattern = _glob_escape(self.key("running", "")) + "*"
        ids = [i.decode() for i in await self._client.lrange(self._queued, 0, -1)]
        async for running in self._client.scan_iter(match=pattern, count=500):
            ids.extend(i.decode() for i in await self._client.lrange(running, 0, -1))
        async with self._client.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(self.key("job", job_id), "status", "request")
            found = await pipe.execute()
        return [job_id for job_id, (status, request) in zip(ids, found, strict=True)
                if status in (b"queued", b"running") and not request]

    async def set_request(self, job_id: str, request: bytes) -> bool:
        """Store ``request`` as the job's ``request``, only while the job is queued or
        running and has none (so a job is never given two, nor a finished one one).
        Returns whether it was stored."""
        return bool(await self._run("SET_REQUEST", [self.key("job", job_id)], [request]))
