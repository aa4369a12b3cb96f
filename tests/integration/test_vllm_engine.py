"""The vLLM engine behind a real replica's gate, without Ray: the budget is the KV pool vLLM
allocated; a random mix of requests that finish, clients that leave and requests that time
out leaves nothing leased in vramgate and nothing running or waiting in vLLM; vLLM's engine
core killed makes every request a 503 ``draining`` and the health check fail.

One engine for the module (vLLM starts in about 25 s here), driven from one event loop in a
thread of its own: ``AsyncLLM`` binds its output handler to the loop of its first request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import build_tiny_causal_lm, require_vllm

require_vllm()

from deployments.replica.parts import Replica, ReplicaIdentity  # noqa: E402
from deployments.replica.profiling import MeasuredReplica, measure_replica  # noqa: E402
from serve_app.config import parse_args  # noqa: E402
from serve_app.kinds import build_request  # noqa: E402
from serve_app.memory.expected_output import (  # noqa: E402
    MIN_SAMPLES,
    ExpectedOutput,
    ExpectedOutputCostModel,
)
from serve_app.metrics import ProcessMetrics  # noqa: E402
from serve_app.request import GenerationParams  # noqa: E402
from serve_app.stream_events import Finished, StreamError, TextPiece  # noqa: E402

MAX_BATCH = 4


class Loop:
    """An event loop running in a thread of its own; :meth:`run` a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine, timeout_s: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def vllm_args(model_dir, inference_timeout_s: float = 60.0, kv_lease: str = "guaranteed",
              ) -> Any:
    return parse_args({
        "model": {"engine": "vllm", "path": str(model_dir), "name": "tiny-vllm",
                  "device": "cpu"},
        "deployment": {"num_gpus": 0},
        "limits": {"max_input_tokens": 32, "max_tokens": 96},
        "batching": {"max_batch_size": MAX_BATCH},
        "admission": {"max_queue_len": 256, "max_queue_wait_s": 120,
                      "inference_timeout_s": inference_timeout_s, "kv_lease": kv_lease}})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_causal_lm(tmp_path_factory.mktemp("vllm") / "tiny-llama",
                                hidden_size=128, num_heads=2, init_std=0.2)


@pytest.fixture(scope="module")
def measured(model_dir) -> Iterator[MeasuredReplica]:
    measured = measure_replica(vllm_args(model_dir))
    yield measured
    measured.engine.close()


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    loop = Loop()
    yield loop
    loop.close()


@contextlib.contextmanager
def replica_on(loop: Loop, measured: MeasuredReplica, args: Any) -> Iterator[Replica]:
    """A replica's parts around the module's engine, built on ``loop``."""
    executor = ThreadPoolExecutor(max_workers=1)

    async def build() -> Replica:
        return Replica(measured.engine, measured.probe, measured.cost_model,
                       measured.budget_bytes, args, executor,
                       ProcessMetrics("ModelServer", "test", use_ray=False),
                       ReplicaIdentity("test"))

    replica = loop.run(build())
    try:
        yield replica
    finally:
        replica.close()
        executor.shutdown(wait=True)


def request(replica: Replica, max_tokens: int, stream: bool = True) -> Any:
    ids = replica.engine.front.tokenize(["the quick brown fox jumps"])
    return build_request("generate", ids, GenerationParams(max_tokens=max_tokens,
                                                           temperature=0.0),
                         stream, replica.args, replica.engine.max_seq_tokens)


async def settled(replica: Replica, timeout_s: float = 10.0) -> dict[str, int]:
    """vLLM's figures once its last step has been reported with nothing left running or
    waiting (its stat loggers see a step after it ran), or the last seen after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        figures = replica.engine.kv_cache_status()
        if figures["running_sequences"] + figures["waiting_sequences"] == 0 \
                or time.monotonic() > deadline:
            return figures
        await asyncio.sleep(0.05)


def test_the_budget_is_the_pool_vllm_allocated(measured) -> None:
    pool = measured.engine.kv_pool()
    # max_model_len 128 (32 + 96): one block of 128 tokens a sequence, 4 sequences
    assert (pool.block_tokens, pool.blocks) == (128, MAX_BATCH)
    assert pool.block_bytes == 128 * 2 * 2 * 2 * 64 * 4  # tokens x K,V x layers x heads x dim
    assert measured.budget_bytes == pool.pool_bytes == MAX_BATCH * pool.block_bytes
    assert measured.max_request_bytes == pool.block_bytes  # 32 + 96 tokens: one block
    assert measured.profile.points == () and measured.engine_class.profiled is False


ACTIONS = st.lists(st.tuples(st.sampled_from(["finish", "leave", "cancel"]),
                             st.integers(1, 96), st.booleans()), min_size=1, max_size=12)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(actions=ACTIONS)
def test_a_random_mix_with_clients_leaving_leaves_nothing_leased_or_running(
        loop, measured, actions) -> None:
    with replica_on(loop, measured, vllm_args("unused")) as replica:
        budget = replica.gate.budget

        async def one(action: str, max_tokens: int, stream: bool) -> str:
            if not stream and action == "finish":
                result = await replica.answer(request(replica, max_tokens, stream=False))
                return "done" if result.output.completion_tokens >= 1 else "empty"
            items = replica.answer_stream(request(replica, max_tokens))
            async with contextlib.aclosing(items):
                async for item in items:
                    assert budget.reserved_bytes <= budget.budget_bytes
                    if isinstance(item, TextPiece) and action == "leave":
                        return "left"  # the client leaves: the stream is closed here
                    if action == "cancel":
                        raise asyncio.CancelledError  # the request's task cancelled
            return "done"

        async def mix() -> list:
            return await asyncio.gather(*(one(*action) for action in actions),
                                        return_exceptions=True)

        ends = loop.run(mix())
        figures = loop.run(settled(replica))
    assert all(end in ("done", "left", "empty") or isinstance(end, asyncio.CancelledError)
               for end in ends), ends
    assert (budget.reserved_bytes, budget.active_leases) == (0, 0)
    assert (figures["running_sequences"], figures["waiting_sequences"]) == (0, 0)
    assert figures["preempted_sequences"] == 0
    assert measured.engine._request_ids == {}


def test_a_request_past_the_inference_timeout_is_a_504_and_aborted(loop, measured) -> None:
    with replica_on(loop, measured, vllm_args("unused", inference_timeout_s=0.001)) as replica:
        items = loop.run(_collect(replica.answer_stream(request(replica, 96))))
        figures = loop.run(settled(replica))
    assert isinstance(items[-1], StreamError) and items[-1].error.status_code == 504
    assert (replica.gate.budget.reserved_bytes, replica.gate.budget.active_leases) == (0, 0)
    assert (figures["running_sequences"], figures["waiting_sequences"]) == (0, 0)


def test_expected_leases_learn_from_the_completions_vllm_finished(loop, measured) -> None:
    """Under ``admission.kv_lease: expected`` each completion vLLM finishes feeds its
    ``max_tokens`` range; once ``MIN_SAMPLES`` did, the replica publishes their quantile and
    prices by it (the ingress reads it from ``/v1/status``'s cost model)."""
    expected = ExpectedOutput(0.95)
    leased = dataclasses.replace(measured, cost_model=ExpectedOutputCostModel(
        measured.engine.kv_pool().cost_model(), expected))
    with replica_on(loop, leased, vllm_args("unused", kv_lease="expected")) as replica:
        async def complete(max_tokens: int) -> int:
            result = await replica.answer(request(replica, max_tokens, stream=False))
            return result.output.completion_tokens

        async def all_of() -> list[int]:
            return await asyncio.gather(*(complete(33 + i) for i in range(MIN_SAMPLES)))

        lengths = loop.run(all_of())
        state = replica.state()
    quantile = sorted(lengths)[math.ceil(0.95 * MIN_SAMPLES) - 1]
    assert state.cost_model["expected_new_tokens"] == {"64": quantile}
    assert state.kv_cache["kv_lease"] == "expected"
    assert expected.tokens(64) == quantile and expected.tokens(128) == 128
    assert (replica.gate.budget.reserved_bytes, replica.gate.budget.active_leases) == (0, 0)


async def _collect(items) -> list:
    return [item async for item in items]


def test_a_dead_engine_core_is_503_draining_and_fails_the_health_check(loop, measured) -> None:
    """Last in the module: the engine does not come back."""
    with replica_on(loop, measured, vllm_args("unused")) as replica:
        replica.check_health()  # alive

        async def kill_while_running() -> list:
            first_piece = asyncio.Event()

            async def stream() -> list:
                items = []
                async for item in replica.answer_stream(request(replica, 96)):
                    items.append(item)
                    if isinstance(item, TextPiece):
                        first_piece.set()
                return items

            streams = [asyncio.ensure_future(stream()) for _ in range(4)]
            await first_piece.wait()
            for child in psutil.Process(os.getpid()).children(recursive=True):
                if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                    os.kill(child.pid, signal.SIGKILL)
            return await asyncio.gather(*streams)

        ends = loop.run(kill_while_running(), timeout_s=60)
        after = loop.run(_collect(replica.answer_stream(request(replica, 8))))
        with pytest.raises(RuntimeError, match="device fault: vLLM's engine core is dead"):
            replica.check_health()
    cut_short = [items for items in ends if isinstance(items[-1], StreamError)]
    assert cut_short, "every stream finished before the kill: nothing was tested"
    assert all(isinstance(items[-1], Finished) for items in ends if items not in cut_short)
    for items in [*cut_short, after]:
        error = items[-1].error
        assert (error.status_code, error.code, error.retry_after_s) == (503, "draining", 1)
    assert (replica.gate.budget.reserved_bytes, replica.gate.budget.active_leases) == (0, 0)
