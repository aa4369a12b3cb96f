"""Continuous, budget-aware batching of admitted requests: embeddings, and completions.

Admitted requests wait in one FIFO; a single former task takes what waits whenever the
replica's inference thread is free (up to ``batching.max_batch_size`` inputs), splits it with
:func:`serve_app.admission.batching.form_batches` so that every forward pass is priced as a
whole and fits the leases of its members, and runs the passes on the thread
(:class:`deployments.replica.inference.InferenceThread`); a member's lease goes back once the thread
is done with its pass (:mod:`serve_app.admission.ticket`). Requests arriving while a pass
runs form the next one, so under load a batch is as large as the backlog, and an idle
replica starts a lone request at once (unless ``batching.max_wait_ms`` asks it to wait for
company, as Triton's ``max_queue_delay``). One pass may wait on the thread behind the running
one, when a full pass (``max_batch_size`` inputs) is already waiting for it: under a backlog
the device goes from pass to pass while the event loop answers the last pass's requests and
forms the next, instead of idling through both (measured on an H200: 512 embeddings ran at
0.76 of the bare model's batched throughput when every pass waited for the thread to hand
the last one back; see docs/profiling.md). Short of a full pass the former waits for the
thread as before, so that a pass gathers whatever arrives while the device is busy.

Why not Ray Serve's ``@serve.batch`` (used until this was measured): its loop
(``ray/serve/batching.py``, ``_BatchQueue._process_batches``) forms the next batch as soon as
its first request arrives and ``batch_wait_timeout_s`` has passed, *then* waits on the
``max_concurrent_batches`` semaphore, whether or not the worker is free. Batches are therefore
sized by the wait window rather than by the backlog, and every lone request on an idle replica
waits the whole window. Measured on 2 cores (``python -m benchmarks.latency``, one short
request at a time): 51.6 ms served with ``@serve.batch`` and a 20 ms window; the throughput
figures of both designs are in ``benchmarks/throughput.py``'s docstring.

Requests share a pass only with requests of the same batch key (:mod:`serve_app.kinds`):
embeddings with embeddings; completions with completions of the same ``temperature`` and
``top_p``, not streamed, without stop strings or seed (one left-padded ``generate`` to the
largest ``max_tokens``, each row cut at its own, and never longer than the model's context; a
lone one runs exactly as unbatched). A request without a batch key (e.g. more inputs than
``max_batch_size``) runs alone, as with batching off.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from deployments.engines.base import Engine
from deployments.replica.device_health import draining_error
from deployments.replica.inference import InferenceThread
from serve_app.admission.batching import BatchMember, form_batches
from serve_app.admission.ticket import Ticket
from serve_app.config import BatchingConfig
from serve_app.kinds import KINDS
from serve_app.memory.cost_model import Shape
from serve_app.pricing import Pricer

logger = logging.getLogger("ray.serve")


@dataclass(eq=False)
class _Pending:
    """One admitted request waiting to be batched. Its caller owns the lease until the
    former takes it into a pass (``handed``: the ticket is claimed for the device from then);
    ``gone``: the caller left before that."""

    ticket: Ticket
    result: asyncio.Future = field(repr=False)
    enqueued_s: float = field(default_factory=time.monotonic)
    handed: bool = False
    gone: bool = False

    @property
    def inputs(self) -> int:
        return len(self.ticket.request.input_ids)


class RequestBatcher:
    """Batches one replica's admitted requests (see module docstring). Build it on the
    replica's event loop: it starts the former task there; :meth:`close` stops it.

    Args:
        inference: the replica's inference thread.
        engine: the engine (``run_batch`` runs one pass; ``max_seq_tokens`` its context).
        pricer: prices a pass as the replica prices requests (:mod:`serve_app.pricing`).
        config: ``batching.*``.
    """

    def __init__(self, inference: InferenceThread, engine: Engine, pricer: Pricer,
                 config: BatchingConfig) -> None:
        self._inference, self._engine, self._pricer = inference, engine, pricer
        self._config = config
        self._waiting: deque[_Pending] = deque()
        self._waiting_inputs = 0  # inputs of the live requests in _waiting
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()  # a pass came back, or a full pass waits
        self._in_flight = 0  # takes handed to the thread and not all handed back
        self.passes = 0  # forward passes started, for tests and status
        self._passes_running: set[asyncio.Task] = set()
        self._former = asyncio.get_running_loop().create_task(self._form_forever())

    async def run(self, ticket: Ticket) -> Any:
        """Run one admitted request: alone when it has no ``batch_key`` (as with batching
        off), else as :meth:`submit`. Returns its output.

        Raises: as :meth:`InferenceThread.run`.
        """
        if ticket.request.batch_key is None:
            self.passes += 1
            [output] = await self._inference.run(
                [ticket], partial(self._engine.run_batch, [ticket.request]))
            return output
        return await self.submit(ticket)

    async def submit(self, ticket: Ticket) -> Any:
        """Run one admitted request (its ``batch_key`` set) in a pass with others of the
        same key, where they fit. Returns its output; its ``ticket.waited_s`` grows by the
        time it waited for a pass and the thread (queue wait beyond the lease's).

        Raises: as :meth:`InferenceThread.run`. On any exit before a pass took the request
        up (cancellation included), the ticket is left unclaimed (its caller releases it).
        """
        pending = _Pending(ticket, asyncio.get_running_loop().create_future())
        self._waiting.append(pending)
        self._waiting_inputs += pending.inputs
        self._arrived.set()
        if self._waiting_inputs >= self._config.max_batch_size:
            self._room.set()
        try:
            return await pending.result
        except BaseException:
            if not pending.handed:
                pending.gone = True
                self._waiting_inputs -= pending.inputs
            raise

    def close(self) -> None:
        """Stop forming passes (replica shutdown): requests still waiting get 503
        ``draining`` (their callers release their leases); passes on the thread finish
        there."""
        self._former.cancel()
        for task in self._passes_running:
            task.cancel()
        for pending in self._waiting:
            _settle(pending, draining_error())

    # --- the former task ---------------------------------------------------------------

    async def _form_forever(self) -> None:
        while True:
            await self._arrived.wait()
            while not self._room_for_a_pass():
                self._room.clear()
                await self._room.wait()
            if self._in_flight == 0:
                await self._wait_for_company()
            taken = self._take()
            if not taken:
                continue
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(
                self._run_passes(taken, self._handed_back_once()))
            self._passes_running.add(task)
            task.add_done_callback(self._passes_running.discard)

    def _room_for_a_pass(self) -> bool:
        """Whether the former may take a pass now: the thread has none of ours, or has one
        and a full pass waits (see module docstring)."""
        return self._in_flight == 0 or (
            self._in_flight == 1 and self._waiting_inputs >= self._config.max_batch_size)

    def _handed_back_once(self) -> Callable[[], None]:
        """What a take calls when the thread has handed all its passes back (once; later
        calls do nothing): the former may take the next pass."""
        called = [False]

        def handed_back() -> None:
            if not called[0]:
                called[0] = True
                self._in_flight -= 1
                self._room.set()

        return handed_back

    @property
    def pending_passes(self) -> int:
        """Passes the admitted requests waiting here will take at least (their inputs over
        ``max_batch_size``, rounded up)."""
        return math.ceil(self._waiting_inputs / self._config.max_batch_size)

    async def _wait_for_company(self) -> None:
        """With the thread free and fewer than ``max_batch_size`` inputs waiting, wait up to
        ``max_wait_ms`` for more (0: start at once)."""
        deadline_s = self._config.max_wait_ms / 1000
        if deadline_s <= 0:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + deadline_s
        while self._waiting_inputs < self._config.max_batch_size and loop.time() < until:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), until - loop.time())
            except TimeoutError:
                break

    def _take(self) -> list[_Pending]:
        """The oldest live request and the live requests after it with its key, up to
        ``max_batch_size`` inputs (others keep their places); from here on the passes own
        their leases (the tickets are claimed)."""
        taken: list[_Pending] = []
        kept: deque[_Pending] = deque()
        inputs = 0
        while self._waiting:
            pending = self._waiting.popleft()
            if pending.gone:
                continue
            key = pending.ticket.request.batch_key
            if taken and (key != taken[0].ticket.request.batch_key
                          or inputs + pending.inputs > self._config.max_batch_size):
                kept.append(pending)
                if inputs >= self._config.max_batch_size:
                    break
                continue
            pending.handed = True
            pending.ticket.claim()
            # Time spent here is queue wait too: it counts towards admission.max_queue_wait_s
            # (InferenceThread.wait_started) and X-Queue-Wait-Ms.
            pending.ticket.add_wait(time.monotonic() - pending.enqueued_s)
            inputs += pending.inputs
            taken.append(pending)
        kept.extend(self._waiting)
        self._waiting = kept
        self._waiting_inputs -= inputs
        # Requests of another kind (or beyond max_batch_size) still waiting form the next
        # pass: the former must not sleep on an event cleared while it waited for company.
        if self._waiting:
            self._arrived.set()
        else:
            self._arrived.clear()
        return taken

    async def _run_passes(self, taken: list[_Pending], handed_back: Callable[[], None]) -> None:
        """Split ``taken`` into passes that fit their leases and run them; every member's
        caller gets its output or the exception of its pass. ``handed_back()`` once the
        thread has handed every pass back, before their callers get anything (and on any way
        out). A member whose pass never reached the thread (a bug, or the replica closing) is
        given back to its caller."""
        try:
            members = [_member(p.ticket) for p in taken]
            kind = taken[0].ticket.request.kind
            groups = form_batches(members, partial(self._price, kind),
                                  self._config.max_batch_size)
            left = [len(groups)]

            def one_back() -> None:
                left[0] -= 1
                if left[0] == 0:
                    handed_back()

            await asyncio.gather(*(self._run_pass([taken[i] for i in group], one_back)
                                   for group in groups))
        except Exception as exc:  # a bug: what did not run gets it
            logger.exception("could not form or run batches")
            for pending in taken:
                _settle(pending, exc)
        finally:
            handed_back()
            for pending in taken:
                if not pending.ticket.handed_to_thread:
                    pending.ticket.device_done(ran=False)
                    _settle(pending, draining_error())

    async def _run_pass(self, group: list[_Pending], handed_back: Callable[[], None]) -> None:
        """One pass on the thread; ``handed_back()`` once the thread returns it (or it
        failed), before its members' callers get their outputs."""
        tickets = [pending.ticket for pending in group]
        work = partial(self._engine.run_batch, [t.request for t in tickets])
        self.passes += 1
        try:
            outputs = await self._inference.run(
                tickets, work, on_expired=lambda index, exc: _settle(group[index], exc))
        except Exception as exc:  # each member's caller raises it
            handed_back()
            for pending in group:
                _settle(pending, exc)
            return
        except asyncio.CancelledError:  # closed: the thread still finishes the pass
            for pending in group:
                _settle(pending, draining_error())
            raise
        handed_back()
        for pending, output in zip(group, outputs, strict=True):
            _settle(pending, output)

    def _price(self, kind: str, inputs: int, padded_tokens: int, new_tokens: int) -> float:
        """A pass of ``inputs`` padded to ``padded_tokens`` (+ ``new_tokens`` generated),
        priced by the one rule (:func:`serve_app.pricing.shape_bytes`); a pass longer than
        the model's context for its kind (the longest prompt left-padded, then the largest
        ``max_tokens``) is priced at infinity, so that it is never formed."""
        if not KINDS[kind].fits_context(padded_tokens, new_tokens, self._engine.max_seq_tokens):
            return math.inf
        return self._pricer.units(Shape(inputs, padded_tokens, new_tokens))


def _member(ticket: Ticket) -> BatchMember:
    request = ticket.request
    new_tokens = KINDS[request.kind].new_tokens(request.params)
    return BatchMember(len(request.input_ids), KINDS[request.kind].pass_length(request),
                       ticket.lease.nbytes, new_tokens)


def _settle(pending: _Pending, outcome: Any) -> None:
    """Give a member's caller its output, or its exception; a caller that left gets
    nothing."""
    if pending.result.done():
        return
    if isinstance(outcome, BaseException):
        pending.result.set_exception(outcome)
    else:
        pending.result.set_result(outcome)
