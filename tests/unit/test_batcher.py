"""The pass batcher on real parts: the replica's inference thread, the fake engine on a
simulated device and the admission controller (no Ray).

Checked: a pass is as large as the backlog that waited while the thread was busy; every pass
holds at most what its members leased (the fake engine's memory is exact, and the thread
observes measured / leased per pass); every lease is released exactly once whatever the
callers do (hypothesis: random sizes, arrivals and cancellations at random points); closing
the batcher refuses what still waits with 503 ``draining``. Completions run here as whole
passes (``batching.continuous: false``, also what a model without decode steps gets);
continuous batching has its own tests (``test_decode_loop.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.engines.fake import FakeEngine
from deployments.replica.parts import Replica as ReplicaParts
from deployments.replica.parts import ReplicaIdentity
from serve_app.admission.ticket import Ticket
from serve_app.config import parse_args
from serve_app.errors import OverloadedError
from serve_app.kinds import build_request
from serve_app.memory.cost_model import Shape
from serve_app.memory.simulated import SimulatedDevice, SimulatedDeviceProbe
from serve_app.metrics import ProcessMetrics
from serve_app.pricing import priced_tokens
from serve_app.request import GenerationOutput, GenerationParams, InferenceRequest
from tests.unit.conftest import assert_idle

PER_TOKEN_BYTES = 1000
PAD_TO = 16
MAX_INPUT_TOKENS = 64  # also the fake engine's context (max_seq_tokens)
MAX_TOKENS = 62  # limits.max_tokens
LABELS = {"deployment": "ModelServer", "replica": "test", "model": ""}


def replica_args(max_batch_size: int = 8, max_wait_ms: float = 0.0,
                 max_queue_wait_s: float = 60.0, continuous: bool = False,
                 inference_timeout_s: float = 30.0) -> Any:
    return parse_args({
        "admission": {"max_queue_len": 256, "max_queue_wait_s": max_queue_wait_s,
                      "inference_timeout_s": inference_timeout_s},
        "batching": {"max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms,
                     "pad_to_multiple_of": PAD_TO, "continuous": continuous},
        "limits": {"max_input_tokens": MAX_INPUT_TOKENS, "max_tokens": MAX_TOKENS}})


class Replica:
    """A real model replica's parts (:class:`deployments.replica.parts.Replica`) without Ray: one
    inference thread, the fake engine (exact bytes per token; ``sleep`` is its inference
    time), the gate, the batcher and the request lifecycle."""

    def __init__(self, budget_bytes: int, max_batch_size: int, max_wait_ms: float = 0.0,
                 sleep=time.sleep, latency_per_token_s: float = 0.0,
                 max_queue_wait_s: float = 60.0, continuous: bool = False,
                 inference_timeout_s: float = 30.0) -> None:
        self.device = SimulatedDevice(capacity_bytes=budget_bytes)
        self.engine = FakeEngine(self.device, weights_bytes=0, bytes_per_token=PER_TOKEN_BYTES,
                                 latency_per_token_s=latency_per_token_s, sleep=sleep,
                                 max_seq_tokens=MAX_INPUT_TOKENS)
        self.args = replica_args(max_batch_size, max_wait_ms, max_queue_wait_s, continuous,
                                 inference_timeout_s)
        self.metrics = ProcessMetrics(LABELS["deployment"], LABELS["replica"], use_ray=False)
        self.executor = ThreadPoolExecutor(max_workers=1)
        self.parts = ReplicaParts(self.engine, SimulatedDeviceProbe(self.device),
                                  self.engine.costs, budget_bytes, self.args, self.executor,
                                  self.metrics, ReplicaIdentity("test"))
        self.gate, self.batcher = self.parts.gate, self.parts.batcher
        self.inference = self.parts.thread

    def request(self, kind: str, texts: list[str], params: GenerationParams | None = None,
                stream: bool = False) -> InferenceRequest:
        """What the ingress hands the replica: tokenized, validated, priced."""
        return build_request(kind, self.engine.front.tokenize(texts), params, stream,
                             self.args, self.engine.max_seq_tokens)

    async def embed(self, texts: list[str]) -> np.ndarray:
        """What ``ModelServer.infer`` does with an embeddings request: price, lease, batch."""
        rows, _ = await self.embed_and_wait(texts)
        return rows

    async def embed_and_wait(self, texts: list[str]) -> tuple[np.ndarray, float]:
        """:meth:`embed`, and the request's whole queue wait (``X-Queue-Wait-Ms``)."""
        result = await self.parts.lifecycle.infer(self.request("embed", texts))
        return result.output.embeddings, result.admitted.queue_wait_s

    async def complete(self, prompt: str, params: GenerationParams) -> GenerationOutput:
        """What ``ModelServer.infer`` does with a batchable completion."""
        result = await self.parts.lifecycle.infer(self.request("generate", [prompt], params))
        return result.output

    async def settle(self) -> None:
        """Wait until the thread has finished all it was given and its callbacks ran."""
        await asyncio.get_running_loop().run_in_executor(self.executor, lambda: None)
        for _ in range(3):
            await asyncio.sleep(0)

    def passes_within_leases(self) -> tuple[float, float]:
        """(passes observed, passes whose measured peak was <= their leased bytes)."""
        name = "vramgate_request_measured_over_estimated"
        sample = self.metrics.registry.get_sample_value
        return (sample(f"{name}_count", LABELS) or 0.0,
                sample(f"{name}_bucket", {**LABELS, "le": "1.0"}) or 0.0)

    def close(self) -> None:
        self.parts.close()
        self.executor.shutdown(wait=True)
        self.engine.close()


def words(n: int, tag: int) -> str:
    return " ".join(f"w{tag}x{i}" for i in range(n))


class Gate:
    """An inference that blocks until released: ``sleep`` for the fake engine."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, seconds: float) -> None:
        self.entered.set()
        assert self.release.wait(10), "the test never released the inference"


async def hold_the_thread(replica: Replica, gate: Gate) -> asyncio.Task:
    """Start a one-input pass that holds the inference thread until ``gate.release``."""
    first = asyncio.create_task(replica.embed([words(3, 0)]))
    await asyncio.to_thread(gate.entered.wait, 10)
    return first


@contextlib.asynccontextmanager
async def held_replica(**options: Any) -> AsyncIterator[tuple[Replica, Gate, asyncio.Task]]:
    """A :class:`Replica` (``options``) whose inference thread a first one-input pass holds
    until ``gate.release``; yields ``(replica, gate, first pass)``, and releases the thread
    and closes the replica on the way out, whatever the test did."""
    gate = Gate()
    replica = Replica(sleep=gate, **options)
    try:
        yield replica, gate, await hold_the_thread(replica, gate)
    finally:
        gate.release.set()
        replica.close()


def reference_engine() -> FakeEngine:
    """The fake engine on a device too large to fill: what each request gives alone."""
    return FakeEngine(SimulatedDevice(1 << 40), weights_bytes=0, bytes_per_token=1,
                      max_seq_tokens=MAX_INPUT_TOKENS)


async def let_them_reach_the_batcher() -> None:
    """Let tasks just created pass the gate (leases at once) into the batcher's queue."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_requests_waiting_while_a_pass_runs_form_the_next_pass_together() -> None:
    async with held_replica(budget_bytes=10**6, max_batch_size=8) as (replica, gate, first):
        backlog = [asyncio.create_task(replica.embed([words(3 + k, k)])) for k in range(1, 4)]
        await let_them_reach_the_batcher()
        assert replica.batcher.passes == 1  # the first, still running
        gate.release.set()
        rows = await asyncio.gather(first, *backlog)
        await replica.settle()
        assert replica.batcher.passes == 2  # the three waiting requests ran as one pass
        assert replica.inference.total == 2
        assert [r.shape for r in rows] == [(1, replica.engine.dimensions)] * 4
        assert replica.passes_within_leases() == (2.0, 2.0)
        assert_idle(replica.gate.queue)


async def test_a_full_pass_waits_on_the_thread_behind_the_running_one() -> None:
    # A backlog of a full pass is handed to the thread while the last pass still runs, so
    # that the device goes from pass to pass; short of a full pass nothing more is formed.
    async with held_replica(budget_bytes=10**6, max_batch_size=2) as (replica, gate, first):
        full = [asyncio.create_task(replica.embed([words(3 + k, k)])) for k in (1, 2)]
        await let_them_reach_the_batcher()
        assert replica.batcher.passes == 2  # the running one and the full one behind it
        assert replica.inference.running == 2
        lone = asyncio.create_task(replica.embed([words(6, 3)]))
        await let_them_reach_the_batcher()
        assert replica.batcher.passes == 2  # one pass at most waits on the thread
        gate.release.set()
        rows = await asyncio.gather(first, *full, lone)
        await replica.settle()
        assert replica.batcher.passes == 3
        assert [r.shape for r in rows] == [(1, replica.engine.dimensions)] * 4
        assert replica.passes_within_leases() == (3.0, 3.0)
        assert_idle(replica.gate.queue)


async def test_completions_share_a_pass_with_their_own_kind_and_sampling() -> None:
    greedy, longer = GenerationParams(max_tokens=4, temperature=0.0), \
        GenerationParams(max_tokens=9, temperature=0.0)
    sampled = GenerationParams(max_tokens=4, temperature=0.8)
    requests = [("the quick brown fox", greedy), ("a b c", greedy), ("one two", longer),
                ("p q", sampled), ("x y z w", greedy)]
    async with held_replica(budget_bytes=10**6, max_batch_size=8) as (replica, gate, first):
        waiting = [asyncio.create_task(replica.complete(p, params)) for p, params in requests]
        await let_them_reach_the_batcher()
        gate.release.set()
        outputs = await asyncio.gather(*waiting)
        await first
        await replica.settle()
        # embed | the four greedy prompts (max_tokens 4 and 9) | the sampled one
        assert replica.batcher.passes == 3 and replica.inference.total == 3
        reference = reference_engine()
        greedy_requests = [0, 1, 2, 4]
        assert [outputs[i] for i in greedy_requests] == \
            [reference.generate(*requests[i]) for i in greedy_requests]
        assert [o.completion_tokens for o in outputs] == [4, 4, 9, 4, 4]
        assert replica.passes_within_leases() == (3.0, 3.0)
        assert_idle(replica.gate.queue)


async def test_completions_longer_together_than_the_context_run_apart() -> None:
    # Leases of 10 x their price (as after an OOM correction) would let these two share a
    # pass, but a 50-token prompt left-padded beside one asking for 40 new tokens is 90
    # tokens: more than the model's 64.
    requests = [(words(48, 1), GenerationParams(max_tokens=4, temperature=0.0)),
                (words(3, 2), GenerationParams(max_tokens=40, temperature=0.0))]
    async with held_replica(budget_bytes=10**7, max_batch_size=8) as (replica, gate, first):
        tickets = []
        for prompt, params in requests:
            request = replica.request("generate", [prompt], params)
            admission = await replica.gate.acquire(
                10 * replica.engine.request_bytes(1, request.token_counts[0],
                                                  params.max_tokens))
            tickets.append(Ticket(request, admission,
                                  lambda t, ran: replica.gate.release(t.lease, ran=ran)))
        waiting = [asyncio.create_task(replica.batcher.submit(t)) for t in tickets]
        await let_them_reach_the_batcher()
        gate.release.set()
        outputs = await asyncio.gather(*waiting)
        for ticket in tickets:
            ticket.caller_done()
        await first
        await replica.settle()
        assert replica.batcher.passes == 3  # embed | one | the other
        reference = reference_engine()
        assert outputs == [reference.generate(*request) for request in requests]
        assert_idle(replica.gate.queue)


async def test_waiting_for_a_pass_is_queue_wait_and_bounded_by_max_queue_wait_s() -> None:
    held_s = 0.2  # real seconds the first pass holds the thread (the bound is wall-clock)
    gate = Gate()
    replica = Replica(budget_bytes=10**6, max_batch_size=8, sleep=gate, max_queue_wait_s=0.1)
    slow = Replica(budget_bytes=10**6, max_batch_size=8, sleep=Gate(), max_queue_wait_s=60)
    try:
        first = await hold_the_thread(replica, gate)
        late = asyncio.create_task(replica.embed([words(3, 1)]))
        await asyncio.sleep(held_s)
        gate.release.set()
        await first
        with pytest.raises(OverloadedError) as refused:
            await late
        assert refused.value.code == "queue_timeout" and refused.value.retry_after_s >= 1
        await replica.settle()
        assert replica.inference.total == 1  # the late request never ran
        assert_idle(replica.gate.queue)

        slow_gate = slow.engine.sleep
        first = await hold_the_thread(slow, slow_gate)
        late = asyncio.create_task(slow.embed_and_wait([words(3, 1)]))
        await asyncio.sleep(held_s)
        slow_gate.release.set()
        await first
        _, waited_s = await late
        assert waited_s >= held_s  # reported as queue wait (X-Queue-Wait-Ms)
        await slow.settle()
        assert_idle(slow.gate.queue)
    finally:
        gate.release.set()
        slow.engine.sleep.release.set()
        replica.close()
        slow.close()


def decisions(replica: Replica, outcome: str, reason: str) -> float:
    return replica.metrics.registry.get_sample_value(
        "vramgate_admission_decisions_total",
        {**LABELS, "outcome": outcome, "reason": reason}) or 0.0


@pytest.mark.parametrize("max_batch_size", [2, 8], ids=["on-the-thread", "in-the-batcher"])
async def test_a_member_out_of_time_is_refused_alone_and_its_pass_runs_for_the_others(
        max_batch_size: int, caplog: pytest.LogCaptureFixture) -> None:
    # Two requests in one pass behind a held thread, one with 0.1 s to wait (the client's
    # limit), one with 60 s. A full pass (2) waits on the thread, where the first is refused
    # at its bound; a short one (8) waits in the batcher and is formed when the thread
    # frees, when the first is already out of time. Either way only the first is refused,
    # and the other is answered: before, the shortest bound refused the whole pass, and
    # each member was recorded as a miss of the whole bound.
    async with held_replica(budget_bytes=10**6, max_batch_size=max_batch_size) as (
            replica, gate, first):
        hurried = replace(replica.request("embed", [words(3, 1)]), wait_limit_s=0.1)
        calm = replica.request("embed", [words(4, 2)])
        caplog.set_level(logging.INFO, logger="ray.serve")
        late = asyncio.create_task(replica.parts.lifecycle.infer(hurried))
        fresh = asyncio.create_task(replica.parts.lifecycle.infer(calm))
        await let_them_reach_the_batcher()
        assert replica.batcher.passes == (2 if max_batch_size == 2 else 1)
        if max_batch_size == 2:  # refused at its bound, while the thread is still held
            await asyncio.wait({late}, timeout=5)
            assert late.done() and not fresh.done()
        else:
            await asyncio.sleep(0.15)  # past the first's bound (wall clock)
        gate.release.set()
        with pytest.raises(OverloadedError) as refused:
            await late
        assert refused.value.code == "queue_timeout"
        answer = await fresh
        await first
        await replica.settle()
        reference = reference_engine()
        assert np.allclose(answer.output.embeddings, reference.embed([words(4, 2)]))
        assert replica.batcher.passes == 2 and replica.inference.total == 2
        assert decisions(replica, "rejected", "queue_timeout") == 1.0
        # The refused member rode along in the pass unanswered: logged as refused, and its
        # time on the thread not counted (the held first request's pass and the answered one).
        finished = [record.outcome for record in caplog.records
                    if getattr(record, "event", "") == "finished"]
        assert sorted(finished) == ["ok", "ok", "queue_timeout"]
        assert replica.metrics.registry.get_sample_value(
            "vramgate_inference_seconds_count", LABELS) == 2.0
        assert_idle(replica.gate.queue)


async def test_a_lone_request_on_an_idle_thread_runs_at_once_and_alone() -> None:
    replica = Replica(budget_bytes=10**6, max_batch_size=8, max_wait_ms=0)
    try:
        await replica.embed([words(4, 0)])
        await replica.embed([words(4, 1)])
        await replica.settle()
        assert replica.batcher.passes == 2
        assert_idle(replica.gate.queue)
    finally:
        replica.close()


async def test_a_wait_for_company_ends_when_the_batch_is_full() -> None:
    replica = Replica(budget_bytes=10**6, max_batch_size=2, max_wait_ms=60_000)
    try:
        rows = await asyncio.wait_for(asyncio.gather(
            replica.embed([words(4, 0)]), replica.embed([words(4, 1)])), timeout=30)
        await replica.settle()
        assert replica.batcher.passes == 1 and len(rows) == 2
        assert_idle(replica.gate.queue)
    finally:
        replica.close()


async def test_requests_of_another_kind_left_waiting_still_run_after_a_wait_for_company(
        ) -> None:
    # The former clears its "arrived" event while it waits for company; a pass then takes
    # only the embeddings, and the completion left behind must still form the next pass
    # (it once waited for the next arrival, which might never come).
    async with held_replica(budget_bytes=10**6, max_batch_size=8,
                            max_wait_ms=20) as (replica, gate, first):
        embedded = asyncio.create_task(replica.embed([words(3, 1)]))
        completed = asyncio.create_task(
            replica.complete("a b c", GenerationParams(max_tokens=3, temperature=0.0)))
        await let_them_reach_the_batcher()
        gate.release.set()
        await asyncio.wait_for(asyncio.gather(first, embedded, completed), timeout=10)
        await replica.settle()
        assert replica.batcher.passes == 3 and completed.result().completion_tokens == 3
        assert_idle(replica.gate.queue)


async def test_closing_refuses_waiting_requests_and_returns_their_leases() -> None:
    async with held_replica(budget_bytes=10**6, max_batch_size=8) as (replica, gate, running):
        waiting = asyncio.create_task(replica.embed([words(3, 1)]))
        await let_them_reach_the_batcher()
        replica.batcher.close()
        gate.release.set()
        outcomes = await asyncio.gather(running, waiting, return_exceptions=True)
        await replica.settle()
        assert all(isinstance(o, OverloadedError) and o.code == "draining" for o in outcomes)
        assert replica.inference.total == 1  # the running pass finished on the thread
        assert_idle(replica.gate.queue)
        assert replica.device.allocated_bytes == 0


# --- random traffic --------------------------------------------------------------------------

REQUEST = st.tuples(
    st.one_of(st.lists(st.integers(1, 40), min_size=1, max_size=3),  # embed: words per input
              # a greedy completion: prompt words, then a share of the context left for
              # max_tokens (prompt + max_tokens <= 64, as the replica requires)
              st.tuples(st.integers(1, 50), st.floats(0.0, 1.0))),
    st.one_of(st.none(), st.integers(0, 12)),  # cancel after this many loop turns, or never
    st.integers(0, 2))  # loop turns before the next request arrives


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(REQUEST, min_size=1, max_size=24), st.integers(1, 8), st.sampled_from([0, 2]),
       st.integers(3, 12))
def test_random_traffic_keeps_every_pass_within_its_leases_and_leaks_nothing(
        requests, max_batch_size, max_wait_ms, budget_units) -> None:
    # One unit = the price of one input padded to 64 tokens: 1..4 of the largest at a time.
    budget_bytes = budget_units * MAX_INPUT_TOKENS * PER_TOKEN_BYTES
    asyncio.run(_random_traffic(requests, max_batch_size, max_wait_ms, budget_bytes))


async def _random_traffic(requests, max_batch_size: int, max_wait_ms: float,
                          budget_bytes: int) -> None:
    replica = Replica(budget_bytes, max_batch_size, max_wait_ms, latency_per_token_s=2e-6)
    reference = reference_engine()

    async def cancel_later(task: asyncio.Task, turns: int) -> None:
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()

    try:
        tasks, expected, cancellers = [], [], []
        for k, (shape, cancel_after, gap) in enumerate(requests):
            if isinstance(shape, list):
                texts = [words(min(n, MAX_INPUT_TOKENS - 2), 100 * k + i)
                         for i, n in enumerate(shape)]
                tasks.append(asyncio.create_task(replica.embed(texts)))
                expected.append(partial(reference.embed, texts))
            else:
                prompt_words, share = shape
                room = MAX_INPUT_TOKENS - (prompt_words + 2)
                params = GenerationParams(max_tokens=max(1, round(share * room)),
                                          temperature=0.0)
                tasks.append(asyncio.create_task(replica.complete(words(prompt_words, k),
                                                                  params)))
                expected.append(partial(reference.generate, words(prompt_words, k), params))
            if cancel_after is not None:
                cancellers.append(asyncio.create_task(cancel_later(tasks[-1], cancel_after)))
            for _ in range(gap):
                await asyncio.sleep(0)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*cancellers)
        await replica.settle()

        for outcome, reference_output in zip(outcomes, expected, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                continue
            assert not isinstance(outcome, BaseException), repr(outcome)
            if isinstance(outcome, GenerationOutput):
                assert outcome == reference_output()
            else:
                np.testing.assert_array_equal(outcome, reference_output())
        assert_idle(replica.gate.queue)
        assert replica.device.allocated_bytes == 0 and replica.device.oom_count == 0
        observed, within = replica.passes_within_leases()
        assert observed == replica.inference.total and within == observed
        assert replica.inference.total <= replica.batcher.passes <= len(requests)
    finally:
        replica.close()


def test_batchable_requests_are_priced_padded_to_the_next_multiple() -> None:
    assert [priced_tokens(counts, True, PAD_TO, MAX_INPUT_TOKENS)
            for counts in ([3, 14], [16], [17], [61], [64])] == [16, 16, 32, 64, 64]
    assert priced_tokens([3, 14], False, PAD_TO, MAX_INPUT_TOKENS) == 14  # runs alone
    with pytest.raises(ValueError):
        priced_tokens([], True, PAD_TO, MAX_INPUT_TOKENS)
    # A completion's max_tokens is padded too, capped at limits.max_tokens; an embedding
    # generates nothing; a completion that cannot be batched (a stop string) is priced as it
    # is. (build_request: the ingress's one rule.)
    args = replica_args()

    def shape(kind: str, counts: list[int], params: GenerationParams | None = None) -> Shape:
        ids = [[1] * n for n in counts]
        return build_request(kind, ids, params, False, args, MAX_INPUT_TOKENS).shape

    greedy = GenerationParams(max_tokens=30, temperature=0.0)
    assert shape("generate", [10], greedy) == Shape(1, 16, 32)
    assert shape("generate", [2], GenerationParams(max_tokens=61, temperature=0.0)) == \
        Shape(1, 16, 62)
    stopped = GenerationParams(max_tokens=30, temperature=0.0, stop=("x",))
    assert shape("generate", [10], stopped) == Shape(1, 10, 30)
    # On continuous batching every completion shares steps: priced padded to whole blocks.
    continuous = replica_args(continuous=True)
    assert build_request("generate", [[1] * 10], stopped, True, continuous,
                         MAX_INPUT_TOKENS).shape == Shape(1, 16, 32)
    assert shape("embed", [3, 14]) == Shape(2, 16, 0)
