"""Runs the Batch API's batches: each ingress drives the batches whose lock it holds
(:class:`BatchDriver`), one :class:`BatchRun` per batch, through its statuses.

- ``validating``: every line checked as the route would (:func:`validate_lines`); one bad
  line fails the batch with ``errors`` naming the lines (a line for another ``url`` or an
  unserved ``model`` is kept as an error line instead).
- ``in_progress``: lines are submitted in file order as durable jobs of the batch's tenant,
  at most ``jobs.batch_window`` queued or running at once, each with the Idempotency-Key
  ``batch:{batch_id}:{custom_id}`` (so a line is one job, however often it is submitted);
  a finished job's result becomes the line's output or error line, recorded once.
- ``finalizing``: the output and error files are written, in line order; then ``completed``.
- ``cancelling``: queued jobs are cancelled, running ones stopped, finished ones kept; the
  lines that did not run get ``batch_cancelled`` error lines; ``cancelled``.
- past ``expires_at`` (``completion_window``): the same, with ``batch_expired``; ``expired``.

Every step reads its state from Redis, so an ingress that starts (``serve run`` again, a
replica replaced) takes over any batch not final: the lock (``SET NX PX``, renewed) lapses
with the ingress that held it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import ValidationError
from redis.exceptions import RedisError

from deployments.http.batch_lines import (
    error_line,
    line_key,
    result_line,
    unrun_line,
    validate_lines,
)
from deployments.http.http_errors import validation_error
from deployments.http.jobs_http import JobsFront, JobsRoutes
from serve_app.admission.fair import DEFAULT_TENANT
from serve_app.batches.files import FileStore
from serve_app.batches.models import (
    FINAL_BATCH_STATUSES,
    Batch,
    BatchError,
    BatchErrors,
    BatchStatus,
)
from serve_app.batches.store import BatchStore
from serve_app.errors import OverloadedError, ServeAppError
from serve_app.jobs.view import JobView
from serve_app.metrics import ProcessMetrics
from serve_app.outcomes import BatchLineOutcome, BatchOutcome

logger = logging.getLogger("ray.serve")

LOCK_TTL_MS = 30_000
"""How long a batch's lock outlives the last renewal of the ingress that drives it."""
RENEW_S = 10.0
"""How often the driving ingress renews its lock."""
SCAN_S = 5.0
"""How often an ingress looks for batches nobody drives (and at once on a new batch)."""
CLOSE_WAIT_S = 60.0
"""The longest a cancel or expiry waits for the running jobs it stopped to end."""


@dataclass(frozen=True)
class BatchParts:
    """What running batches uses: the stores, the models' jobs, ``window``
    (``jobs.batch_window``), the ingress's metrics, the clock and the poll period."""

    batches: BatchStore
    files: FileStore
    jobs: JobsRoutes
    window: int
    metrics: ProcessMetrics
    clock: Callable[[], float] = time.time
    poll_s: float = 0.25


async def _stored(front: JobsFront, job_id: str) -> JobView | None:
    return await front.store.get(job_id)


class BatchRun:
    """One batch, driven from its status now to a final one (:meth:`run`)."""

    def __init__(self, parts: BatchParts, batch_id: str) -> None:
        self._parts, self._id = parts, batch_id
        self._batches = parts.batches

    async def run(self) -> Batch | None:
        """Each status's step until the batch is final (or gone); the batch then."""
        steps = {BatchStatus.VALIDATING: self._validate,
                 BatchStatus.IN_PROGRESS: self._progress,
                 BatchStatus.FINALIZING: self._finalize,
                 BatchStatus.CANCELLING: self._cancel}
        while (batch := await self._batches.get(self._id)) is not None \
                and batch.status not in FINAL_BATCH_STATUSES:
            await steps[batch.status](batch)
        return batch

    async def _end(self, batch: Batch, leaving: set[BatchStatus], to: BatchStatus,
                   **changes: object) -> None:
        if await self._batches.transition(batch.id, leaving, to, **changes) is not None:
            self._parts.metrics.inc("batches_finished", outcome=BatchOutcome(to))
            logger.info("batch %s %s", batch.id, to)

    async def _validate(self, batch: Batch) -> None:
        checked = await validate_lines(batch, self._parts.files, self._parts.jobs)
        if not checked.lines and not checked.errors:
            checked.errors.append(BatchError(
                code="invalid_input_file",
                message=f"the input file {batch.input_file_id} is gone or has no lines"))
        if checked.errors:
            await self._end(batch, {BatchStatus.VALIDATING}, BatchStatus.FAILED,
                            errors=BatchErrors(data=checked.errors))
            return
        await self._batches.set_lines(batch.id, checked.lines)
        await self._batches.transition(batch.id, {BatchStatus.VALIDATING},
                                       BatchStatus.IN_PROGRESS)

    async def _progress(self, batch: Batch) -> None:
        """One round: collect finished jobs, submit lines up to the window; then
        ``finalizing`` once every line is recorded, else a poll period's pause."""
        if batch.expires_at is not None and self._parts.clock() >= batch.expires_at:
            await self._close(batch, BatchStatus.IN_PROGRESS, BatchStatus.EXPIRED,
                              "batch_expired", "the batch's completion_window passed first")
            return
        running = await self._collect()
        cursor = await self._fill(batch, running)
        if cursor >= batch.request_counts.total and not running:
            await self._batches.transition(batch.id, {BatchStatus.IN_PROGRESS},
                                           BatchStatus.FINALIZING)
        else:
            await asyncio.sleep(self._parts.poll_s)

    async def _collect(self) -> dict[str, str]:
        """Record the lines whose jobs ended; the lines still running (id -> job id)."""
        running = await self._batches.running(self._id)
        for custom_id, job_id in list(running.items()):
            found = result_line(custom_id, await self._parts.jobs.first(job_id, _stored))
            if found is not None:
                await self._record(custom_id, *found)
                del running[custom_id]
        return running

    async def _record(self, custom_id: str, line: dict, failed: bool) -> None:
        if await self._batches.record(self._id, custom_id, line, failed):
            self._parts.metrics.inc("batch_lines_finished", outcome=(
                BatchLineOutcome.FAILED if failed else BatchLineOutcome.COMPLETED))

    async def _fill(self, batch: Batch, running: dict[str, str]) -> int:
        """Submit lines after the cursor while fewer than ``window`` run; the cursor then
        (a full job queue or an unreachable store leaves the rest for the next round)."""
        cursor = await self._batches.cursor(self._id)
        free = self._parts.window - len(running)
        tenant = await self._batches.tenant(self._id) or DEFAULT_TENANT
        for line in await self._batches.lines(self._id, cursor, cursor + max(0, free)):
            custom_id, job_id = line["custom_id"], None
            if "error" in line:  # made an error line by validation: nothing to run
                await self._record(custom_id, error_line(custom_id, **line["error"]), True)
            elif custom_id not in running and not await self._batches.recorded(self._id,
                                                                               custom_id):
                try:
                    job_id = await self._submit(batch, line, tenant)
                except OverloadedError:
                    break
                except ServeAppError as exc:  # refused now, though valid when checked
                    await self._record(custom_id, error_line(custom_id, exc.code,
                                                             exc.message), True)
            cursor += 1
            await self._batches.submitted(self._id, custom_id, job_id, cursor)
            if job_id is not None:
                running[custom_id] = job_id
        return cursor

    async def _submit(self, batch: Batch, line: dict, tenant: str) -> str:
        try:
            route, body = self._parts.jobs.parsed(batch.endpoint, line["body"])
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        job, _ = await route.context.jobs.submit_body(
            batch.endpoint, body, line_key(batch.id, line["custom_id"]), tenant)
        return job.id

    async def _finalize(self, batch: Batch) -> None:
        files = await self._write_files(batch)
        await self._end(batch, {BatchStatus.FINALIZING}, BatchStatus.COMPLETED, **files)

    async def _cancel(self, batch: Batch) -> None:
        await self._close(batch, BatchStatus.CANCELLING, BatchStatus.CANCELLED,
                          "batch_cancelled", "the batch was cancelled before this line ran")

    async def _close(self, batch: Batch, leaving: BatchStatus, to: BatchStatus, code: str,
                     message: str) -> None:
        """Cancel the running jobs (finished ones are kept), give every line not recorded
        an error line ``code``, write the files, and move to ``to``."""
        running = await self._batches.running(self._id)
        for job_id in running.values():
            await self._parts.jobs.first(job_id, JobsFront.cancel)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while running and time.monotonic() < deadline:
            if running := await self._collect():
                await asyncio.sleep(self._parts.poll_s)
        total = batch.request_counts.total
        for start in range(0, total, 500):
            for line in await self._batches.lines(self._id, start, start + 500):
                if not await self._batches.recorded(self._id, line["custom_id"]):
                    await self._record(line["custom_id"], unrun_line(line, code, message),
                                       True)
        await self._end(batch, {leaving}, to, **await self._write_files(batch))

    async def _write_files(self, batch: Batch) -> dict[str, str | None]:
        """The output and error files (``batch_output``), lines in input order; a file
        with no line is not kept (its id ``None``)."""
        ids: dict[str, str | None] = {}
        for failed, name in ((False, "output"), (True, "error")):
            file = await self._parts.files.write(
                self._results(batch.request_counts.total, failed),
                f"{batch.id}_{name}.jsonl", "batch_output")
            if not file.bytes:
                await self._parts.files.delete(file.id)
            ids[f"{name}_file_id"] = file.id if file.bytes else None
        return ids

    async def _results(self, total: int, failed: bool) -> AsyncIterator[bytes]:
        for start in range(0, total, 500):
            lines = await self._batches.lines(self._id, start, start + 500)
            found = await self._batches.results(self._id, [line["custom_id"] for line in lines],
                                                failed)
            if text := b"".join(line + b"\n" for line in found if line is not None):
                yield text


class BatchDriver:
    """This ingress's batches: every ``SCAN_S`` (or at once after :meth:`wake`) it takes
    the lock of each batch not final that nobody drives, and drives it (:class:`BatchRun`)
    while it renews the lock; a lock it loses stops its run.

    Args:
        parts: the stores, the models' jobs, the window, the metrics.
    """

    def __init__(self, parts: BatchParts) -> None:
        self._parts, self._batches = parts, parts.batches
        self._token = uuid.uuid4().hex
        self._driving: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._scanner: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start scanning (in the running event loop)."""
        self._scanner = asyncio.get_running_loop().create_task(self._scan_forever())

    def wake(self) -> None:
        """Scan now (a batch was created)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop scanning and driving (the locks lapse within ``LOCK_TTL_MS``)."""
        for task in [self._scanner, *self._driving.values()]:
            if task is not None:
                task.cancel()

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan()
            except (RedisError, OSError) as exc:
                logger.warning("batches: the job store does not answer (%s); retrying", exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), SCAN_S)

    async def scan(self) -> None:
        """Take and drive every batch not final that nobody drives; then publish the
        batches this ingress drives by status (``driven_batches``)."""
        for batch_id in await self._batches.active():
            if batch_id not in self._driving and await self._batches.locks.lock(
                    batch_id, self._token, LOCK_TTL_MS):
                self._driving[batch_id] = asyncio.get_running_loop().create_task(
                    self._drive(batch_id))
        driven = Counter([batch.status for batch_id in list(self._driving)
                          if (batch := await self._batches.get(batch_id)) is not None])
        for status in BatchStatus:
            if status not in FINAL_BATCH_STATUSES:
                self._parts.metrics.set("driven_batches", driven[status], status=status)

    async def _drive(self, batch_id: str) -> None:
        run = asyncio.get_running_loop().create_task(BatchRun(self._parts, batch_id).run())
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=RENEW_S)
                if not run.done() and not await self._batches.locks.renew(batch_id, self._token,
                                                                    LOCK_TTL_MS):
                    logger.warning("batch %s: lock lost; another ingress drives it", batch_id)
                    run.cancel()
            run.result()
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - a batch's failure must not stop the driver
            logger.exception("batch %s: its run stopped; retried at the next scan", batch_id)
        finally:
            run.cancel()
            self._driving.pop(batch_id, None)
            with contextlib.suppress(RedisError, OSError):
                await self._batches.locks.unlock(batch_id, self._token)
