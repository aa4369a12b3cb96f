"""A batch's run without model replicas, on a real redis-server: past its completion window
every line not recorded gets a ``batch_expired`` error line and the batch ends ``expired``
with its error file; a cancelled batch ends ``cancelled`` the same way; lines no model here
serves become error lines and the batch completes."""

from __future__ import annotations

import json
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.http.batch_driver import BatchDriver, BatchParts, BatchRun
from deployments.http.jobs_http import JobsRoutes
from deployments.http.served_models import ServedModels
from serve_app.batches.files import FileStore
from serve_app.batches.models import Batch, BatchStatus
from serve_app.batches.store import BatchStore
from serve_app.metrics import ProcessMetrics


@pytest.fixture
async def parts(client, clock):
    base = f"vramgate:batches:test-{uuid.uuid4().hex[:12]}:"
    yield BatchParts(BatchStore(client, base, clock), FileStore(client, base, clock),
                     JobsRoutes(ServedModels()), 4,
                     ProcessMetrics("Ingress", "test", use_ray=False), clock, poll_s=0.0)
    keys = [key async for key in client.scan_iter(match=base + "*")]
    if keys:
        await client.delete(*keys)


async def _batch(parts: BatchParts, status: BatchStatus, lines: int) -> Batch:
    async def chunks():
        for i in range(lines):
            yield json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                              "body": {"input": "x"}}).encode() + b"\n"

    file = await parts.files.write(chunks(), "in.jsonl", "batch")
    now = int(parts.clock())
    batch = Batch(id=f"batch_{uuid.uuid4().hex[:24]}", endpoint="/v1/embeddings",
                  input_file_id=file.id, created_at=now, expires_at=now + 60)
    await parts.batches.create(batch, "t")
    await parts.batches.set_lines(batch.id, [json.dumps({"custom_id": f"c{i}", "body": {}})
                                             for i in range(lines)])
    if status is not BatchStatus.VALIDATING:
        await parts.batches.transition(batch.id, {BatchStatus.VALIDATING}, status)
    return batch


async def _error_codes(parts: BatchParts, batch: Batch) -> dict[str, str]:
    text = b"".join([chunk async for chunk in parts.files.read(batch.error_file_id)])
    return {line["custom_id"]: line["error"]["code"]
            for line in map(json.loads, text.splitlines())}


async def test_past_its_window_every_line_left_expires(parts, clock):
    batch = await _batch(parts, BatchStatus.IN_PROGRESS, 7)
    await parts.batches.record(batch.id, "c3", {"custom_id": "c3", "done": True}, failed=False)
    clock.advance(61)
    batch = await BatchRun(parts, batch.id).run()
    assert batch.status is BatchStatus.EXPIRED and batch.expired_at == int(clock())
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 6)
    codes = await _error_codes(parts, batch)
    assert codes == {f"c{i}": "batch_expired" for i in range(7) if i != 3}
    output = b"".join([chunk async for chunk in parts.files.read(batch.output_file_id)])
    assert json.loads(output) == {"custom_id": "c3", "done": True}
    assert await parts.batches.active() == []


async def test_a_cancelled_batch_gives_its_lines_errors(parts):
    batch = await _batch(parts, BatchStatus.IN_PROGRESS, 3)
    await parts.batches.transition(batch.id, {BatchStatus.IN_PROGRESS}, BatchStatus.CANCELLING)
    batch = await BatchRun(parts, batch.id).run()
    assert batch.status is BatchStatus.CANCELLED and batch.output_file_id is None
    assert set((await _error_codes(parts, batch)).values()) == {"batch_cancelled"}


async def test_lines_no_model_serves_are_error_lines_and_the_batch_completes(parts):
    """A well-formed line naming a model not served here is not a malformed file: it gets
    an error line with the route's code and the batch runs (and ends) without it."""
    batch = await _batch(parts, BatchStatus.VALIDATING, 3)
    batch = await BatchRun(parts, batch.id).run()
    assert batch.status is BatchStatus.COMPLETED and batch.errors is None
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (3, 0, 3)
    assert batch.output_file_id is None
    assert await _error_codes(parts, batch) == {f"c{i}": "model_not_found" for i in range(3)}


async def test_a_line_made_an_error_line_keeps_its_error_when_the_batch_is_cancelled(parts):
    batch = await _batch(parts, BatchStatus.IN_PROGRESS, 2)
    await parts.batches.set_lines(batch.id, [
        json.dumps({"custom_id": "c0", "body": {}}),
        json.dumps({"custom_id": "c1", "error": {"code": "invalid_url", "message": "m"}})])
    await parts.batches.transition(batch.id, {BatchStatus.IN_PROGRESS}, BatchStatus.CANCELLING)
    batch = await BatchRun(parts, batch.id).run()
    assert await _error_codes(parts, batch) == {"c0": "batch_cancelled", "c1": "invalid_url"}


async def test_one_driver_takes_a_batch(parts):
    batch = await _batch(parts, BatchStatus.CANCELLING, 2)
    one, two = BatchDriver(parts), BatchDriver(parts)
    await parts.batches.locks.lock(batch.id, "someone else", 30_000)
    await one.scan()
    assert (await parts.batches.get(batch.id)).status is BatchStatus.CANCELLING
    await parts.batches.locks.unlock(batch.id, "someone else")
    await one.scan()
    await two.scan()  # the lock is one's until its run ends
    for task in [*one._driving.values(), *two._driving.values()]:
        await task
    assert (await parts.batches.get(batch.id)).status is BatchStatus.CANCELLED


def _driven(parts: BatchParts) -> dict[str, float]:
    """``vramgate_driven_batches`` by status, from the exposition."""
    found = {}
    for family in text_string_to_metric_families(parts.metrics.exposition()):
        for sample in family.samples:
            if sample.name == "vramgate_driven_batches":
                found[sample.labels["status"]] = sample.value
    return found


async def test_a_driver_publishes_the_batches_it_drives_by_status(parts):
    """Each not-final status is a series (0 included); the batch a scan takes counts under
    its status (it is validating 2,000 lines, many round trips to Redis, when the scan
    reads it), and no more once its run ended."""
    batch = await _batch(parts, BatchStatus.VALIDATING, 2000)
    driver = BatchDriver(parts)
    await driver.scan()
    assert _driven(parts) == {"validating": 1, "in_progress": 0, "finalizing": 0,
                              "cancelling": 0}
    for task in list(driver._driving.values()):
        await task
    await driver.scan()
    assert (await parts.batches.get(batch.id)).status is BatchStatus.COMPLETED
    assert set(_driven(parts).values()) == {0}
