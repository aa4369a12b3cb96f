"""The Batch API's files and batches against a real redis-server: streamed uploads checked
as JSONL (and nothing left of a refused one), listing and deleting, status changes that see
one winner, lines recorded once, the driving lock."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from serve_app.batches.files import FileStore, JsonlChecker
from serve_app.batches.models import Batch, BatchStatus
from serve_app.batches.store import BatchStore
from serve_app.errors import BodyTooLargeError, InvalidRequestError


@pytest.fixture
async def base(client):
    base = f"vramgate:batches:test-{uuid.uuid4().hex[:12]}:"
    yield base
    keys = [key async for key in client.scan_iter(match=base + "*")]
    if keys:
        await client.delete(*keys)


async def chunks_of(data: bytes, size: int = 7):
    for start in range(0, len(data), size):
        yield data[start:start + size]


JSONL = b'{"custom_id": "a"}\n{"custom_id": "b"}\n\n{"custom_id": "c"}'


async def test_upload_streams_checks_and_reads_back(client, base, clock):
    files = FileStore(client, base, clock)
    file = await files.write(chunks_of(JSONL), "in.jsonl", "batch", JsonlChecker(1000, 10))
    assert (file.bytes, file.filename, file.purpose, file.object) == (
        len(JSONL), "in.jsonl", "batch", "file")
    assert file.id.startswith("file-") and file.created_at == int(clock())
    assert b"".join([c async for c in files.read(file.id)]) == JSONL
    assert [n async for n, _ in files.lines(file.id)] == [1, 2, 4]
    assert await files.get(file.id) == file
    assert [f.id for f in await files.list()] == [file.id]
    assert await files.delete(file.id) and not await files.delete(file.id)
    assert await files.get(file.id) is None and await files.list() == []
    assert [key async for key in client.scan_iter(match=base + "*")] == []


@pytest.mark.parametrize(("data", "error", "code"), [
    (b'{"a": 1}\nnot json\n', InvalidRequestError, "invalid_jsonl"),
    (b'[1, 2]\n', InvalidRequestError, "invalid_jsonl"),
    (b"\n\n", InvalidRequestError, "invalid_jsonl"),
    (b'{"a": 1}\n' * 4, InvalidRequestError, "too_many_lines"),
    (b'{"a": "' + b"x" * 200 + b'"}', BodyTooLargeError, "body_too_large"),
])
async def test_a_refused_upload_leaves_nothing(client, base, data, error, code):
    files = FileStore(client, base)
    with pytest.raises(error) as refused:
        await files.write(chunks_of(data), "f", "batch", JsonlChecker(100, 3))
    assert refused.value.code == code
    if code == "invalid_jsonl" and data.startswith(b'{"a": 1}\nnot'):
        assert "line 2" in str(refused.value)
    assert [key async for key in client.scan_iter(match=base + "*")] == []


def _batch(clock) -> Batch:
    return Batch(id=f"batch_{uuid.uuid4().hex[:24]}", endpoint="/v1/embeddings",
                 input_file_id="file-x", created_at=int(clock()))


async def test_status_moves_once_and_counts_come_from_the_records(client, base, clock):
    batches = BatchStore(client, base, clock)
    batch = _batch(clock)
    await batches.create(batch, "tenant-a")
    assert await batches.active() == [batch.id] and await batches.tenant(batch.id) == "tenant-a"
    await batches.set_lines(batch.id, [f'{{"custom_id": "c{i}", "body": {{}}}}'
                                       for i in range(5)])
    clock.advance(5)
    moves = await asyncio.gather(*(batches.transition(
        batch.id, {BatchStatus.VALIDATING}, BatchStatus.IN_PROGRESS) for _ in range(4)))
    assert sum(move is not None for move in moves) == 1
    now = await batches.get(batch.id)
    assert now.status is BatchStatus.IN_PROGRESS and now.in_progress_at == int(clock())
    await batches.submitted(batch.id, "c0", "job-0", 1)
    await batches.submitted(batch.id, "c1", "job-1", 2)
    assert await batches.running(batch.id) == {"c0": "job-0", "c1": "job-1"}
    assert await batches.cursor(batch.id) == 2
    assert await batches.record(batch.id, "c0", {"ok": 1}, failed=False)
    assert not await batches.record(batch.id, "c0", {"ok": 2}, failed=True)  # once
    assert await batches.record(batch.id, "c1", {"bad": 1}, failed=True)
    assert await batches.running(batch.id) == {} and await batches.recorded(batch.id, "c1")
    assert await batches.results(batch.id, ["c0", "c1"], failed=False) == [b'{"ok":1}', None]
    counts = (await batches.get(batch.id)).request_counts
    assert (counts.total, counts.completed, counts.failed) == (5, 1, 1)
    assert [line["custom_id"] for line in await batches.lines(batch.id, 3, 5)] == ["c3", "c4"]
    done = await batches.transition(batch.id, {BatchStatus.IN_PROGRESS}, BatchStatus.COMPLETED,
                                    output_file_id="file-out")
    assert done.completed_at == int(clock()) and done.output_file_id == "file-out"
    assert await batches.active() == []
    assert await batches.transition(batch.id, {BatchStatus.IN_PROGRESS},
                                    BatchStatus.CANCELLING) is None


async def test_listing_is_newest_first_with_a_cursor(client, base, clock):
    batches = BatchStore(client, base, clock)
    made = []
    for _ in range(3):
        made.append(_batch(clock))
        await batches.create(made[-1], "t")
        clock.advance(1)
    page, more = await batches.list(2)
    assert [b.id for b in page] == [made[2].id, made[1].id] and more
    page, more = await batches.list(2, after=made[1].id)
    assert [b.id for b in page] == [made[0].id] and not more
    assert await batches.get("batch_nope") is None


async def test_one_holder_of_a_batch_lock(client, base):
    batches = BatchStore(client, base).locks
    assert await batches.lock("b", "one", 10_000)
    assert not await batches.lock("b", "two", 10_000)
    assert await batches.renew("b", "one", 10_000) and not await batches.renew("b", "two", 1)
    await batches.unlock("b", "two")  # not its lock: nothing happens
    assert not await batches.lock("b", "two", 10_000)
    await batches.unlock("b", "one")
    assert await batches.lock("b", "two", 10_000)
