"""The ingress's view of the replicas fetches the registry's snapshot once at a time, and
under load no request waits for it: a fresh-enough snapshot is used while the next is
fetched. Runs against a stand-in of Ray's deployment handle (``snapshot.remote()``), no Ray."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from deployments.http.replica_view import STALE_WHILE_FETCHING_S, STATUS_CACHE_S, ReplicaView
from serve_app.admission.policy import BudgetPolicy
from tests.unit.conftest import FakeClock


class StandInRegistry:
    """Ray's handle to the registry: each ``snapshot.remote()`` is one call, answered when
    the test says so (``answer``), with the replicas published by then."""

    def __init__(self) -> None:
        self.calls = 0
        self.published: list[object] = []
        self._pending: list[asyncio.Future] = []
        self.snapshot = SimpleNamespace(remote=self._remote)

    def _remote(self) -> asyncio.Future:
        self.calls += 1
        future = asyncio.get_running_loop().create_future()
        self._pending.append(future)
        return future

    def answer(self) -> None:
        for future in self._pending:
            future.set_result(list(self.published))
        self._pending.clear()


def replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(model="m", replica_id=name)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_fetch_at_a_time_and_no_wait_while_the_snapshot_is_fresh_enough() -> None:
    clock, registry = FakeClock(), StandInRegistry()
    view = ReplicaView(registry, BudgetPolicy, 10.0, model="m", clock=clock)
    registry.published = [replica("a")]

    # No snapshot yet: every caller waits for the one fetch.
    first = [asyncio.ensure_future(view.states()) for _ in range(20)]
    await settle()
    assert registry.calls == 1 and not any(t.done() for t in first)
    registry.answer()
    assert [[s.replica_id for s in await t] for t in first] == [["a"]] * 20

    # Fresh: no call at all.
    clock.advance(STATUS_CACHE_S / 2)
    assert [s.replica_id for s in await view.states()] == ["a"]
    assert registry.calls == 1

    # Stale but young enough: answered at once from the old snapshot, one fetch started
    # for all of them; the next callers get the new one.
    registry.published = [replica("a"), replica("b")]
    clock.advance(STATUS_CACHE_S)
    answers = [await view.states() for _ in range(20)]
    await settle()
    assert {len(a) for a in answers} == {1} and registry.calls == 2
    registry.answer()
    await settle()
    assert [s.replica_id for s in await view.states()] == ["a", "b"]

    # After a quiet spell the old snapshot is not trusted: callers wait for a fresh one.
    registry.published = []
    clock.advance(STALE_WHILE_FETCHING_S)
    waiting = asyncio.ensure_future(view.states())
    await settle()
    assert not waiting.done() and registry.calls == 3
    registry.answer()
    assert await waiting == []


async def test_a_caller_that_leaves_does_not_cancel_the_shared_fetch() -> None:
    clock, registry = FakeClock(), StandInRegistry()
    view = ReplicaView(registry, BudgetPolicy, 10.0, model="m", clock=clock)
    registry.published = [replica("a"), SimpleNamespace(model="other", replica_id="x")]
    leaving, staying = (asyncio.ensure_future(view.states()) for _ in range(2))
    await settle()
    leaving.cancel()
    await settle()
    registry.answer()
    assert [s.replica_id for s in await staying] == ["a"]  # only this model's replicas
    assert registry.calls == 1
