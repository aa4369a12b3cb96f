"""Dynamic batching of admitted embedding requests, on Ray Serve's ``@serve.batch``.

Ray Serve collects the calls (up to ``batching.max_batch_size`` inputs, counted by its
``batch_size_fn``, or ``batching.max_wait_ms`` after the first); the collected requests, each
already holding its own lease, are then split by :func:`serve_app.admission.batching.
form_batches` so that every forward pass is priced as a whole and fits the leases of its
members, and each pass runs as one job on the replica's inference thread
(:class:`deployments.inference.InferenceThread`), which releases every member's lease when the
thread is done with it. One collected group is in flight at a time: requests arriving while
the thread runs it wait in Ray Serve's queue and form the next, larger group (with two in
flight, the second took single requests as they came, measured: batches of 1-2).

A request with more inputs than ``max_batch_size`` runs alone, as with batching off.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
from ray import serve

from deployments.inference import InferenceThread
from serve_app.admission.batching import BatchMember, form_batches
from serve_app.admission.controller import Admission, AdmissionController
from serve_app.admission.policy import AdmissionPolicy
from serve_app.config import BatchingConfig
from serve_app.memory.cost_model import CostModel


@dataclass
class _Pending:
    """One admitted request waiting to be batched. Exactly one side owns its lease: the
    caller until ``handed`` (a pass took it), the pass after; ``gone``: the caller left (and
    released it) before that."""

    texts: list[str]
    token_counts: list[int]
    admission: Admission
    handed: bool = False
    gone: bool = False


def _inputs(items: list[_Pending]) -> int:
    """``batch_size_fn``: Ray Serve's batch size counts inputs, not requests."""
    return sum(len(item.texts) for item in items)


class EmbeddingBatcher:
    """Batches one replica's admitted embedding requests (see module docstring).

    Args:
        inference: the replica's inference thread.
        engine: the embedding engine (``embed(texts)`` pads to the longest text).
        cost_model: prices a forward pass of ``(inputs, padded tokens)``.
        policy: the admission policy (prices in its units: bytes, or permits).
        gate: the admission controller (leases of requests that never reach a job).
        config: ``batching.*``.
    """

    def __init__(self, inference: InferenceThread, engine: Any, cost_model: CostModel,
                 policy: AdmissionPolicy, gate: AdmissionController,
                 config: BatchingConfig) -> None:
        self._inference, self._engine, self._cost_model = inference, engine, cost_model
        self._policy, self._gate, self._config = policy, gate, config
        self._collect.set_max_batch_size(config.max_batch_size)
        self._collect.set_batch_wait_timeout_s(config.max_wait_ms / 1000)

    async def embed(self, texts: list[str], token_counts: list[int],
                    admission: Admission) -> tuple[np.ndarray, float]:
        """Embed one admitted request, batched with others where they fit. Returns its
        ``(len(texts), dimensions)`` rows and the seconds it waited for the thread.

        Raises: as :meth:`InferenceThread.run`. On any exit before a job took the request
        up (cancellation included), its lease is released here.
        """
        if len(texts) > self._config.max_batch_size:
            return await self._inference.run(admission, lambda: self._engine.embed(texts))
        pending = _Pending(texts, token_counts, admission)
        try:
            result = await self._collect(pending)
        except BaseException:
            if not pending.handed:
                pending.gone = True
                self._gate.release(admission.lease, ran=False)
            raise
        if isinstance(result, BaseException):
            raise result
        return result

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.02, max_concurrent_batches=1,
                 batch_size_fn=_inputs)
    async def _collect(self, pendings: list[_Pending]) -> list[Any]:
        """Ray Serve calls this with the collected requests; returns, per request, its
        ``(rows, thread_wait_s)`` or the exception its caller raises."""
        results: list[Any] = [None] * len(pendings)
        live = [i for i, p in enumerate(pendings) if not p.gone]
        for i in live:  # before any await: from here on the passes own these leases
            pendings[i].handed = True
        members = [BatchMember(len(pendings[i].texts), max(pendings[i].token_counts),
                               pendings[i].admission.lease.nbytes) for i in live]
        groups = [[live[j] for j in group]
                  for group in form_batches(members, self._price, self._config.max_batch_size)]

        async def run(group: list[int]) -> None:
            texts = [text for i in group for text in pendings[i].texts]
            try:
                rows, thread_wait_s = await self._inference.run(
                    [pendings[i].admission for i in group], lambda: self._engine.embed(texts))
            except Exception as exc:  # each member's caller raises it
                for i in group:
                    results[i] = exc
                return
            start = 0
            for i in group:
                end = start + len(pendings[i].texts)
                results[i] = (rows[start:end], thread_wait_s)
                start = end

        await asyncio.gather(*(run(group) for group in groups))
        return results

    def _price(self, inputs: int, padded_tokens: int) -> int:
        return self._policy.units(self._cost_model.request_bytes(inputs, padded_tokens, 0))
