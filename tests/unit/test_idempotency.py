"""The Idempotency-Key table: one run per key, coalesced waiters, replays, mismatch, expiry."""

from __future__ import annotations

import asyncio

from serve_app.idempotency import IdempotencyTable, StoredResponse

OK = StoredResponse(200, {"X-Queue-Position": "0"}, {"data": [1]})


async def test_one_run_coalesced_waiters_and_replays(clock) -> None:
    table = IdempotencyTable(ttl_s=60, clock=clock)
    assert table.begin("k", "h") == ("run", None)
    assert table.begin("k", "h") == ("wait", None)
    waiter = asyncio.create_task(table.wait("k", timeout_s=60))
    await asyncio.sleep(0)
    table.finish("k", OK)
    assert await waiter == OK
    assert table.begin("k", "h") == ("replay", OK)
    assert table.begin("k", "other body") == ("mismatch", None)
    assert (table.executions, table.replays) == (1, 2)


async def test_an_aborted_key_runs_again_and_wakes_waiters_empty_handed(clock) -> None:
    table = IdempotencyTable(ttl_s=60, clock=clock)
    table.begin("k", "h")
    waiter = asyncio.create_task(table.wait("k", timeout_s=60))
    await asyncio.sleep(0)
    table.abort("k")
    assert await waiter is None
    assert table.begin("k", "h") == ("run", None)


def test_finished_keys_expire_after_the_ttl_and_the_table_is_bounded(clock) -> None:
    table = IdempotencyTable(ttl_s=10, max_entries=2, clock=clock)
    table.begin("a", "h")
    table.finish("a", OK)
    clock.advance(10)
    assert table.begin("a", "h") == ("run", None)  # expired: runs again
    table.begin("b", "h")
    table.begin("c", "h")  # evicts the least recently used, "a"
    assert table.begin("a", "h") == ("run", None)
