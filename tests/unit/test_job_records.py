"""A durable job's record holds the request as the ingress validated, tokenized and priced
it, and how its result renders (:mod:`serve_app.jobs.payload`): a model replica's job worker
runs it as it runs any request, and its result is the route's normal body. Jobs stored by
the previous release (the body alone, record format 1) are rebuilt by the ingress and run;
one no ingress rebuilt fails, after a while, with 500 ``job_format``.

Real parts without Ray: the ingress's routes and request factory over the fake engine's
front end, a model replica (:class:`tests.unit.test_batcher.Replica`), and a real
redis-server (``redis_url``)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from deployments.http.jobs_http import JobsFront
from deployments.http.replica_view import ReplicaView
from deployments.http.request_factory import RequestFactory
from deployments.http.routes import ROUTES, RouteContext
from deployments.replica.jobs_worker import UNREADABLE_WAIT_S, JobWorker
from serve_app.admission.policy import policy_class
from serve_app.admission.priority import Priority
from serve_app.errors import InvalidRequestError
from serve_app.jobs.config import JobsConfig
from serve_app.jobs.payload import (
    StoredJob,
    StoredRefusal,
    UnreadableJobError,
    decode,
    encode_job,
    encode_refusal,
)
from serve_app.jobs.store import JobStore
from serve_app.jobs.view import FINAL_STATUSES, JobView
from serve_app.memory.cost_model import Shape
from serve_app.request import (
    EmbeddingParams,
    GenerationParams,
    InferenceRequest,
    TranscriptionParams,
)
from serve_app.responses import ChatCompletionBody, CompletionBody, EmbeddingsBody
from tests.ingress_parts import PublishedRegistry
from tests.unit.conftest import FakeClock
from tests.unit.test_batcher import PER_TOKEN_BYTES, Replica, words

EMBED, COMPLETE = "/v1/embeddings", "/v1/completions"


def test_a_record_gives_back_the_request_and_its_rendering() -> None:
    requests = [
        InferenceRequest("embed", ((1, 5, 2), (1, 2)), Shape(2, 16, 0), EmbeddingParams(3),
                         stream=False, batch_key=("embed", 3)),
        InferenceRequest("generate", ((7, 8, 9),), Shape(1, 16, 32),
                         GenerationParams(30, 0.7, 0.9, 11, ("\n", "END")), stream=False,
                         batch_key=("generate", 0.7, 0.9)),
        InferenceRequest("generate", ((4,),), Shape(1, 1, 5), None)]
    renders = [EmbeddingsBody("m", 8, "base64"), CompletionBody("cmpl-job-1", 17, "m"),
               ChatCompletionBody("chatcmpl-job-2", 18, "m")]
    for request, render in zip(requests, renders, strict=True):
        stored = decode(encode_job(request, render))
        assert stored == StoredJob(request, render)
        assert type(stored.render) is type(render)
    refusal = decode(encode_refusal(_too_long()))
    assert refusal == StoredRefusal(_too_long().to_body(), 400)


def _too_long() -> InvalidRequestError:
    """The refusal of ``max_tokens: 100`` under ``limits.max_tokens: 62`` (the replica's)."""
    return InvalidRequestError("max_tokens=100 exceeds the limit of 62", code="max_tokens")


def test_records_of_other_formats_are_unreadable_and_audio_is_not_stored() -> None:
    versions = [(b"", 1), (b'{"v": 3, "request": {}}', 3), (b"not json", 0),
                (b'{"v": 2, "request": {"kind": "embed"}}', 2)]
    for record, version in versions:
        with pytest.raises(UnreadableJobError) as raised:
            decode(record)
        assert raised.value.version == version
    audio = InferenceRequest("transcribe", ((),), Shape(1, 100, 0),
                             TranscriptionParams(np.zeros(16_000, np.float32)))
    with pytest.raises(TypeError, match="TranscriptionParams"):
        encode_job(audio, EmbeddingsBody("m"))
    with pytest.raises(TypeError, match="ResponseBody"):
        encode_job(InferenceRequest("embed", ((1,),), Shape(1, 1, 0)), lambda result: {})


class Parts:
    """An ingress's jobs (its routes, request factory and :class:`JobsFront`) and a model
    replica's :class:`JobWorker`, sharing one job store."""

    def __init__(self, store: JobStore, budget_bytes: int = 64 * 64 * PER_TOKEN_BYTES,
                 clock: FakeClock | None = None, **replica_options: Any) -> None:
        self.store = store
        self.replica = Replica(budget_bytes=budget_bytes, max_batch_size=4, **replica_options)
        args = self.replica.args
        context = RouteContext(args, RequestFactory(args, self.replica.engine.front),
                               client=None, guard=None)  # type: ignore[arg-type]
        self.routes = {route.path: route(context) for route in ROUTES
                       if route.kind.name in self.replica.engine.kinds}
        view = ReplicaView(PublishedRegistry(), policy_class("budget"), 60.0,
                           model=args.model.name)
        self.jobs = JobsFront(store, self.routes, view)
        self.worker = JobWorker(store, self.replica.parts, "w1",
                                JobsConfig(poll_interval_s=0.01),
                                **({"clock": clock} if clock else {}))
        self._pulling: asyncio.Task | None = None

    def body(self, path: str, fields: dict[str, Any]) -> Any:
        return self.routes[path].body_model.model_validate(fields)

    async def submit(self, path: str, fields: dict[str, Any]) -> str:
        """Submit as ``POST /v1/jobs`` does; the job's id."""
        response = await self.jobs.submit(path, self.body(path, fields),
                                          SimpleNamespace(headers={}, state=SimpleNamespace()))
        assert response.status_code == 202
        return json.loads(response.body)["id"]

    async def submit_as_before(self, path: str, body_json: str) -> str:
        """A job as the previous release stored it: its body alone (record format 1)."""
        job, _ = await self.store.submit(path, body_json, b"", 0)
        return job.id

    async def answered_at_once(self, path: str, fields: dict[str, Any]) -> dict[str, Any]:
        """The route's body for ``fields`` answered at once (not as a job)."""
        prepared = await self.routes[path].prepare(self.body(path, fields), "now")
        return json.loads(json.dumps(prepared.render(
            await self.replica.parts.lifecycle.infer(prepared.request))))

    def pull(self) -> None:
        self._pulling = asyncio.ensure_future(self.worker.run_forever())

    async def finished(self, job_id: str, timeout_s: float = 30.0) -> JobView:
        deadline = time.monotonic() + timeout_s
        while (job := await self.store.get(job_id)).status not in FINAL_STATUSES:
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.01)
        return job

    async def close(self) -> None:
        if self._pulling is not None:
            self._pulling.cancel()
            await asyncio.gather(self._pulling, return_exceptions=True)
        self.worker.close()
        await asyncio.sleep(0.05)  # cancelled jobs hand their leases back
        self.replica.close()


@pytest.fixture
async def store(redis_url):
    client = aioredis.from_url(redis_url)
    namespace = f"records-{uuid.uuid4().hex[:12]}"
    yield JobStore(client, namespace)
    keys = [key async for key in client.scan_iter(match=f"vramgate:{namespace}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


EMBEDDING = {"input": [words(3, 0), words(9, 1)], "encoding_format": "base64"}
COMPLETION = {"prompt": words(4, 2), "max_tokens": 6, "temperature": 0.0, "stop": ["zz"]}


async def test_a_job_runs_the_stored_request_and_answers_the_routes_body(store) -> None:
    parts = Parts(store)
    try:
        embed_id = await parts.submit(EMBED, EMBEDDING)
        complete_id = await parts.submit(COMPLETE, COMPLETION)
        stored = decode((await store.get(embed_id)).request)
        prepared = await parts.routes[EMBED].prepare(parts.body(EMBED, EMBEDDING), embed_id)
        # A job runs in the batch class unless it asked otherwise (Prefer: priority=...).
        assert stored == StoredJob(replace(prepared.request, priority=Priority.BATCH),
                                   prepared.render)
        assert stored.render == EmbeddingsBody(parts.replica.args.model.name, None, "base64")
        before = int(time.time())
        parts.pull()
        embedded, completed = [await parts.finished(i) for i in (embed_id, complete_id)]
        expected = [await parts.answered_at_once(path, fields)
                    for path, fields in ((EMBED, EMBEDDING), (COMPLETE, COMPLETION))]
    finally:
        await parts.close()
    assert embedded.to_body()["result"] == expected[0]
    result = completed.to_body()["result"]
    assert result["id"] == f"cmpl-{complete_id}"  # as the route names a job's response
    assert before <= result["created"] <= int(time.time())  # when the replica took it
    same = {key: expected[1][key] for key in ("object", "model", "choices", "usage")}
    assert {key: result[key] for key in same} == same
    assert (embedded.attempts, completed.attempts) == (1, 1)


async def test_a_job_stored_by_the_previous_release_is_rebuilt_and_runs(store) -> None:
    parts = Parts(store)
    try:
        old = await parts.submit_as_before(EMBED, json.dumps(EMBEDDING))
        polled = await parts.submit_as_before(EMBED, json.dumps(EMBEDDING))
        # Accepted by a release whose limits allowed 100 new tokens (62 now): it fails with
        # the route's 400, as the previous release's replica failed it.
        refused = await parts.submit_as_before(COMPLETE, json.dumps(
            {"prompt": "a b", "max_tokens": 100}))
        await parts.jobs.show(polled)  # a client polling it: rebuilt at once
        assert isinstance(decode((await store.get(polled)).request), StoredJob)
        assert await parts.jobs.rebuild_stored() == 2  # the other two
        assert await parts.jobs.rebuild_stored() == 0
        assert decode((await store.get(refused)).request) == StoredRefusal(
            _too_long().to_body(), 400)
        parts.pull()
        jobs = [await parts.finished(i) for i in (old, polled, refused)]
        expected = await parts.answered_at_once(EMBED, EMBEDDING)
    finally:
        await parts.close()
    assert [job.to_body()["result"] for job in jobs[:2]] == [expected, expected]
    assert (jobs[2].to_body()["error"], jobs[2].status_code) == (_too_long().to_body(), 400)


async def test_a_job_no_ingress_rebuilt_waits_then_fails_with_job_format(store) -> None:
    clock = FakeClock()
    parts = Parts(store, clock=clock)
    try:
        old = await parts.submit_as_before(EMBED, json.dumps(EMBEDDING))
        behind = await parts.submit(EMBED, EMBEDDING)
        parts.pull()
        await asyncio.sleep(0.3)  # many polls: the head waits to be rebuilt
        assert [(await store.get(i)).status for i in (old, behind)] == ["queued", "queued"]
        clock.advance(UNREADABLE_WAIT_S)
        failed, ran = await parts.finished(old), await parts.finished(behind)
    finally:
        await parts.close()
    error = failed.to_body()["error"]["error"]
    assert (failed.status_code, error["code"], error["type"]) == (500, "job_format",
                                                                  "internal_error")
    assert "submit it again" in error["message"]
    assert ran.status == "succeeded"


async def test_a_job_larger_than_the_whole_budget_fails_with_request_too_large(store) -> None:
    parts = Parts(store, budget_bytes=20 * PER_TOKEN_BYTES)
    try:
        # No replica has published a price yet, so the ingress cannot refuse it.
        job_id = await parts.submit(EMBED, {"input": words(30, 3)})
        parts.pull()
        job = await parts.finished(job_id)
        reserved = parts.replica.gate.budget.reserved_bytes
    finally:
        await parts.close()
    assert (job.status, job.status_code) == ("failed", 400)
    assert job.to_body()["error"]["error"] == {
        "message": "the job needs an estimated 32000 bytes of device memory, more than the "
                   "replica's whole budget of 20000 bytes",
        "type": "invalid_request_error", "code": "request_too_large"}
    assert reserved == 0


async def test_a_running_job_cancelled_stops_within_a_poll_and_gives_its_lease_back(
        store) -> None:
    """A job on the decode loop at 0.25 s per token would run 13 s; cancelled once it runs,
    it leaves the engine at its next step, is recorded ``cancelled`` without result, and
    the replica holds nothing; the job behind it then runs."""
    parts = Parts(store, continuous=True, latency_per_token_s=0.25)
    try:
        long_id = await parts.submit(COMPLETE, {"prompt": words(4, 2), "max_tokens": 50,
                                                "temperature": 0.0})
        behind = await parts.submit(COMPLETE, COMPLETION)
        parts.pull()
        while (await store.get(long_id)).status != "running":
            await asyncio.sleep(0.01)
        await parts.jobs.cancel(long_id)
        cancelled = await parts.finished(long_id, timeout_s=5.0)  # not after its 13 s
        ran = await parts.finished(behind)
        await asyncio.sleep(0.05)  # the decode loop lets go of the finished rows
        reserved, leases = (parts.replica.gate.budget.reserved_bytes,
                            parts.replica.gate.budget.active_leases)
    finally:
        await parts.close()
    assert (cancelled.status, cancelled.result_json, cancelled.attempts) == ("cancelled", None, 1)
    assert ran.status == "succeeded"
    assert (reserved, leases) == (0, 0)


class NothingQueued:
    """The figures of :class:`LosesTheCancellation`: an empty queue at time 0."""

    async def queued_count(self) -> int:
        return 0

    def now(self) -> float:
        return 0.0


class LosesTheCancellation:
    """A job store whose heartbeat, cancelled, returns as if it had finished (as a client
    call may when the cancellation comes as it completes); nothing is queued."""

    figures = NothingQueued()

    async def heartbeat(self, *args: Any) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass

    async def recover_orphans(self) -> list[str]:
        return []

    async def head(self) -> None:
        return None


async def test_a_worker_stops_when_cancelled_even_if_a_call_lost_the_cancellation() -> None:
    replica = SimpleNamespace(record_jobs_queued=lambda count: None,
                              metrics=SimpleNamespace(set=lambda name, value: None),
                              gate=SimpleNamespace(has_spare_room=lambda: True))
    worker = JobWorker(LosesTheCancellation(), replica, "w1",  # type: ignore[arg-type]
                       JobsConfig(poll_interval_s=30.0))
    pulling = asyncio.ensure_future(worker.run_forever())
    await asyncio.sleep(0.05)  # in its heartbeat
    pulling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(pulling, timeout=5.0)  # not after its 30 s pause
