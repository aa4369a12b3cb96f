"""Token-level continuous batching (deployments/replica/decode_loop.py) on real parts: the replica's
inference thread, the admission gate and the fake engine's paged KV cache on a simulated
device exactly the budget's size (any byte held beyond the leases is an OOM), no Ray.

Checked: each completion gives what it gives alone (greedy, seeded, stop strings,
streamed); a short completion returns while a long one runs; a stream whose consumer leaves
is out of the engine within a step, its KV cache and lease freed; an OOM in a step fails
that step's sequences with 503 ``oom`` and the replica serves on; under random traffic with
cancellations no lease or KV block is left behind and nothing OOMs (hypothesis).
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.admission.ticket import Ticket
from serve_app.errors import InferenceTimeoutError, OverloadedError
from serve_app.pricing import shape_bytes
from serve_app.request import GenerationOutput, GenerationParams
from serve_app.stream_events import Queued, TextPiece
from tests.unit.conftest import assert_idle, completion_of
from tests.unit.test_batcher import PER_TOKEN_BYTES, Replica, reference_engine, words

BUDGET_BYTES = 64 * 64 * PER_TOKEN_BYTES  # 64 sequences of the longest shape


def continuous_replica(budget_bytes: int = BUDGET_BYTES, max_batch_size: int = 8,
                       **options) -> Replica:
    return Replica(budget_bytes, max_batch_size, continuous=True, **options)


async def complete(replica: Replica, prompt: str, params: GenerationParams,
                   stream: bool = False) -> GenerationOutput:
    """A completion as the ingress sends it (:func:`completion_of`)."""
    request = replica.request("generate", [prompt], params, stream)
    return await completion_of(replica.parts.lifecycle, request)


def mixed_requests(count: int, seed: int = 0) -> list[tuple[str, GenerationParams, bool]]:
    """``count`` completions: max_tokens 1-40, greedy or seeded, some with a stop string
    (a word the reference generates, so that it hits), some streamed."""
    rng, reference, out = random.Random(seed), reference_engine(), []
    for i in range(count):
        prompt = words(rng.randint(1, 12), i)
        params = GenerationParams(max_tokens=rng.randint(1, 40),
                                  temperature=rng.choice([0.0, 0.8]),
                                  seed=rng.randint(0, 99))
        if rng.random() < 0.3:
            alone = reference.generate(prompt, params).text.split()
            if len(alone) > 2:
                params = GenerationParams(params.max_tokens, params.temperature, 1.0,
                                          params.seed, (alone[len(alone) // 2],))
        out.append((prompt, params, rng.random() < 0.5))
    return out


async def test_concurrent_completions_give_what_each_gives_alone() -> None:
    requests = mixed_requests(16)
    reference = reference_engine()
    replica = continuous_replica(max_batch_size=16)
    try:
        outputs = await asyncio.gather(*(complete(replica, prompt, params, stream)
                                         for prompt, params, stream in requests))
        steps = replica.parts.decode.steps
        assert_idle(replica.gate.queue)
        assert replica.device.allocated_bytes == 0
    finally:
        replica.close()
    for (prompt, params, _), output in zip(requests, outputs, strict=True):
        assert output == reference.generate(prompt, params)
    # They ran together: about as many steps as the longest completion has tokens (those
    # that arrived while the first step ran joined the second).
    assert steps <= max(params.max_tokens for _, params, _ in requests) + 2


async def test_a_short_completion_returns_while_a_long_one_runs() -> None:
    # Steps of a few milliseconds (2 ms a token): the short one's admission, well under
    # that, reaches the next step.
    replica = continuous_replica(latency_per_token_s=0.002)
    try:
        long = asyncio.create_task(complete(replica, words(4, 1), GenerationParams(
            max_tokens=50, temperature=0.0)))
        while replica.parts.decode.steps < 3 and not long.done():  # the long one decodes
            await asyncio.sleep(0.001)
        joined_after = replica.parts.decode.steps
        short = await complete(replica, words(4, 2), GenerationParams(max_tokens=4,
                                                                      temperature=0.0))
        steps_when_short_returned = replica.parts.decode.steps
        assert not long.done()
        assert (await long).completion_tokens == 50
    finally:
        replica.close()
    assert short.completion_tokens == 4
    # It joined the step after it arrived and took its 4 steps there.
    assert steps_when_short_returned <= joined_after + 1 + 4


async def test_a_consumer_that_leaves_mid_stream_is_out_of_the_engine_within_a_step() -> None:
    # Steps of a few milliseconds, as on a device: the cancellation reaches the loop within
    # one event-loop turn, well inside the running step.
    replica = continuous_replica(latency_per_token_s=0.002)
    try:
        request = replica.request("generate", [words(4, 3)],
                                  GenerationParams(max_tokens=50, temperature=0.0), True)
        stream = replica.parts.lifecycle.infer_stream(request)
        pieces = 0
        async for item in stream:
            pieces += isinstance(item, TextPiece)
            if pieces == 2:
                break
        await stream.aclose()
        left_at = replica.parts.decode.steps
        for _ in range(100):  # the loop drops it at the next step
            if replica.gate.budget.reserved_bytes == 0:
                break
            await asyncio.sleep(0.001)
        assert replica.parts.decode.steps <= left_at + 1
        assert_idle(replica.gate.queue)
        assert replica.device.allocated_bytes == 0  # its KV blocks are free
        assert replica.parts.decode.figures()["running_sequences"] == 0
    finally:
        replica.close()


async def test_the_next_step_is_on_the_thread_before_a_steps_texts_are_handed_out() -> None:
    # While the event loop hands out one step's texts (and metrics, finished results), the
    # next step already runs: the device does not idle through that bookkeeping.
    replica = continuous_replica()
    try:
        request = replica.request("generate", [words(4, 5)],
                                  GenerationParams(max_tokens=6, temperature=0.0))
        admission = await replica.gate.acquire(
            shape_bytes(replica.parts.cost_model, request.shape))
        ticket = Ticket(request, admission,
                        lambda t, ran: replica.gate.release(t.lease, ran=ran))
        on_thread: list[int] = []
        output = await replica.parts.decode.generate(
            ticket, on_text=lambda _: on_thread.append(replica.inference.running))
        ticket.caller_done()
        assert output.completion_tokens == 6
        assert on_thread[:-1] == [1] * (len(on_thread) - 1)  # the next step, on the thread
        assert on_thread[-1] == 0  # after the last step nothing runs or waits
        assert_idle(replica.gate.queue)
    finally:
        replica.close()


async def test_an_oom_in_a_step_fails_its_sequences_and_the_replica_serves_on() -> None:
    replica = continuous_replica()
    try:
        params = GenerationParams(max_tokens=40, temperature=0.0)
        running = [asyncio.create_task(complete(replica, words(3, i), params))
                   for i in range(3)]
        while replica.parts.decode.steps < 2 and not any(t.done() for t in running):
            await asyncio.sleep(0.001)
        replica.engine.oom_probability = 1.0
        results = await asyncio.gather(*running, return_exceptions=True)
        replica.engine.oom_probability = 0.0
        assert all(isinstance(r, OverloadedError) and r.code == "oom" for r in results)
        assert replica.device.allocated_bytes == 0
        assert_idle(replica.gate.queue)
        after = await complete(replica, words(3, 9), params)
        assert after == reference_engine().generate(words(3, 9), params)
    finally:
        replica.close()


async def test_a_stream_waiting_to_join_hears_its_place_then_its_refusal() -> None:
    # One sequence at a time, steps of ~10 ms: a second stream waits to join past its
    # 0.2 s bound while a 50-token completion runs. As a stream waiting for memory does, it
    # hears its place at once (the route starts its 200 with it); the refusal then ends it.
    replica = continuous_replica(max_batch_size=1, latency_per_token_s=0.01,
                                 max_queue_wait_s=0.2)
    try:
        long = asyncio.create_task(complete(replica, words(3, 1), GenerationParams(
            max_tokens=50, temperature=0.0)))
        while replica.parts.decode.steps < 1:
            await asyncio.sleep(0.001)
        request = replica.request("generate", [words(3, 2)],
                                  GenerationParams(max_tokens=4, temperature=0.0), True)
        stream = replica.parts.lifecycle.infer_stream(request)
        assert await stream.__anext__() == Queued(position=0, eta_ms=None)
        with pytest.raises(OverloadedError) as refused:
            await stream.__anext__()
        assert refused.value.code == "queue_timeout"
        assert refused.value.retry_after_s >= 1
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
    finally:
        replica.close()


async def test_the_inference_timeout_bounds_a_stall_not_a_long_completion() -> None:
    # 0.3 s without a token is a stall (504); 50 tokens of ~7 ms each take longer in all
    # and succeed.
    replica = continuous_replica(latency_per_token_s=0.007, inference_timeout_s=0.3)
    try:
        params = GenerationParams(max_tokens=50, temperature=0.0)
        started = asyncio.get_running_loop().time()
        output = await complete(replica, words(3, 1), params)
        assert asyncio.get_running_loop().time() - started > 0.3
        assert output.completion_tokens == 50
        replica.engine.hang_probability, replica.engine.hang_s = 1.0, 0.6
        with pytest.raises(InferenceTimeoutError):
            await complete(replica, words(3, 2), params)
        replica.engine.hang_probability = 0.0
        await replica.settle()  # the hung step returns; the sequence leaves at the next
        for _ in range(200):
            if replica.gate.budget.reserved_bytes == 0:
                break
            await asyncio.sleep(0.005)
        assert_idle(replica.gate.queue)
        assert replica.device.allocated_bytes == 0
    finally:
        replica.close()


@st.composite
def traffic(draw):
    """Completions with random sizes and streams, some cancelled after a few steps."""
    return draw(st.lists(st.tuples(
        st.integers(1, 30),  # prompt words (+ BOS, EOS + max_tokens within the 64 context)
        st.integers(1, 30),  # max_tokens
        st.booleans(),  # streamed
        st.one_of(st.none(), st.integers(0, 6))),  # cancelled after this many loop turns
        min_size=1, max_size=14))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(traffic())
def test_random_traffic_with_cancellations_leaves_nothing_behind(requests) -> None:
    asyncio.run(_random_traffic(requests))


async def _random_traffic(requests) -> None:
    # Room for about four of the largest completions: most wait for a lease or to join.
    budget = 4 * (64 + 32) * PER_TOKEN_BYTES
    replica = continuous_replica(budget, max_batch_size=3)
    step = replica.engine.decode_step
    over: list[tuple[int, int]] = []

    def checked_step(joining, leaving):  # wraps the engine's own step: no stand-in
        try:
            return step(joining, leaving)
        finally:
            reserved = replica.gate.budget.reserved_bytes
            if reserved > budget or replica.device.allocated_bytes > reserved:
                over.append((reserved, replica.device.allocated_bytes))

    replica.engine.decode_step = checked_step
    try:
        tasks = []
        for i, (prompt_words, max_tokens, stream, cancel_after) in enumerate(requests):
            params = GenerationParams(max_tokens=max_tokens, temperature=0.0)
            tasks.append((asyncio.create_task(complete(replica, words(prompt_words, i),
                                                       params, stream)), cancel_after))
        for turn in range(8):
            for task, cancel_after in tasks:
                if cancel_after == turn:
                    task.cancel()
            await asyncio.sleep(0.001)
        for task, _ in tasks:
            with contextlib.suppress(asyncio.CancelledError, OverloadedError):
                await task
        await replica.settle()
        for _ in range(50):
            if replica.gate.budget.reserved_bytes == 0:
                break
            await asyncio.sleep(0.001)
        assert_idle(replica.gate.queue)
        assert replica.device.allocated_bytes == 0, "KV blocks left behind"
        figures = replica.parts.decode.figures()
        assert figures["running_sequences"] == figures["waiting_sequences"] == 0
        assert over == [], "reserved > budget, or held > leased, after a step"
        assert replica.parts.health.oom_count == 0
    finally:
        replica.close()


async def test_status_counts_kv_blocks_of_running_sequences() -> None:
    replica = continuous_replica()
    try:
        task = asyncio.create_task(complete(replica, words(14, 5), GenerationParams(
            max_tokens=40, temperature=0.0)))
        while replica.parts.decode.steps < 2 and not task.done():
            await asyncio.sleep(0.001)
        figures = replica.parts.decode.figures()
        await task
    finally:
        replica.close()
    # 16 prompt tokens (14 words, BOS, EOS) + 40: 56 tokens leased = 4 blocks; after two
    # steps the cache holds 16 + 2 = 18 tokens = 2 blocks.
    assert (figures["blocks_leased"], figures["blocks_in_use"]) == (4, 2)
    assert figures["block_tokens"] == 16
    assert figures["block_bytes"] == 16 * PER_TOKEN_BYTES
    assert figures["blocks_total"] == BUDGET_BYTES // (16 * PER_TOKEN_BYTES)
