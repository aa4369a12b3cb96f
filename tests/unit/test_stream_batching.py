"""A stream's items grouped in time (:func:`serve_app.stream_batching.coalesced`), on a fake
clock: the interval is the clock's, the waits asyncio's (0 once the clock says it passed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.stream_batching import coalesced

INTERVAL_S = 0.5


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class Source:
    """An async generator fed by the test: each ``put`` item is yielded in turn; ``None``
    ends it, an exception is raised. Records whether it was closed."""

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def stream(self) -> AsyncIterator[str]:
        try:
            while (item := await self.items.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True


async def test_the_first_item_and_items_after_a_quiet_interval_go_at_once() -> None:
    clock, source = Clock(), Source()
    batches = coalesced(source.stream(), INTERVAL_S, clock=clock)
    source.items.put_nowait("a")
    assert await anext(batches) == ["a"]
    clock.now_s += INTERVAL_S  # a slow stream: nothing waits
    source.items.put_nowait("b")
    assert await anext(batches) == ["b"]
    clock.now_s += 1.0
    source.items.put_nowait("c")
    assert await anext(batches) == ["c"]
    source.items.put_nowait(None)
    assert [batch async for batch in batches] == []
    assert source.closed


async def test_items_within_the_interval_wait_and_go_together_when_it_passes() -> None:
    clock, source = Clock(), Source()
    batches = coalesced(source.stream(), INTERVAL_S, clock=clock)
    source.items.put_nowait("a")
    assert await anext(batches) == ["a"]
    for item in "bcd":
        source.items.put_nowait(item)
    waiting = asyncio.ensure_future(anext(batches))
    for _ in range(20):  # the three arrive; the interval (fake clock) has not passed
        await asyncio.sleep(0)
    assert not waiting.done() and source.items.empty()
    clock.now_s += INTERVAL_S  # the wait the clock allowed ends: its next turn yields
    assert await asyncio.wait_for(waiting, 60) == ["b", "c", "d"]
    source.items.put_nowait("e")  # within the interval of the group that just went
    source.items.put_nowait(None)  # the end flushes what waits
    assert [batch async for batch in batches] == [["e"]]


async def test_unpaced_items_go_at_once_and_do_not_start_an_interval() -> None:
    # A stream's admission events (Queued, Admitted) are not paced: the first piece of
    # text after them is not held behind them (time to first token).
    clock, source = Clock(), Source()
    batches = coalesced(source.stream(), INTERVAL_S, paced=lambda item: item.islower(),
                        clock=clock)
    for item in ("Q", "A", "x"):
        source.items.put_nowait(item)
        assert await anext(batches) == [item]
    source.items.put_nowait("y")
    source.items.put_nowait("Z")  # unpaced but behind a held item: it keeps its order
    source.items.put_nowait(None)
    assert [batch async for batch in batches] == [["y", "Z"]]


async def test_an_error_comes_after_the_items_before_it() -> None:
    clock, source = Clock(), Source()
    batches = coalesced(source.stream(), INTERVAL_S, clock=clock)
    for item in ("a", "b", RuntimeError("engine died")):
        source.items.put_nowait(item)
    assert await anext(batches) == ["a"]
    assert await anext(batches) == ["b"]
    with pytest.raises(RuntimeError, match="engine died"):
        await anext(batches)
    assert source.closed


async def test_the_source_is_closed_when_the_consumer_leaves() -> None:
    # The replica's stream releases its lease in its own finally: a consumer that leaves
    # (aclose, or its task cancelled) must reach it.
    for leave in ("aclose", "cancel"):
        clock, source = Clock(), Source()
        batches = coalesced(source.stream(), INTERVAL_S, clock=clock)
        source.items.put_nowait("a")
        assert await anext(batches) == ["a"]
        if leave == "cancel":  # its task cancelled while the next item is awaited
            waiting = asyncio.ensure_future(anext(batches))
            await asyncio.sleep(0)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        else:  # closed between two items
            assert not source.closed
            await batches.aclose()
        assert source.closed, leave


@settings(max_examples=60, deadline=None)
@given(gaps=st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.5, 2.0]), min_size=1,
                     max_size=30),
       interval_s=st.sampled_from([0.0, 0.2, INTERVAL_S]))
def test_every_item_comes_once_in_order_and_groups_are_an_interval_apart(
        gaps: list[float], interval_s: float) -> None:
    async def run() -> list[tuple[float, list[int]]]:
        clock, source = Clock(), Source()
        batches = coalesced(source.stream(), interval_s, clock=clock)
        got: list[tuple[float, list[int]]] = []

        async def consume() -> None:
            async for batch in batches:
                got.append((clock.now_s, batch))

        consumer = asyncio.ensure_future(consume())
        for index, gap_s in enumerate(gaps):
            clock.now_s += gap_s
            source.items.put_nowait(index)
            for _ in range(10):
                await asyncio.sleep(0)
        source.items.put_nowait(None)
        await asyncio.wait_for(consumer, 60)
        return got

    got = asyncio.run(run())
    assert [item for _, batch in got for item in batch] == list(range(len(gaps)))
    assert all(batch for _, batch in got)
    times_s = [at_s for at_s, _ in got[:-1]]  # the last may be the end's flush
    assert all(b - a >= interval_s - 1e-9 for a, b in zip(times_s, times_s[1:], strict=False))
    if interval_s == 0.0:
        assert all(len(batch) == 1 for _, batch in got)
