"""Unit-test fixtures: no Ray, a fake clock, and queues whose idle invariants are checked.

Every queue or controller built through :func:`make_queue` / :func:`make_controller` is checked
after its test against the idle invariants: nothing reserved, nothing queued, every charged
byte released, no live lease. Tests must therefore release every lease they take and cancel
every waiter they leave.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from serve_app.admission.budget import MemoryBudget
from serve_app.admission.controller import AdmissionController
from serve_app.admission.drain import DrainRateEstimator
from serve_app.admission.queue import AdmissionQueue, Waiter

# --- no Ray in unit tests ------------------------------------------------------------------


@functools.cache
def _ray() -> ModuleType | None:
    """The ``ray`` module, imported once per session (about 0.4 s), or ``None`` if absent."""
    if "ray" in sys.modules:
        return sys.modules["ray"]
    if importlib.util.find_spec("ray") is None:
        return None
    return importlib.import_module("ray")


def _refuse_ray_init(*args: object, **kwargs: object) -> None:
    raise RuntimeError("unit tests must not start Ray; put this test under tests/integration/")


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``ray.init`` (and Ray's auto-init, which calls it) raise in every unit test."""
    ray = _ray()
    if ray is not None:
        monkeypatch.setattr(ray, "init", _refuse_ray_init)


# --- time ----------------------------------------------------------------------------------


class FakeClock:
    """A monotonic clock that moves only when told: ``clock()`` reads, ``advance(s)`` moves."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0); returns the new time."""
        assert seconds >= 0, f"a monotonic clock cannot go back ({seconds} s)"
        self.now_s += seconds
        return self.now_s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Any]:
    """A ``redis.asyncio`` client (bytes) of the session's real redis-server
    (``redis_url``); each test keeps to its own namespace or key prefix."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


# --- queues and controllers checked for the idle invariants ---------------------------------


def assert_idle(queue: AdmissionQueue) -> None:
    """The invariants of an idle replica, on one queue and its budget."""
    budget = queue.budget
    assert budget.reserved_bytes == 0, "bytes still reserved"
    assert queue.queue_depth == 0, "waiters left in the queue"
    assert queue.queued_bytes == 0, "queued bytes left over"
    assert budget.charged_bytes_total == budget.released_bytes_total, "charged != released"
    assert budget.active_leases == 0, "leases never released"


@pytest.fixture
def make_queue(clock: FakeClock) -> Iterator[Callable[..., AdmissionQueue]]:
    """Build :class:`AdmissionQueue` objects on the fake clock; check them idle after the test.

    ``make_queue(budget_bytes=100, max_queue_len=8, max_queue_wait_s=10.0, on_admit=None,
    drain_window_s=10.0)``.
    """
    built: list[AdmissionQueue] = []

    def build(budget_bytes: int = 100, max_queue_len: int = 8, max_queue_wait_s: float = 10.0,
              on_admit: Callable[[Waiter], None] | None = None,
              drain_window_s: float = 10.0) -> AdmissionQueue:
        queue = AdmissionQueue(MemoryBudget(budget_bytes), max_queue_len, max_queue_wait_s,
                               clock=clock, drain=DrainRateEstimator(drain_window_s, clock),
                               on_admit=on_admit)
        built.append(queue)
        return queue

    yield build
    for queue in built:
        assert_idle(queue)


@pytest.fixture
def make_controller(clock: FakeClock) -> Iterator[Callable[..., AdmissionController]]:
    """Build :class:`AdmissionController` objects; check them idle after the test.

    ``make_controller(budget_bytes=100, max_queue_len=8, max_queue_wait_s=1000.0,
    clock=<fake clock>)``. The controller waits with real asyncio timers of
    ``deadline - clock()`` seconds, so with the fake clock keep ``max_queue_wait_s`` long and
    end every wait by admission or cancellation; pass ``clock=time.monotonic`` for real timeouts.
    """
    built: list[AdmissionController] = []

    def build(budget_bytes: int = 100, max_queue_len: int = 8,
              max_queue_wait_s: float = 1000.0,
              clock: Callable[[], float] = clock) -> AdmissionController:
        controller = AdmissionController(budget_bytes, max_queue_len, max_queue_wait_s, clock)
        built.append(controller)
        return controller

    yield build
    for controller in built:
        assert_idle(controller.queue)


async def completion_of(lifecycle, request):
    """What a replica's lifecycle answers for a completion (:class:`InferenceRequest`): its
    output, or, for a streamed one read to its end, the output its pieces make."""
    from serve_app.request import GenerationOutput
    from serve_app.stream_events import Finished, TextPiece

    if not request.stream:
        return (await lifecycle.infer(request)).output
    pieces, last = [], None
    async for item in lifecycle.infer_stream(request):
        if isinstance(item, TextPiece):
            pieces.append(item.text)
        elif isinstance(item, Finished):
            last = item
    return GenerationOutput("".join(pieces), last.finish_reason, last.prompt_tokens,
                            last.completion_tokens)
