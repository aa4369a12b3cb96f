"""Token-level continuous batching of a replica's completions (chat and completions, streamed
or not, with stop strings and seeds).

Admitted completions wait in one FIFO; a single loop task runs decode steps on the replica's
inference thread (:class:`deployments.replica.inference.InferenceThread`, one job per step, so an
embedding pass of the same replica runs between two steps) for as long as any sequence runs
or waits. Between two steps, sequences whose callers left (a client gone, a timeout) leave
the engine, and waiting ones join, in arrival order, while the engine's cache for the
running batch stays within what the leases of the running and waiting sequences cover
(:meth:`~deployments.engines.stepping.DecodeStepper.kv_tokens_for`; always, for a paged
cache) and at most ``batching.max_batch_size`` run. A sequence that finishes returns at once;
its lease goes back as soon as the step that ended it returns, so the next one can join the
very next step. Each lease covers the KV blocks of its prompt + ``max_tokens`` and its share
of a step's activations (its price), so a running sequence never needs memory it was not
leased: nothing is preempted. A step that fails (an OOM) fails the sequences in it (503
``oom``), whose memory the engine has freed; the others wait on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from deployments.engines.stepping import KV_BLOCK_TOKENS, DecodeStepper, SequenceStart, kv_blocks
from deployments.replica.device_health import draining_error
from deployments.replica.inference import InferenceThread
from serve_app.admission.ticket import Ticket
from serve_app.config import AppArgs
from serve_app.metrics import ProcessMetrics
from serve_app.request import GenerationOutput

logger = logging.getLogger("ray.serve")


@dataclass(eq=False, kw_only=True)
class _Sequence:
    """One admitted completion, from the FIFO to its last token."""

    seq_id: int
    ticket: Ticket
    on_text: Callable[[str], Any] | None
    on_joined: Callable[[], Any] | None
    on_waiting: Callable[[int], Any] | None
    joined: asyncio.Future = field(repr=False)
    result: asyncio.Future = field(repr=False)
    enqueued_s: float = field(default_factory=time.monotonic)
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    cancelled: bool = False
    told_position: int = -1
    joined_s: float = 0.0
    last_token_s: float = 0.0

    prompt_tokens: int = 0
    max_tokens: int = 0

    def __post_init__(self) -> None:
        request = self.ticket.request
        self.prompt_tokens, self.max_tokens = request.prompt_tokens, request.params.max_tokens

    @property
    def final_tokens(self) -> int:
        """Prompt + ``max_tokens``: what its cache grows to at most."""
        return self.prompt_tokens + self.max_tokens

    @property
    def kv_row(self) -> tuple[int, int]:
        """``(tokens held now, tokens still to generate)``, as the engine's
        ``kv_tokens_for`` reads it."""
        return self.prompt_tokens + self.tokens, self.max_tokens - self.tokens

    def start(self) -> SequenceStart:
        request = self.ticket.request
        return SequenceStart(self.seq_id, request.input_ids[0], request.params)


@dataclass(frozen=True)
class _Step:
    """A step on the thread: what to await for its updates, who is in it, who left."""

    done: Awaitable[dict]
    members: list[_Sequence]
    leaving: list[_Sequence]


class DecodeLoop:
    """Continuous batching for one replica (see module docstring). Build it on the replica's
    event loop; :meth:`close` stops it.

    Args:
        thread: the inference thread the steps run on.
        engine: a :class:`~deployments.engines.stepping.DecodeStepper`.
        args: the config (``batching.max_batch_size``, ``admission`` timeouts).
        metrics: the replica's metrics (sequences, tokens, latencies).
        budget_bytes: the replica's byte budget now (sizes the KV pool shown in status).
    """

    def __init__(self, thread: InferenceThread, engine: DecodeStepper, args: AppArgs,
                 metrics: ProcessMetrics, budget_bytes: Callable[[], int]) -> None:
        self._thread, self._engine, self._args = thread, engine, args
        self._metrics, self._budget_bytes = metrics, budget_bytes
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}
        self._ids = itertools.count()
        self._kv_tokens_held = 0
        self.steps = 0
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run_forever())

    async def generate(self, ticket: Ticket, on_text: Callable[[str], Any] | None = None,
                       on_joined: Callable[[], Any] | None = None,
                       on_waiting: Callable[[int], Any] | None = None) -> GenerationOutput:
        """Run one admitted completion; ``on_text`` (on the event loop) gets each piece of
        text as it is final, ``on_joined`` is called when it joins the running batch,
        ``on_waiting`` with the number of completions waiting ahead of it whenever a step
        starts without it and that number changed (the batch is full, or its cache would
        outgrow the leases). Returns its output. Leaving early (cancellation, an error)
        takes the sequence out of the engine before the next step; its lease goes back then.

        ``admission.inference_timeout_s`` bounds the time without progress: from joining to
        the first token and between two tokens (a stalled device), not the whole completion,
        whose length the client chose with ``max_tokens`` and which shares its steps.

        Raises:
            OverloadedError: ``queue_timeout`` (it waited ``admission.max_queue_wait_s`` in
                all without joining), ``oom`` (a step it was in ran out of memory),
                ``draining``.
            InferenceTimeoutError: no token came for ``admission.inference_timeout_s``.
        """
        loop = asyncio.get_running_loop()
        sequence = _Sequence(seq_id=next(self._ids), ticket=ticket, on_text=on_text,
                             on_joined=on_joined, on_waiting=on_waiting,
                             joined=loop.create_future(), result=loop.create_future())
        self._waiting.append(sequence)
        self._wake.set()
        admission = self._args.admission
        try:
            limit_s = max(0.0, ticket.request.wait_bound_s(admission.max_queue_wait_s)
                          - ticket.queue_wait_s)
            try:
                await asyncio.wait_for(asyncio.shield(sequence.joined), limit_s)
            except TimeoutError:
                raise self._thread.queue_timeout([ticket]) from None
            while True:
                quiet_s = time.monotonic() - sequence.last_token_s
                done, _ = await asyncio.wait(
                    {sequence.result}, timeout=admission.inference_timeout_s - quiet_s)
                if done:
                    return sequence.result.result()
                if time.monotonic() - sequence.last_token_s >= admission.inference_timeout_s:
                    raise self._thread.timeout_error()
        finally:
            if not sequence.result.done():
                sequence.cancelled = True
                self._wake.set()

    def figures(self) -> dict[str, int]:
        """What ``/v1/status`` shows under ``kv_cache``: decode steps run, sequences running
        and waiting, the block size (tokens, bytes) and the blocks of the pool (the budget
        in blocks), leased (the prompt + ``max_tokens`` of every running and waiting
        sequence) and in use (the engine's cache after the last step)."""
        block_bytes = KV_BLOCK_TOKENS * self._engine.kv_bytes_per_token
        live = [s for s in (*self._running.values(), *self._waiting) if not s.cancelled]
        return {
            "steps": self.steps,
            "running_sequences": len(self._running),
            "waiting_sequences": sum(not s.cancelled for s in self._waiting),
            "block_tokens": KV_BLOCK_TOKENS, "block_bytes": block_bytes,
            "blocks_total": self._budget_bytes() // block_bytes if block_bytes else 0,
            "blocks_leased": sum(kv_blocks(s.final_tokens) for s in live),
            "blocks_in_use": kv_blocks(self._kv_tokens_held),
            "preempted_sequences": 0,  # a sequence is leased its whole KV cache up front
        }

    def close(self) -> None:
        """Stop stepping (replica shutdown): every sequence gets 503 ``draining``."""
        self._task.cancel()
        for sequence in (*self._running.values(), *self._waiting):
            self._fail(sequence, draining_error())
        self._running.clear()
        self._waiting.clear()

    # --- the loop task ---------------------------------------------------------------------

    async def _run_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._waiting = deque(s for s in self._waiting if not s.cancelled)
            try:
                step = self._start_step()
                while step is not None:
                    delivered = await self._finish_step(step)
                    # The next step goes to the thread before this one's texts, metrics and
                    # finished sequences are handled here: the device does not idle through
                    # them.
                    step = self._start_step()
                    try:
                        self._deliver(delivered)
                    except Exception:  # a bug: the step on the thread is still awaited
                        logger.exception("decode loop: handing out a step failed")
            except Exception:  # a bug: the sequences of the step got it; go on
                logger.exception("decode loop: a step failed unexpectedly")
                self._wake.set()

    def _start_step(self) -> _Step | None:
        """Hand the next step to the thread (sequences that left go out, waiting ones join),
        or ``None`` when nothing runs or waits."""
        leaving = [s for s in self._running.values() if s.cancelled]
        for sequence in leaving:
            del self._running[sequence.seq_id]
        joining = self._take_joiners()
        members = [*self._running.values(), *joining]
        if not members and not leaving:
            return None
        for sequence in joining:
            self._running[sequence.seq_id] = sequence
        work = partial(self._engine_step, [s.start() for s in joining],
                       [s.seq_id for s in leaving])
        self.steps += 1
        done = self._thread.run_step(work, sum(s.ticket.lease.nbytes for s in members))
        return _Step(done, members, leaving)

    async def _finish_step(self, step: _Step) -> list[tuple[_Sequence, Any, int]]:
        """Wait for ``step``; count each member's tokens and take the finished ones out of
        the running batch (what the next step needs). Returns ``(sequence, update, tokens
        made)`` per member to :meth:`_deliver`; a failed step fails its members."""
        try:
            updates = await step.done
        except Exception as exc:  # the engine has dropped every sequence
            for sequence in (*step.members, *step.leaving):
                self._fail(sequence, exc)
            return []
        finally:
            for sequence in step.leaving:
                sequence.ticket.device_done(ran=True)
        delivered = []
        for sequence in step.members:
            if (update := updates.get(sequence.seq_id)) is None:
                continue
            delivered.append((sequence, update, update.completion_tokens - sequence.tokens))
            sequence.tokens = update.completion_tokens
            if update.finish_reason is not None:
                del self._running[sequence.seq_id]
        return delivered

    def _deliver(self, delivered: list[tuple[_Sequence, Any, int]]) -> None:
        """A step's texts, latencies and finished sequences (their results and leases)."""
        now, made = time.monotonic(), 0
        for sequence, update, tokens in delivered:
            made += tokens
            self._apply(sequence, update, tokens, now)
        if made:
            self._metrics.inc("generated_tokens", made)

    def _engine_step(self, joining: list[SequenceStart], leaving: list[int]) -> dict:
        """On the inference thread: one engine step, and the cache it holds after it."""
        try:
            return self._engine.decode_step(joining, leaving)
        finally:
            self._kv_tokens_held = self._engine.kv_tokens_held()

    def _take_joiners(self) -> list[_Sequence]:
        """The waiting sequences that join now, in arrival order (see module docstring);
        from here on the device holds their leases."""
        joining: list[_Sequence] = []
        if not self._waiting:
            return joining
        for sequence in self._waiting:
            # Its caller left and gave the lease back before the cancellation of its
            # generate() reached the sequence (task.cancel is asynchronous): it must not
            # join, nor count as leased.
            sequence.cancelled |= sequence.ticket.released
        rows = [s.kv_row for s in self._running.values() if not s.cancelled]
        leased = sum(self._engine.kv_tokens_for([(s.final_tokens, 0)])
                     for s in (*self._running.values(), *self._waiting) if not s.cancelled)
        now = time.monotonic()
        while self._waiting and len(rows) < self._args.batching.max_batch_size:
            sequence = self._waiting[0]
            if sequence.cancelled:
                self._waiting.popleft()
                continue
            if rows and self._engine.kv_tokens_for([*rows, sequence.kv_row]) > leased:
                break
            self._waiting.popleft()
            rows.append(sequence.kv_row)
            ticket = sequence.ticket
            ticket.claim()
            ticket.mark_handed_to_thread(len(rows))
            ticket.add_wait(now - sequence.enqueued_s)
            self._thread.admitted(ticket, len(rows))
            sequence.joined_s = sequence.last_token_s = now
            sequence.joined.set_result(None)
            if sequence.on_joined is not None:
                sequence.on_joined()
            joining.append(sequence)
        self._tell_positions()
        return joining

    def _tell_positions(self) -> None:
        """Tell each waiting sequence that listens its place, when it changed."""
        ahead = 0
        for sequence in self._waiting:
            if sequence.cancelled:
                continue
            if sequence.on_waiting is not None and sequence.told_position != ahead:
                sequence.told_position = ahead
                sequence.on_waiting(ahead)
            ahead += 1

    def _apply(self, sequence: _Sequence, update: Any, made: int, now: float) -> None:
        """One step's update of one sequence (``made`` tokens): its text, its latencies, its
        end."""
        if update.text:
            sequence.pieces.append(update.text)
            if sequence.on_text is not None and not sequence.cancelled:
                sequence.on_text(update.text)
        if made:
            if sequence.tokens == made:
                self._metrics.observe("time_to_first_token_seconds",
                                      sequence.ticket.admission.queue_wait_s
                                      + now - sequence.enqueued_s)
            else:
                self._metrics.observe("inter_token_latency_seconds",
                                      now - sequence.last_token_s)
        sequence.last_token_s = now
        if update.finish_reason is None:
            return
        self._thread.completion_finished(sequence.ticket, now - sequence.joined_s)
        if not sequence.result.done():
            sequence.result.set_result(GenerationOutput(
                "".join(sequence.pieces), update.finish_reason,
                sequence.ticket.request.prompt_tokens, sequence.tokens))

    def _fail(self, sequence: _Sequence, error: BaseException) -> None:
        """End a sequence with ``error`` (the engine no longer holds it)."""
        self._running.pop(sequence.seq_id, None)
        if sequence.joined.done() and not sequence.cancelled:
            outcome = "oom" if getattr(error, "code", "") == "oom" else type(error).__name__
            self._thread.log_finished(sequence.ticket, outcome,
                                      time.monotonic() - sequence.joined_s)
        sequence.ticket.device_done(ran=sequence.joined.done())
        for future in (sequence.joined, sequence.result):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a caller that left never reads it
