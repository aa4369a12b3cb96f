"""The job store against a real redis-server: FIFO positions, idempotent submit, the queue
bound, claim races, cancel, outcomes, requeue, orphan recovery, result TTL, completion rate."""

from __future__ import annotations

import asyncio
import json
import pickle
import uuid

import pytest
import redis.asyncio as aioredis

from serve_app.errors import IdempotencyKeyReusedError, OverloadedError
from serve_app.jobs.store import JobQueueFullError, JobStore
from serve_app.jobs.view import JobStatus

ROUTE = "/v1/embeddings"


def body(n: int) -> str:
    return json.dumps({"model": "m", "input": f"text {n}"})


@pytest.fixture
async def make_store(client, clock):
    """``make_store(namespace=None, **JobStore kwargs)``: stores on the fake clock, each in a
    fresh namespace unless one is given; their keys are deleted after the test."""
    namespaces = []

    def build(namespace: str | None = None, **kwargs) -> JobStore:
        namespace = namespace or f"test-{uuid.uuid4().hex[:12]}"
        namespaces.append(namespace)
        return JobStore(client, namespace, clock=clock, **kwargs)

    yield build
    for namespace in set(namespaces):
        keys = [key async for key in client.scan_iter(match=f"vramgate:{namespace}:*")]
        if keys:
            await client.delete(*keys)


@pytest.fixture
def store(make_store) -> JobStore:
    return make_store()


async def submit(store: JobStore, n: int, key: str | None = None, price: int = 100):
    view, created = await store.submit(ROUTE, body(n), f"req {n}".encode(), price, key)
    return view


async def queue_ids(client, store: JobStore) -> list[str]:
    return [i.decode() for i in await client.lrange(store.key("queued"), 0, -1)]


async def test_jobs_queue_first_in_first_out_with_positions(store, client, clock) -> None:
    jobs = [await submit(store, n, price=100 + n) for n in range(4)]
    assert [j.position for j in jobs] == [0, 1, 2, 3]
    assert all(j.id.startswith("job-") and len(j.id) == 36 for j in jobs)
    assert [(await store.get(j.id)).position for j in jobs] == [0, 1, 2, 3]
    head = await store.head()
    assert (head.id, head.request, head.price_bytes, head.position) == (jobs[0].id, b"req 0",
                                                                        100, 0)
    assert (await store.head()).id == jobs[0].id  # head does not remove
    claimed = await store.claim(jobs[0].id, "w1")
    assert (claimed.status, claimed.attempts, claimed.worker) == (JobStatus.RUNNING, 1, "w1")
    assert claimed.started_at == clock() and claimed.position is None
    assert [(await store.get(j.id)).position for j in jobs] == [None, 0, 1, 2]
    assert await store.figures.queued_count() == 3
    assert await client.lrange(store.key("running", "w1"), 0, -1) == [jobs[0].id.encode()]
    assert await store.get("job-unknown") is None


async def test_the_http_body_of_each_status(store, clock) -> None:
    queued = await submit(store, 1)
    assert queued.to_body() == {"id": queued.id, "object": "job", "status": "queued",
                                "route": ROUTE, "created_at": 1000.0, "attempts": 0,
                                "position": 0, "eta_s": None}
    await store.claim(queued.id, "w1")
    assert (await store.get(queued.id)).to_body() == {
        "id": queued.id, "object": "job", "status": "running", "route": ROUTE,
        "created_at": 1000.0, "attempts": 1}
    assert await store.finish(queued.id, "w1", '{"data": [1]}') is JobStatus.SUCCEEDED
    assert (await store.get(queued.id)).to_body()["result"] == {"data": [1]}
    failing = await submit(store, 2)
    await store.claim(failing.id, "w1")
    error = {"error": {"message": "m", "type": "invalid_request_error", "code": "x"}}
    assert await store.fail(failing.id, "w1", json.dumps(error), 400) is JobStatus.FAILED
    failed = await store.get(failing.id)
    assert (failed.status_code, failed.to_body()["error"]) == (400, error)
    assert "result" not in failed.to_body()
    assert failed.finished_at == clock() and failed.body_json == body(2)


async def test_an_idempotency_key_makes_one_job(store) -> None:
    first, created = await store.submit(ROUTE, body(1), b"r", 10, "key-1")
    again, created_again = await store.submit(ROUTE, body(1), b"r", 10, "key-1")
    assert (created, created_again) == (True, False)
    assert again.id == first.id and again.idempotency_key == "key-1"
    assert await store.figures.queued_count() == 1
    with pytest.raises(IdempotencyKeyReusedError) as refused:
        await store.submit(ROUTE, body(2), b"r", 10, "key-1")
    assert (refused.value.status_code, refused.value.code) == (422, "idempotency_key_reused")
    with pytest.raises(IdempotencyKeyReusedError):
        await store.submit("/v1/other", body(1), b"r", 10, "key-1")
    await store.claim(first.id, "w1")
    await store.finish(first.id, "w1", '{"ok": true}')
    done, created = await store.submit(ROUTE, body(1), b"r", 10, "key-1")
    assert (done.id, done.status, created) == (first.id, JobStatus.SUCCEEDED, False)
    assert await store.figures.queued_count() == 0


async def test_a_full_queue_refuses_with_retry_after_from_the_completion_rate(
        make_store, clock) -> None:
    store = make_store(max_queued=2)
    a = await submit(store, 1, key="a")
    await submit(store, 2)
    with pytest.raises(JobQueueFullError) as full:
        await submit(store, 3)
    assert isinstance(full.value, OverloadedError)
    assert (full.value.status_code, full.value.code, full.value.retry_after_s) == (
        503, "jobs_full", 1)  # no rate measured yet: the 1 s fallback
    assert (await submit(store, 1, key="a")).id == a.id  # a known key is answered, not refused
    await store.claim(a.id, "w1")
    clock.advance(10)
    await store.finish(a.id, "w1", "{}")  # one completion in 10 s since the first claim
    await submit(store, 4)
    with pytest.raises(JobQueueFullError) as full:
        await submit(store, 5)
    assert full.value.retry_after_s == 30  # (2 queued + 1) / 0.1 per s
    copy = pickle.loads(pickle.dumps(full.value))
    assert (type(copy), copy.code, copy.retry_after_s) == (JobQueueFullError, "jobs_full", 30)


async def test_concurrent_submits_respect_the_bound_and_the_key(make_store) -> None:
    store = make_store(max_queued=5)
    outcomes = await asyncio.gather(*(submit(store, n) for n in range(20)),
                                    return_exceptions=True)
    assert sum(not isinstance(o, Exception) for o in outcomes) == 5
    assert all(isinstance(o, JobQueueFullError) for o in outcomes if isinstance(o, Exception))
    keyed = make_store()
    views = await asyncio.gather(*(keyed.submit(ROUTE, body(1), b"r", 1, "k") for _ in range(20)))
    assert len({view.id for view, _ in views}) == 1
    assert sum(created for _, created in views) == 1
    assert await keyed.figures.queued_count() == 1


async def test_twenty_concurrent_claims_of_the_head_have_one_winner(make_store, client) -> None:
    first = make_store()
    stores = [first, *(make_store(first.namespace) for _ in range(19))]  # 20 replicas
    job = await submit(stores[0], 1)
    won = await asyncio.gather(*(s.claim(job.id, f"w{i}") for i, s in enumerate(stores)))
    winners = [(i, v) for i, v in enumerate(won) if v is not None]
    assert len(winners) == 1
    index, view = winners[0]
    assert (view.attempts, view.worker) == (1, f"w{index}")
    assert await stores[0].figures.queued_count() == 0
    running = [key async for key in client.scan_iter(match=stores[0].key("running", "*"))]
    assert running == [stores[0].key("running", f"w{index}").encode()]


async def test_cancel_a_queued_job(store, client) -> None:
    jobs = [await submit(store, n, key=f"k{n}") for n in range(3)]
    cancelled = await store.cancel(jobs[1].id)
    assert (cancelled.status, cancelled.position) == (JobStatus.CANCELLED, None)
    assert "position" not in cancelled.to_body()
    assert await queue_ids(client, store) == [jobs[0].id, jobs[2].id]
    assert (await store.get(jobs[2].id)).position == 1
    assert await store.claim(jobs[1].id, "w1") is None
    assert 0 < await client.ttl(store.key("job", jobs[1].id)) <= 3600
    assert 0 < await client.ttl(store.key("key", "k1")) <= 3600
    assert await store.cancel("job-unknown") is None


async def test_cancel_a_running_job_drops_its_result(store) -> None:
    job = await submit(store, 1)
    await store.claim(job.id, "w1")
    view = await store.cancel(job.id)
    assert (view.status, view.cancel_requested) == (JobStatus.RUNNING, True)
    assert await store.finish(job.id, "w1", '{"data": [1]}') is JobStatus.CANCELLED
    final = await store.get(job.id)
    assert (final.status, final.result_json) == (JobStatus.CANCELLED, None)
    assert "result" not in final.to_body()
    failing = await submit(store, 2)
    await store.claim(failing.id, "w1")
    await store.cancel(failing.id)
    assert await store.fail(failing.id, "w1", '{"error": {}}', 500) is JobStatus.CANCELLED
    assert (await store.get(failing.id)).error_json is None


async def test_a_final_job_is_neither_cancelled_nor_finished_again(store) -> None:
    job = await submit(store, 1)
    await store.claim(job.id, "w1")
    await store.finish(job.id, "w1", '{"n": 1}')
    view = await store.cancel(job.id)
    assert (view.status, view.cancel_requested) == (JobStatus.SUCCEEDED, False)
    assert await store.finish(job.id, "w1", '{"n": 2}') is None
    assert await store.fail(job.id, "w1", "{}", 500) is None
    assert await store.requeue(job.id, "w1") is None
    assert (await store.get(job.id)).to_body()["result"] == {"n": 1}


async def test_requeue_puts_the_job_back_at_the_head(store, client) -> None:
    jobs = [await submit(store, n) for n in range(3)]
    await store.claim(jobs[1].id, "w1")
    assert await store.requeue(jobs[1].id, "w2") is None  # not its job
    assert await store.requeue(jobs[1].id, "w1") is JobStatus.QUEUED
    assert await queue_ids(client, store) == [jobs[1].id, jobs[0].id, jobs[2].id]
    assert await client.llen(store.key("running", "w1")) == 0
    head = await store.head()
    assert (head.id, head.status, head.attempts) == (jobs[1].id, JobStatus.QUEUED, 1)
    assert (await store.claim(head.id, "w2")).attempts == 2
    await store.cancel(head.id)
    assert await store.requeue(head.id, "w2") is JobStatus.CANCELLED
    assert await queue_ids(client, store) == [jobs[0].id, jobs[2].id]


async def test_jobs_of_a_dead_worker_are_requeued_once(make_store, client) -> None:
    store = make_store()
    others = [make_store(store.namespace) for _ in range(3)]
    jobs = [await submit(store, n) for n in range(5)]
    for job, worker in zip(jobs[:4], ["w1", "w1", "w2", "w1"], strict=True):
        await store.claim(job.id, worker)
    await store.cancel(jobs[3].id)  # cancel requested while running on w1
    await store.heartbeat("w2", ttl_s=60)
    assert await store.recover_orphans() == []  # every heartbeat alive
    await client.delete(store.key("worker", "w1"))  # w1 died: its heartbeat is gone
    moved = await asyncio.gather(store.recover_orphans(), *(o.recover_orphans() for o in others))
    assert sorted(i for ids in moved for i in ids) == sorted([jobs[0].id, jobs[1].id])
    assert [ids for ids in moved if ids] == [[jobs[0].id, jobs[1].id]]
    assert await queue_ids(client, store) == [jobs[0].id, jobs[1].id, jobs[4].id]
    assert (await store.get(jobs[0].id)).status is JobStatus.QUEUED
    assert (await store.get(jobs[2].id)).status is JobStatus.RUNNING
    assert (await store.get(jobs[3].id)).status is JobStatus.CANCELLED
    assert not await client.exists(store.key("running", "w1"))
    assert (await store.claim(jobs[0].id, "w3")).attempts == 2


async def test_a_presumed_dead_worker_that_finishes_still_records_once(store, client) -> None:
    job = await submit(store, 1)
    await store.claim(job.id, "w1")
    await client.delete(store.key("worker", "w1"))
    assert await store.recover_orphans() == [job.id]
    assert await store.finish(job.id, "w1", '{"late": true}') is JobStatus.SUCCEEDED
    assert await store.figures.queued_count() == 0  # it runs no more
    assert (await store.get(job.id)).to_body()["result"] == {"late": True}


async def test_recovery_stays_in_its_namespace(make_store, client) -> None:
    ours, theirs = make_store(), make_store()
    job = await submit(theirs, 1)
    await theirs.claim(job.id, "w1")
    await client.delete(theirs.key("worker", "w1"))
    assert await ours.recover_orphans() == []
    assert (await theirs.get(job.id)).status is JobStatus.RUNNING
    keys = {k.decode() async for k in client.scan_iter(match=f"{theirs.base}*")}
    assert keys == {theirs.key("job", job.id), theirs.key("running", "w1"),
                    theirs.key("rate_since")}
    assert not [k async for k in client.scan_iter(match=f"{ours.base}*")]
    assert await ours.figures.queued_count() == 0 and await theirs.figures.queued_count() == 0


async def test_a_final_job_and_its_key_expire_after_the_result_ttl(make_store, client) -> None:
    store = make_store(result_ttl_s=120)
    job = await submit(store, 1, key="k")
    assert await client.ttl(store.key("job", job.id)) == -1  # kept while not final
    assert await client.ttl(store.key("key", "k")) == -1
    await store.claim(job.id, "w1")
    await store.finish(job.id, "w1", "{}")
    assert 110 <= await client.ttl(store.key("job", job.id)) <= 120
    assert 110 <= await client.ttl(store.key("key", "k")) <= 120


async def test_the_completion_rate_and_eta_follow_the_clock(store, clock) -> None:
    assert await store.figures.completions_per_s() is None
    jobs = [await submit(store, n) for n in range(5)]
    for job in jobs[:3]:
        await store.claim(job.id, "w1")  # the first claim at t = 1000 starts the measurement
    for job in jobs[:3]:
        clock.advance(2)
        await store.finish(job.id, "w1", "{}")
    assert await store.figures.completions_per_s() == pytest.approx(3 / 6)  # 3 in 6 s since start
    assert (await store.get(jobs[4].id)).eta_s == pytest.approx(2 / 0.5)  # position 1
    clock.advance(100)  # t = 1106: the last completion (1006) is out of a 60 s window
    assert await store.figures.completions_per_s() is None
    assert await store.figures.completions_per_s(window_s=120) == pytest.approx(3 / 106)
    assert (await store.get(jobs[3].id)).eta_s is None


async def test_a_client_that_decodes_responses_is_refused(redis_url) -> None:
    client = aioredis.from_url(redis_url, decode_responses=True)
    try:
        with pytest.raises(ValueError, match="decode_responses=False"):
            JobStore(client, "x")
    finally:
        await client.aclose()


async def test_the_prices_up_to_a_queued_job_are_what_drains_before_it(store) -> None:
    jobs = [await submit(store, n, price=100 * (n + 1)) for n in range(3)]  # 100, 200, 300
    assert [await store.figures.queued_bytes_through(j.position) for j in jobs] == [100, 300, 600]
    await store.claim(jobs[0].id, "w1")  # it runs now: no longer queued
    second = await store.get(jobs[1].id)
    assert (second.position, await store.figures.queued_bytes_through(second.position)) == (0, 200)


async def test_jobs_submitted_at_the_same_moment_each_get_their_own_position(store) -> None:
    jobs = await asyncio.gather(*(submit(store, n) for n in range(20)))
    assert sorted(j.position for j in jobs) == list(range(20))


async def test_jobs_without_a_request_are_listed_and_given_one_once(store, client) -> None:
    """Jobs stored by an earlier release carry no request (an empty field): the queued and
    running ones are listed, queued first, and each gets one request, once, only while it
    is queued or running."""
    old = [(await store.submit(ROUTE, body(n), b"", 100))[0] for n in range(4)]
    new = await submit(store, 9)
    given = await store.submit(ROUTE, body(10), b"", 100, job_id="job-" + "0" * 32)
    assert given[0].id == "job-" + "0" * 32 and given[1]
    await store.claim(old[0].id, "w1")  # running
    await store.claim(old[3].id, "w2")
    await store.fail(old[3].id, "w2", '{"error": {}}', 400)  # final: left alone
    assert await store.without_request() == [old[1].id, old[2].id, given[0].id, old[0].id]
    assert await store.set_request(old[0].id, b"rebuilt 0")  # running
    assert await store.set_request(old[1].id, b"rebuilt 1")  # queued
    assert not await store.set_request(old[1].id, b"again")  # it has one
    assert not await store.set_request(old[3].id, b"late")  # final
    assert not await store.set_request(new.id, b"other")  # stored with one
    assert not await store.set_request("job-gone", b"x")
    assert not await client.exists(store.key("job", "job-gone"))  # no stray hash
    assert [(await store.get(j.id)).request for j in (*old, new)] == [
        b"rebuilt 0", b"rebuilt 1", b"", b"", b"req 9"]
    assert await store.without_request() == [old[2].id, given[0].id]
