"""A job's outcome written while its Redis is down (restarting after a redeploy, or killed) is
stored once the Redis is back: dropped, the job would stay ``running`` for as long as its
replica lives, since only the jobs of gone replicas are queued again."""

from __future__ import annotations

import asyncio
import json
from functools import partial

import redis.asyncio as aioredis

from deployments.replica.jobs_worker import store_outcome
from serve_app.jobs.embedded import EmbeddedRedis
from serve_app.jobs.store import JobStore
from serve_app.jobs.view import JobStatus


async def test_an_outcome_written_while_redis_is_down_is_stored_once_it_is_back(
        tmp_path, caplog) -> None:
    server = EmbeddedRedis(tmp_path).start()
    client = aioredis.from_url(server.url)
    try:
        store = JobStore(client, "m")
        job, _ = await store.submit("/v1/embeddings", json.dumps({"input": "x"}), b"req", 100,
                                    None)
        await store.claim(job.id, "w1")
        await asyncio.to_thread(server.stop)
        finish = partial(store.finish, job.id, "w1", '{"ok": true}')
        stored = asyncio.create_task(store_outcome(job.id, finish, first_pause_s=0.01))
        while caplog.text.count("could not be stored") < 2:  # it failed, and tried again
            assert not stored.done()
            await asyncio.sleep(0.01)
        await asyncio.to_thread(server.start)  # back, on the same append-only file
        await asyncio.wait_for(stored, timeout=30)
        view = await store.get(job.id)
        assert view.status is JobStatus.SUCCEEDED
        assert view.to_body()["result"] == {"ok": True}
        assert await store.finish(job.id, "w1", '{"ok": false}') is None  # the first one won
    finally:
        await client.aclose()
        server.stop()
