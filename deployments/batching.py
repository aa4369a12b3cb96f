"""Continuous, budget-aware batching of admitted requests: embeddings, and completions.

Admitted requests wait in one FIFO; a single former task takes what waits whenever the
replica's inference thread is free (up to ``batching.max_batch_size`` inputs), splits it with
:func:`serve_app.admission.batching.form_batches` so that every forward pass is priced as a
whole and fits the leases of its members, and runs the passes on the thread
(:class:`deployments.inference.InferenceThread`), which releases every member's lease when it
is done with it. Requests arriving while a pass runs form the next one, so under load a batch
is as large as the backlog, and an idle replica starts a lone request at once (unless
``batching.max_wait_ms`` asks it to wait for company, as Triton's ``max_queue_delay``).

Why not Ray Serve's ``@serve.batch`` (used until this was measured): its loop
(``ray/serve/batching.py``, ``_BatchQueue._process_batches``) forms the next batch as soon as
its first request arrives and ``batch_wait_timeout_s`` has passed, *then* waits on the
``max_concurrent_batches`` semaphore, whether or not the worker is free. Batches are therefore
sized by the wait window rather than by the backlog, and every lone request on an idle replica
waits the whole window. Measured on 2 cores (``python -m benchmarks.latency``, one short
request at a time): 51.6 ms served with ``@serve.batch`` and a 20 ms window; the throughput
figures of both designs are in ``benchmarks/throughput.py``'s docstring.

Requests share a pass only with requests of the same kind: embeddings with embeddings;
completions with completions of the same ``temperature`` and ``top_p``, not streamed, without
stop strings or seed (one left-padded ``generate`` to the largest ``max_tokens``, each row cut
at its own, and never longer than the model's context; a lone one runs exactly as
unbatched). A request with more inputs than ``max_batch_size`` runs alone, as with
batching off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from deployments.engines.base import GenerationOutput, GenerationParams
from deployments.inference import InferenceThread
from serve_app.admission.batching import BatchMember, form_batches
from serve_app.admission.controller import Admission, AdmissionController
from serve_app.admission.policy import AdmissionPolicy
from serve_app.config import BatchingConfig
from serve_app.memory.cost_model import CostModel

logger = logging.getLogger("ray.serve")


#: What requests must share to run in one pass: ``("embed",)``, or ``("generate",
#: temperature, top_p)``.
BatchKey = tuple


@dataclass
class _Pending:
    """One admitted request waiting to be batched. Exactly one side owns its lease: the
    caller until ``handed`` (the former took it into a pass), the pass after; ``gone``: the
    caller left (and released it) before that."""

    key: BatchKey
    texts: list[str]  # the inputs, or the one prompt
    token_counts: list[int]
    admission: Admission
    result: asyncio.Future = field(repr=False)
    params: GenerationParams | None = None
    enqueued_s: float = field(default_factory=time.monotonic)
    batcher_wait_s: float = 0.0  # from enqueued to taken into a pass
    handed: bool = False
    gone: bool = False


class RequestBatcher:
    """Batches one replica's admitted requests (see module docstring). Build it on the
    replica's event loop: it starts the former task there; :meth:`close` stops it.

    Args:
        inference: the replica's inference thread.
        engine: the engine (``embed(texts)`` pads to the longest text; ``generate_batch``).
        cost_model: prices a forward pass of ``(inputs, padded tokens, new tokens)``.
        policy: the admission policy (prices in its units: bytes, or permits).
        gate: the admission controller (leases of requests that never reach a pass).
        config: ``batching.*``.
    """

    def __init__(self, inference: InferenceThread, engine: Any, cost_model: CostModel,
                 policy: AdmissionPolicy, gate: AdmissionController,
                 config: BatchingConfig) -> None:
        self._inference, self._engine, self._cost_model = inference, engine, cost_model
        self._policy, self._gate, self._config = policy, gate, config
        self._waiting: deque[_Pending] = deque()
        self._waiting_inputs = 0  # inputs of the live requests in _waiting
        self._arrived = asyncio.Event()
        self.passes = 0  # forward passes started, for tests and status
        self._former = asyncio.get_running_loop().create_task(self._form_forever())

    def batchable(self, inputs: int, params: GenerationParams | None = None,
                  stream: bool = False) -> bool:
        """Whether a request may share passes: at most ``max_batch_size`` inputs, and for a
        completion ``batching.completions`` on, not streamed, no stop strings, no seed."""
        if inputs > self._config.max_batch_size:
            return False
        return params is None or (self._config.completions and not stream
                                  and not params.stop and params.seed is None)

    async def embed(self, texts: list[str], token_counts: list[int],
                    admission: Admission) -> tuple[np.ndarray, float]:
        """Embed one admitted request, batched with others where they fit. Returns its
        ``(len(texts), dimensions)`` rows and the seconds it waited for a pass and the
        thread (queue wait beyond the lease's).

        Raises: as :meth:`InferenceThread.run`. On any exit before a pass took the request
        up (cancellation included), its lease is released here.
        """
        if not self.batchable(len(texts)):
            self.passes += 1
            return await self._inference.run(admission, lambda: self._engine.embed(texts))
        return await self._enqueue(("embed",), texts, token_counts, admission)

    async def complete(self, prompt: str, prompt_tokens: int, params: GenerationParams,
                       admission: Admission) -> tuple[GenerationOutput, float]:
        """Complete one admitted, :meth:`batchable` prompt with others of the same
        ``temperature`` and ``top_p`` (any ``max_tokens``). Returns its output and the
        seconds it waited for a pass and the thread.

        Raises: as :meth:`embed`.
        """
        key = ("generate", params.temperature, params.top_p)
        return await self._enqueue(key, [prompt], [prompt_tokens], admission, params)

    async def _enqueue(self, key: BatchKey, texts: list[str], token_counts: list[int],
                       admission: Admission, params: GenerationParams | None = None) -> Any:
        pending = _Pending(key, texts, token_counts, admission,
                           asyncio.get_running_loop().create_future(), params)
        self._waiting.append(pending)
        self._waiting_inputs += len(texts)
        self._arrived.set()
        try:
            return await pending.result
        except BaseException:
            if not pending.handed:
                pending.gone = True
                self._waiting_inputs -= len(texts)
                self._gate.release(admission.lease, ran=False)
            raise

    def close(self) -> None:
        """Stop forming passes (replica shutdown): requests still waiting get 503
        ``draining`` and their leases back; passes on the thread finish there."""
        self._former.cancel()
        for pending in self._waiting:  # each caller releases its own lease as it raises
            _settle(pending, self._inference.draining_error())

    # --- the former task ---------------------------------------------------------------

    async def _form_forever(self) -> None:
        while True:
            await self._arrived.wait()
            await self._wait_for_company()
            taken = self._take()
            if not taken:
                continue
            try:
                await self._run_passes(taken)
            except Exception:  # a bug; its passes' callers got it, later requests still run
                logger.exception("batch former: a pass failed unexpectedly")

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
        their leases."""
        taken: list[_Pending] = []
        kept: deque[_Pending] = deque()
        inputs = 0
        while self._waiting:
            pending = self._waiting.popleft()
            if pending.gone:
                continue
            if taken and (pending.key != taken[0].key
                          or inputs + len(pending.texts) > self._config.max_batch_size):
                kept.append(pending)
                if inputs >= self._config.max_batch_size:
                    break
                continue
            pending.handed = True
            # Time spent here is queue wait too: it counts towards admission.max_queue_wait_s
            # (InferenceThread.wait_started) and X-Queue-Wait-Ms.
            pending.batcher_wait_s = time.monotonic() - pending.enqueued_s
            pending.admission = dataclasses.replace(
                pending.admission,
                queue_wait_s=pending.admission.queue_wait_s + pending.batcher_wait_s)
            inputs += len(pending.texts)
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

    async def _run_passes(self, taken: list[_Pending]) -> None:
        """Split ``taken`` into passes that fit their leases and run them; every member's
        caller gets its result or the exception of its pass."""
        try:
            members = [BatchMember(len(p.texts), max(p.token_counts), p.admission.lease.nbytes,
                                   p.params.max_tokens if p.params else 0) for p in taken]
            groups = form_batches(members, self._price, self._config.max_batch_size)
        except Exception as exc:  # a bug: nothing ran, so the leases go back here
            logger.exception("could not form batches")
            for pending in taken:
                self._gate.release(pending.admission.lease, ran=False)
                _settle(pending, exc)
            return
        await asyncio.gather(*(self._run_pass([taken[i] for i in group]) for group in groups))

    async def _run_pass(self, group: list[_Pending]) -> None:
        texts = [text for pending in group for text in pending.texts]
        params = group[0].params
        if params is None:
            work = partial(self._engine.embed, texts)
        elif len(group) == 1:  # exactly the unbatched path
            work = partial(self._engine.generate, texts[0], params)
        else:
            work = partial(self._engine.generate_batch, texts,
                           [pending.params for pending in group])
        self.passes += 1
        try:
            output, thread_wait_s = await self._inference.run(
                [pending.admission for pending in group], work)
        except Exception as exc:  # each member's caller raises it
            for pending in group:
                _settle(pending, exc)
            return
        except asyncio.CancelledError:  # closed: the thread still releases the leases
            for pending in group:
                _settle(pending, self._inference.draining_error())
            raise
        if params is not None:
            outputs = output if isinstance(output, list) else [output]
            for pending, one in zip(group, outputs, strict=True):
                _settle(pending, (one, pending.batcher_wait_s + thread_wait_s))
            return
        start = 0
        for pending in group:
            end = start + len(pending.texts)
            _settle(pending, (output[start:end], pending.batcher_wait_s + thread_wait_s))
            start = end

    def _price(self, inputs: int, padded_tokens: int, new_tokens: int) -> float:
        """A pass of ``inputs`` padded to ``padded_tokens`` (+ ``new_tokens`` generated). A
        generation pass is priced ``inputs`` x one prompt's price: the profile measures
        generation at batch 1, and every activation and KV-cache tensor of a decoder has a
        leading batch dimension (the weights, shared, are held, not priced), so b rows hold
        at most b x one row. A generation pass longer than the model's context
        (``max_seq_tokens``: the longest prompt left-padded, then the largest ``max_tokens``)
        is priced at infinity, so that it is never formed."""
        if new_tokens:
            if padded_tokens + new_tokens > self._engine.max_seq_tokens:
                return math.inf
            one = self._cost_model.request_bytes(1, padded_tokens, new_tokens)
            return self._policy.units(inputs * one)
        return self._policy.units(self._cost_model.request_bytes(inputs, padded_tokens, 0))


def _settle(pending: _Pending, outcome: Any) -> None:
    """Give a member's caller its rows, or its exception; a caller that left gets nothing."""
    if pending.result.done():
        return
    if isinstance(outcome, BaseException):
        pending.result.set_exception(outcome)
    else:
        pending.result.set_result(outcome)
