"""Requests on an engine that schedules itself (:class:`deployments.engines.base.AsyncScheduler`).

Such an engine (vLLM's ``AsyncLLM`` is the model) batches and pages its own KV cache; what the
replica adds is the byte gate in front of it. A request is admitted against the budget as any
other (:class:`deployments.replica.lifecycle.RequestLifecycle`), then handed to
:meth:`AsyncScheduler.submit` on the replica's event loop. The device holds the lease from the
submit until the engine's events end: finished, failed, timed out (504, the request aborted)
or the client gone (aborted: the lease goes back after the engine's ``abort`` returned);
:meth:`~serve_app.admission.ticket.Ticket.device_done` gives it back then, once. No inference
thread and no batcher of ours take part.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from deployments.engines.base import AsyncScheduler, ScheduledEvent, collect_output
from deployments.replica.device_health import DeviceHealth, draining_error
from deployments.replica.inference import InferenceThread
from serve_app.admission.ticket import Ticket
from serve_app.errors import ServeAppError
from serve_app.memory.expected_output import ExpectedOutput
from serve_app.request import GenerationOutput
from serve_app.stream_events import Finished


class ScheduledRuns:
    """Runs admitted requests on an :class:`AsyncScheduler` (module docstring).

    Args:
        engine: the engine.
        thread: the replica's inference thread: only its accounting (admitted, finished,
            client gone, timeouts) is used, so a scheduled request is counted and logged as
            any other; nothing runs on it.
        health: the device health (an OOM is 503 ``oom``, a device fault 503 ``draining``).
        inference_timeout_s: the longest a request may run (``admission.inference_timeout_s``).
        expected: under ``admission.kv_lease: expected``, the expectations a finished
            completion's length feeds.
    """

    def __init__(self, engine: AsyncScheduler, thread: InferenceThread, health: DeviceHealth,
                 inference_timeout_s: float, expected: ExpectedOutput | None = None) -> None:
        self._engine, self._thread, self._health = engine, thread, health
        self._timeout_s, self._expected = inference_timeout_s, expected

    async def result(self, ticket: Ticket) -> GenerationOutput:
        """``ticket``'s request run to its end, as one output.

        Raises: as :meth:`events`.
        """
        return await collect_output(self.events(ticket), ticket.request)

    async def events(self, ticket: Ticket) -> AsyncIterator[ScheduledEvent]:
        """``ticket``'s request submitted, its events as the engine makes them. Closing this
        iterator early (the client left) aborts the request; either way the lease goes back
        once the engine's iterator is closed.

        Raises:
            InferenceTimeoutError: it ran past ``inference_timeout_s`` (504; aborted).
            OverloadedError: ``oom`` or ``draining`` from the device, or ``draining`` once
                the engine died (503).
        """
        self._thread.admitted(ticket, 1)
        ticket.claim()
        started, outcome = time.monotonic(), "ok"
        finished = False
        stream = self._engine.submit(ticket.request, ticket.lease)
        try:
            async with contextlib.aclosing(stream):
                async for event in self._within_timeout(stream, started):
                    finished = isinstance(event, Finished)
                    if finished and self._expected is not None:
                        self._expected.observe(ticket.request.params.max_tokens,
                                               event.completion_tokens)
                    yield event
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "cancelled"
            raise
        except ServeAppError as err:
            outcome = err.code
            raise
        except Exception as exc:
            outcome = type(exc).__name__
            raise self._error_for(exc, ticket) from None
        finally:
            try:
                if not finished:
                    await self._abort(ticket)
                    outcome = "unfinished" if outcome == "ok" else outcome
            finally:
                self._done(ticket, outcome, time.monotonic() - started)

    async def _abort(self, ticket: Ticket) -> None:
        """The engine's abort of ``ticket``'s request; an engine that died holds nothing to
        abort, so its abort's error is not the request's (the request's own goes on)."""
        try:
            await self._engine.abort(ticket.lease.lease_id)
        except Exception:
            if self._engine.dead_reason() is None:
                raise

    def _error_for(self, exc: Exception, ticket: Ticket) -> BaseException:
        """What a request whose engine failed raises: 503 ``draining`` once the engine says it
        is dead (recorded as a device fault: the health check fails and Ray Serve replaces
        the replica), else as :meth:`DeviceHealth.error_for` (503 ``oom``, or the bug)."""
        if (reason := self._engine.dead_reason()) is not None:
            self._health.mark_device_fault(reason)
            return draining_error()
        return self._health.error_for(exc, ticket.lease.nbytes)

    async def _within_timeout(self, stream: AsyncIterator[ScheduledEvent],
                              started: float) -> AsyncIterator[ScheduledEvent]:
        """``stream``'s events until ``inference_timeout_s`` after ``started``.

        Raises:
            InferenceTimeoutError: the next event did not come in time.
        """
        while True:
            left_s = self._timeout_s - (time.monotonic() - started)
            try:
                event = await asyncio.wait_for(anext(stream), timeout=max(0.0, left_s))
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise self._thread.timeout_error() from None
            yield event

    def _done(self, ticket: Ticket, outcome: str, inference_s: float) -> None:
        """The request left the engine: counted and logged, its lease given back."""
        if outcome == "ok":
            self._thread.completion_finished(ticket, inference_s)
            return
        self._thread.log_finished(ticket, outcome, inference_s)
        ticket.device_done(ran=True)
