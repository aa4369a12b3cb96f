"""An engine that schedules itself (:class:`deployments.engines.base.AsyncScheduler`, the test
engine of tests/engines/async_engine.py) behind a real replica's gate, without Ray: each
request is admitted against the byte budget, handed to the engine once admitted, and its
lease held until its events end; a consumer that leaves aborts it, a stall past
``admission.inference_timeout_s`` is a 504; nothing stays leased."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from deployments.engines.fake import exact_cost_model
from deployments.engines.words import VOCAB
from deployments.replica.parts import Replica, ReplicaIdentity
from serve_app.errors import InferenceTimeoutError
from serve_app.kinds import build_request
from serve_app.memory.simulated import SimulatedDevice, SimulatedDeviceProbe
from serve_app.metrics import ProcessMetrics
from serve_app.request import GenerationParams, InferenceRequest
from serve_app.schemas import Admitted
from serve_app.stream_events import Finished, Queued, StreamError, TextPiece
from tests.engines.async_engine import TickingScheduler
from tests.unit.test_batcher import LABELS, replica_args

PER_TOKEN_BYTES = 1000
PROMPT = "one two three"  # 5 tokens with the begin and end ids


class ScheduledReplica:
    """A replica's parts around the ticking engine, priced at ``PER_TOKEN_BYTES``."""

    def __init__(self, budget_bytes: int, inference_timeout_s: float = 30.0,
                 tick_s: float = 0.002, engine: TickingScheduler | None = None) -> None:
        self.engine = engine or TickingScheduler(tick_s)
        self.args = replica_args(inference_timeout_s=inference_timeout_s)
        self.metrics = ProcessMetrics(LABELS["deployment"], LABELS["replica"], use_ray=False)
        self.executor = ThreadPoolExecutor(max_workers=1)
        probe = SimulatedDeviceProbe(SimulatedDevice(capacity_bytes=budget_bytes))
        self.parts = Replica(self.engine, probe, exact_cost_model(PER_TOKEN_BYTES, 0),
                             budget_bytes, self.args, self.executor, self.metrics,
                             ReplicaIdentity("test"))

    def request(self, max_tokens: int, stream: bool = True) -> InferenceRequest:
        ids = self.engine.front_end(self.args).tokenize([PROMPT])
        return build_request("generate", ids, GenerationParams(max_tokens=max_tokens,
                                                               temperature=0.0),
                             stream, self.args, self.engine.max_seq_tokens)

    def close(self) -> None:
        self.parts.close()
        self.executor.shutdown(wait=True)


def expected_text(max_tokens: int) -> str:
    return "".join(f" {VOCAB[n % len(VOCAB)]}" for n in range(1, max_tokens + 1))


async def test_a_completion_runs_on_the_engine_once_admitted() -> None:
    replica = ScheduledReplica(budget_bytes=10**6)
    try:
        result = await replica.parts.answer(replica.request(7, stream=False))
    finally:
        replica.close()
    assert result.output.text == expected_text(7)
    assert (result.output.finish_reason, result.output.completion_tokens) == ("length", 7)
    assert replica.parts.batcher is None and replica.parts.decode is None
    assert replica.parts.gate.budget.reserved_bytes == 0
    assert replica.engine.aborted == [] and replica.engine.steps == {}


async def test_fifty_streams_twenty_cancelled_leave_nothing_leased() -> None:
    price = (5 + 20) * PER_TOKEN_BYTES  # prompt + max_tokens
    replica = ScheduledReplica(budget_bytes=12 * price)  # 12 at once; the rest wait
    budget = replica.parts.gate.budget
    most_running = 0

    async def one(index: int) -> tuple[str, list]:
        nonlocal most_running
        items = []
        stream = replica.parts.answer_stream(replica.request(20))
        async with contextlib.aclosing(stream):  # as Ray closes it when the client leaves
            async for item in stream:
                items.append(item)
                most_running = max(most_running, len(replica.engine.steps))
                assert budget.reserved_bytes <= budget.budget_bytes
                if isinstance(item, TextPiece) and index % 5 < 2:  # 20 of 50 leave
                    return "left", items
        return "done", items

    try:
        ends = await asyncio.gather(*(one(i) for i in range(50)))
    finally:
        replica.close()
    done = [items for end, items in ends if end == "done"]
    assert [end for end, _ in ends].count("left") == 20 and len(done) == 30
    assert any(isinstance(items[0], Queued) for _, items in ends)  # some waited their turn
    for items in done:
        assert isinstance([i for i in items if not isinstance(i, Queued)][0], Admitted)
        assert "".join(i.text for i in items if isinstance(i, TextPiece)) == expected_text(20)
        assert items[-1] == Finished("length", 5, 20)
    assert 1 < most_running <= 12  # the engine batched them, the gate bounded it
    assert len(replica.engine.aborted) == 20 and len(set(replica.engine.aborted)) == 20
    assert (budget.reserved_bytes, budget.active_leases, replica.engine.steps) == (0, 0, {})
    assert budget.peak_reserved_bytes == 12 * price


async def test_a_stall_past_the_inference_timeout_is_a_504_and_aborted() -> None:
    # One word at once, the next an hour later: a stalled engine.
    replica = ScheduledReplica(budget_bytes=10**6, inference_timeout_s=0.2, tick_s=3600)
    try:
        items = [item async for item in replica.parts.answer_stream(replica.request(5))]
        with pytest.raises(InferenceTimeoutError):
            await replica.parts.lifecycle.infer(replica.request(5, stream=False))
    finally:
        replica.close()
    assert isinstance(items[0], Admitted) and isinstance(items[-1], StreamError)
    assert items[-1].error.status_code == 504
    assert len(replica.engine.aborted) == 2
    assert replica.parts.gate.budget.reserved_bytes == 0
    assert replica.parts.gate.budget.active_leases == 0


class DyingScheduler(TickingScheduler):
    """Its scheduler dies after ``pieces`` pieces of text in all (as vLLM's engine core
    process can): every request then fails, and :meth:`dead_reason` says so."""

    def __init__(self, pieces: int) -> None:
        super().__init__()
        self.pieces_left = pieces
        self.died = False

    async def submit(self, request, lease):
        async for event in super().submit(request, lease):
            if self.pieces_left == 0:
                self.died = True
            if self.died:
                raise RuntimeError("EngineCore encountered an issue")
            self.pieces_left -= 1
            yield event

    async def abort(self, lease_id: int) -> None:
        if self.died:
            raise RuntimeError("the engine is dead: nothing to abort")
        await super().abort(lease_id)

    def dead_reason(self) -> str | None:
        return "the scheduler died" if self.died else None


async def test_a_dying_engine_is_503_draining_and_fails_the_health_check() -> None:
    replica = ScheduledReplica(budget_bytes=10**6, engine=DyingScheduler(pieces=5))
    replica.parts.check_health()  # alive: no error

    async def one() -> list:
        return [item async for item in replica.parts.answer_stream(replica.request(20))]

    try:
        ends = await asyncio.gather(*(one() for _ in range(4)))
        with pytest.raises(RuntimeError, match="device fault: the scheduler died"):
            replica.parts.check_health()
    finally:
        replica.close()
    for items in ends:
        assert isinstance(items[-1], StreamError)
        error = items[-1].error
        assert (error.status_code, error.code, error.retry_after_s) == (503, "draining", 1)
    assert sum(isinstance(i, TextPiece) for items in ends for i in items) == 5
    budget = replica.parts.gate.budget
    assert (budget.reserved_bytes, budget.active_leases) == (0, 0)
    assert replica.parts.health.device_fault == "the scheduler died"
