"""One request's life on a model replica: admit -> batch -> run, and the lease given back by
one function, exactly once.

:meth:`RequestLifecycle.infer` and :meth:`RequestLifecycle.infer_stream` both hold their
request's lease through :meth:`RequestLifecycle._lease`: it prices the request (the one rule,
:mod:`serve_app.pricing`, with the replica's own cost model), waits for a lease from the
admission gate, and on every way out (result, error, timeout, cancellation, a streaming
client that left) its one ``finally`` lets go of the lease
(:meth:`~serve_app.admission.ticket.Ticket.caller_done`). The lease goes back through
:meth:`RequestLifecycle._give_back` when its last holder lets go: the caller if the device
never took the request up, else the inference thread once it is done with the pass (so that
the bytes are free for the next pass at once, as the device frees them).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial

from deployments.engines.base import Engine
from deployments.replica.batching import RequestBatcher
from deployments.replica.decode_loop import DecodeLoop
from deployments.replica.device_health import DeviceHealth, draining_error
from deployments.replica.inference import InferenceThread
from deployments.replica.request_log import RequestLog
from deployments.replica.scheduled import ScheduledRuns
from serve_app.admission.controller import Admission, AdmissionController, OnQueued
from serve_app.admission.ticket import Ticket
from serve_app.config import AppArgs
from serve_app.errors import InvalidRequestError, ModelNotFoundError, ServeAppError
from serve_app.kinds import KINDS
from serve_app.metrics import ProcessMetrics
from serve_app.outcomes import Outcome, Reason
from serve_app.pricing import Pricer, shape_bytes
from serve_app.request import InferenceRequest
from serve_app.schemas import Admitted, InferenceResult
from serve_app.stream_events import Finished, Queued, StreamEvent, TextPiece

POSITION_EVERY_S = 1.0
"""A waiting stream hears its position at least this often (it also hears every move)."""


def _queued_item(position: int, eta_s: float | None, told_at: float) -> Queued:
    """A :class:`Queued` item: the position, and the predicted wait less what passed since
    it was predicted (milliseconds; ``None`` while no drain rate is measured)."""
    eta_ms = None if eta_s is None else max(
        0, round((eta_s - (time.monotonic() - told_at)) * 1000))
    return Queued(position, eta_ms)


class RequestLifecycle:
    """Admits, batches and runs one replica's requests.

    Args:
        engine: the loaded engine (its kinds, context and runners).
        gate: the admission controller.
        pricer: the replica's prices (its corrected cost model, its policy's units).
        thread: the inference thread.
        batcher: the batcher, or ``None`` (``batching.enabled: false``).
        decode: the continuous-batching loop completions run on, or ``None``
            (``batching.continuous: false``, or an engine without decode steps).
        scheduled: the runs of an engine that schedules itself, or ``None``: every request
            then goes to it once admitted (no batcher, thread or decode loop).
        health: the device health (faults refuse requests).
        args: the config (model name, limits, timeouts).
        metrics, log: the replica's metrics and request log.
        replica_id: the replica's id (in results).
        request_id: the current request's id, for logs (Ray Serve's request context).
    """

    def __init__(self, engine: Engine, gate: AdmissionController, pricer: Pricer,
                 thread: InferenceThread, batcher: RequestBatcher | None,
                 health: DeviceHealth, args: AppArgs, metrics: ProcessMetrics,
                 log: RequestLog, replica_id: str = "local",
                 request_id: Callable[[], str] = lambda: "",
                 decode: DecodeLoop | None = None,
                 scheduled: ScheduledRuns | None = None) -> None:
        self._engine, self._gate, self._pricer = engine, gate, pricer
        self._decode, self._scheduled = decode, scheduled
        self._thread, self._batcher, self._health = thread, batcher, health
        self._args, self._metrics, self._log = args, metrics, log
        self._replica_id, self._request_id = replica_id, request_id

    def _steps(self, request: InferenceRequest) -> bool:
        """Whether ``request`` runs on continuous batching (it joins the running batch once
        its own bytes are free) rather than in a forward pass (after the work admitted
        before it)."""
        return self._decode is not None and KINDS[request.kind].generates

    def _joins_running_work(self, request: InferenceRequest) -> bool:
        """Whether ``request`` starts once its own bytes are free (continuous batching, or an
        engine that schedules itself), not after the work admitted before it."""
        return self._scheduled is not None or self._steps(request)

    async def infer(self, request: InferenceRequest,
                    admission: Admission | None = None) -> InferenceResult:
        """Run ``request`` once admitted; batched with others where its ``batch_key`` allows.
        ``admission``: a lease it already holds (a durable job's, taken when it fitted); the
        request then owns it, whatever happens.

        Raises:
            ModelNotFoundError: the engine does not serve the request's kind (404).
            InvalidRequestError: the request is larger than its priced shape or the limits.
            RequestTooLargeError, OverloadedError: from admission (400, 503).
            InferenceTimeoutError: inference ran past ``admission.inference_timeout_s`` (504).
            OverloadedError: ``oom``, or ``draining`` after a device fault, including output
                with NaN/Inf (503).
        """
        try:
            self._accept(request)
        except BaseException:
            if admission is not None:
                self._gate.release(admission.lease, ran=False)
            raise
        async with self._lease(request, admission) as ticket:
            if self._scheduled is not None:
                output = await self._scheduled.result(ticket)
            elif self._steps(request):
                output = await self._decode.generate(ticket)
            elif self._batcher is not None:
                output = await self._batcher.run(ticket)
            else:
                [output] = await self._thread.run(
                    [ticket], partial(self._engine.run_batch, [request]))
            if not output.finite():
                self._health.mark_device_fault("an output came out NaN/Inf")
                raise draining_error()
            return InferenceResult(output, self._admitted(ticket), self._replica_id)

    async def infer_stream(self, request: InferenceRequest) -> AsyncIterator[StreamEvent]:
        """Stream a request (:mod:`serve_app.stream_events`): while it waits for its lease,
        :class:`Queued` (position, ``eta_ms``) when it is queued, whenever it moves up and at
        least every ``POSITION_EVERY_S``; then :class:`Admitted` once the lease is held, then
        :class:`TextPiece` items, then :class:`Finished` (the finish reason, prompt and
        completion tokens). Errors before the first item are :meth:`infer`'s; an error
        after it (a refusal after it was queued, ``InferenceTimeoutError``) ends the stream
        by raising.

        When the consumer goes away (it closes the stream at an item, or is cancelled), the
        client is gone (:meth:`InferenceThread.client_gone`, once, whenever it left),
        generation stops at the next token and the lease is released once the inference
        thread has returned.
        """
        self._accept(request)
        admissions: list[Admission] = []
        async for item in self._admit_watched(request, admissions):
            yield item
        async with self._lease(request, admissions[0]) as ticket:
            items = self._stream_items(ticket)
            try:
                async with contextlib.aclosing(items):  # closed now, not when collected
                    async for item in items:
                        yield item
            except (GeneratorExit, asyncio.CancelledError):
                self._thread.client_gone(ticket.lease.nbytes, ticket.admission.request_id)
                raise

    @contextlib.asynccontextmanager
    async def _lease(self, request: InferenceRequest,
                     admission: Admission | None = None) -> AsyncIterator[Ticket]:
        """The request's ticket, from admission (or the ``admission`` it already holds) to
        the one ``finally`` that lets go of it."""
        ticket = Ticket(request, admission or await self._admit(request), self._give_back)
        try:
            yield ticket
        finally:
            ticket.caller_done()

    async def _admit_watched(self, request: InferenceRequest,
                             admissions: list[Admission]) -> AsyncIterator[Queued]:
        """:meth:`_admit`, yielding :class:`Queued` items while the request waits; the
        admission is appended to ``admissions``. If the consumer leaves meanwhile, the wait
        is cancelled (a lease granted in that instant goes back unused)."""
        moves: asyncio.Queue[tuple[int, float | None]] = asyncio.Queue()
        admit = asyncio.ensure_future(self._admit(
            request, on_queued=lambda position, eta_s: moves.put_nowait((position, eta_s))))
        move: asyncio.Future | None = None
        try:
            last: tuple[int, float | None, float] | None = None
            while not admit.done():
                move = asyncio.ensure_future(moves.get())
                done, _ = await asyncio.wait({admit, move}, timeout=POSITION_EVERY_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                if move in done:
                    last = (*move.result(), time.monotonic())
                else:
                    move.cancel()
                if last is not None and (move in done or not done):
                    yield _queued_item(*last)
        except BaseException:
            if move is not None:
                move.cancel()
            admit.cancel()
            if admit.done() and not admit.cancelled() and admit.exception() is None:
                self._gate.release(admit.result().lease, ran=False)
            raise
        admissions.append(admit.result())

    def _give_back(self, ticket: Ticket, *, ran: bool) -> None:
        """The one place a lease goes back (``ran``: the device used it)."""
        self._gate.release(ticket.lease, ran=ran)
        self._log.event("lease released", ticket.lease.nbytes, ticket.admission.request_id,
                        ran=ran, batch=ticket.batch)

    def _accept(self, request: InferenceRequest) -> None:
        """The replica stays the authority: a request of a kind it does not serve, or whose
        priced shape does not cover it, is refused before it is priced."""
        if request.kind not in self._engine.kinds:
            raise ModelNotFoundError(
                f"model {self._args.model.name!r} does not serve {request.kind}")
        kind, counts, shape = KINDS[request.kind], request.token_counts, request.shape
        max_seq = self._engine.max_seq_tokens
        kind.check_tokens(counts, request.params,
                          min(self._args.limits.max_input_tokens, max_seq), max_seq)
        if (shape.inputs != len(counts) or shape.prompt_tokens < kind.pass_length(request)
                or shape.new_tokens < kind.new_tokens(request.params)):
            raise InvalidRequestError(f"the request is priced at {tuple(shape)} (inputs, "
                                      "tokens, new tokens), smaller than it is", code="shape")

    async def _admit(self, request: InferenceRequest,
                     on_queued: OnQueued | None = None) -> Admission:
        """A lease for ``request``'s priced shape. Refusals are counted here (the admission
        is counted once the inference thread takes the request up: :mod:`.inference`). The
        time since ``sent_at_s`` (wall clock, the ingress's; clamped at 0) counts as queue
        wait already spent.

        Raises: as :meth:`AdmissionController.acquire`; ``draining`` after a device fault.
        """
        try:
            if self._health.device_fault is not None:
                raise draining_error()
            shape = request.shape
            request_bytes = shape_bytes(self._pricer.cost_model, shape)
            self._log.event("arrived", request_bytes, batch=shape.inputs,
                            prompt_tokens=shape.prompt_tokens, new_tokens=shape.new_tokens,
                            tenant=request.tenant)
            sent_at_s = request.sent_at_s
            waited_s = 0.0 if sent_at_s is None else max(0.0, time.time() - sent_at_s)
            admission = await self._gate.acquire(
                self._pricer.policy.units(request_bytes), waited_s, request.wait_limit_s,
                on_queued, after_in_flight=not self._joins_running_work(request),
                tenant=request.tenant, priority=request.priority)
            # Kept with the lease: a batch runs outside this request's logging context.
            return replace(admission, request_id=self._request_id() or "")
        except ServeAppError as exc:
            self._metrics.inc("admission_decisions", outcome=Outcome.REJECTED,
                              reason=Reason(exc.code))
            self._metrics.inc("tenant_refusals", tenant=request.tenant, reason=Reason(exc.code))
            raise
        except asyncio.CancelledError:
            self._thread.client_gone(shape_bytes(self._pricer.cost_model, request.shape))
            raise

    def _stream_items(self, ticket: Ticket) -> AsyncIterator[StreamEvent]:
        """The items of an admitted stream, from whichever path runs it."""
        if self._scheduled is not None:
            return self._stream_scheduled(ticket)
        if self._decode is not None:
            return self._stream_steps(ticket)
        return self._stream(ticket)

    async def _stream_scheduled(self, ticket: Ticket) -> AsyncIterator[StreamEvent]:
        """The :class:`Admitted` item, then the engine's own events (it admitted at once:
        the engine schedules what it was given)."""
        yield self._admitted(ticket)
        async with contextlib.aclosing(self._scheduled.events(ticket)) as events:
            async for event in events:
                yield event

    async def _stream(self, ticket: Ticket) -> AsyncIterator[StreamEvent]:
        """The :class:`Admitted` item, then ``ticket``'s request run on the thread, its text
        pieces as they come."""
        yield self._admitted(ticket)
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str] = asyncio.Queue()
        consumer_gone = threading.Event()

        def on_text(piece: str) -> bool:  # runs on the inference thread
            if consumer_gone.is_set():
                return False
            loop.call_soon_threadsafe(pieces.put_nowait, piece)
            return True

        future, job = self._thread.start(
            [ticket], partial(self._engine.run_stream, ticket.request, on_text))
        try:
            await self._thread.wait_started(future, job, [ticket], count_gone=False)
            deadline = loop.time() + self._args.admission.inference_timeout_s
            while not future.done():
                getter = asyncio.ensure_future(pieces.get())
                done, _ = await asyncio.wait({getter, future}, timeout=deadline - loop.time(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield TextPiece(getter.result())
                    continue
                getter.cancel()
                if not done:
                    raise self._thread.timeout_error()
            while not pieces.empty():  # pieces put before the thread returned
                yield TextPiece(pieces.get_nowait())
            try:
                output = future.result()
            except RuntimeError as exc:
                raise self._health.error_for(exc, ticket.lease.nbytes) from None
            yield Finished(output.finish_reason, ticket.request.prompt_tokens,
                           output.completion_tokens)
        finally:
            consumer_gone.set()

    async def _stream_steps(self, ticket: Ticket) -> AsyncIterator[StreamEvent]:
        """As :meth:`_stream`, on the continuous-batching loop: :class:`Queued` items
        while the sequence waits for a place in the running batch (its position among the
        completions waiting there, when it changes and at least every ``POSITION_EVERY_S``;
        no ``eta_ms``), the :class:`Admitted` item once it joined, then a piece as each step
        makes it; the sequence leaves the engine before the next step once the consumer is
        gone. A refusal before the first item (``queue_timeout`` while it waited to join,
        having heard nothing) is an HTTP error; after a ``queued`` item, the route ends the
        stream with it."""
        pieces: asyncio.Queue[str] = asyncio.Queue()
        moves: asyncio.Queue[int] = asyncio.Queue()
        joined = asyncio.Event()
        task = asyncio.ensure_future(self._decode.generate(
            ticket, pieces.put_nowait, joined.set, moves.put_nowait))
        try:
            async for item in self._waiting_to_join(task, joined, moves):
                yield item
            if not joined.is_set():
                task.result()  # its refusal; it cannot have succeeded without joining
            yield self._admitted(ticket)
            while not task.done():
                getter = asyncio.ensure_future(pieces.get())
                done, _ = await asyncio.wait({getter, task},
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield TextPiece(getter.result())
                else:
                    getter.cancel()
            while not pieces.empty():
                yield TextPiece(pieces.get_nowait())
            output = task.result()
            yield Finished(output.finish_reason, ticket.request.prompt_tokens,
                           output.completion_tokens)
        finally:
            task.cancel()

    @staticmethod
    async def _waiting_to_join(task: asyncio.Future, joined: asyncio.Event,
                               moves: asyncio.Queue[int]) -> AsyncIterator[Queued]:
        """:class:`Queued` items until ``joined`` is set or ``task`` ends."""
        waiter = asyncio.ensure_future(joined.wait())
        told: tuple[int, float] | None = None
        try:
            while not waiter.done() and not task.done():
                move = asyncio.ensure_future(moves.get())
                done, _ = await asyncio.wait({waiter, task, move}, timeout=POSITION_EVERY_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                if move in done:
                    told = (move.result(), time.monotonic())
                else:
                    move.cancel()
                if told is not None and not waiter.done() and not task.done() \
                        and (move in done or not done):
                    yield _queued_item(told[0], None, told[1])
        finally:
            waiter.cancel()

    @staticmethod
    def _admitted(ticket: Ticket) -> Admitted:
        """Queue wait = waiting for the lease + for a pass and the inference thread."""
        return Admitted(ticket.queue_wait_s, ticket.admission.queue_position)
