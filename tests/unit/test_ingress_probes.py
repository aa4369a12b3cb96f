"""``HEAD`` is answered as ``GET`` without a body (load balancers and uptime monitors probe
with it): the ingress's own FastAPI app, built without Ray around a stand-in replica view.
And the probes answer at once while the ingress starts: it is constructed as Ray Serve
constructs it, with stand-ins for Ray's handles."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from deployments.http.ingress import Ingress
from deployments.http.served_models import ModelBinding
from serve_app.config import PACKAGED_NAME, parse_args
from tests.ingress_parts import ingress_app


class StandInReplicas:
    """What ``/readyz`` reads of the model replicas: their published states."""

    def __init__(self) -> None:
        self.published: list[object] = []

    async def states(self, max_wait_s: float | None = None) -> list[object]:
        return self.published


@pytest.fixture()
def ingress() -> Iterator[tuple[TestClient, StandInReplicas]]:
    args = parse_args({"model": {"task": "fake"}, "auth": {"api_key": "k"}})
    replicas = StandInReplicas()
    with TestClient(ingress_app(args, replicas)) as client:
        yield client, replicas


def test_head_probes_answer_as_get_without_a_body(ingress) -> None:
    client, replicas = ingress
    for path in ("/healthz", "/readyz"):
        assert client.head(path).status_code == client.get(path).status_code
    assert client.head("/readyz").status_code == 503  # no model replica has measured yet
    replicas.published.append(SimpleNamespace(model=PACKAGED_NAME))
    for path, status in (("/healthz", 200), ("/readyz", 200), ("/v1/models", 401)):
        got, head = client.get(path), client.head(path)
        assert head.status_code == got.status_code == status
        assert head.content == b"" and got.content
        assert head.headers["content-length"] == str(len(got.content))
        assert head.headers["content-type"] == got.headers["content-type"]


def test_head_on_a_post_route_is_405_and_the_schema_lists_get_only(ingress) -> None:
    client, _ = ingress
    refused = client.head("/v1/embeddings")
    assert (refused.status_code, refused.headers["allow"], refused.content) == (405, "POST", b"")
    methods = {method for item in client.get("/openapi.json").json()["paths"].values()
               for method in item}
    assert methods == {"get", "post"}


# --- start-up: the probes answer at once -----------------------------------------------------


class _Call:
    """One method of a Ray handle as the ingress calls it: ``.remote(...)``."""

    def __init__(self, answer) -> None:
        self.remote = answer


class SlowRegistry:
    """Ray's handle to the replica registry while its replica has not started: a
    ``snapshot`` waits until ``answering`` is set, then answers ``published``; what the
    ingress publishes is taken."""

    def __init__(self) -> None:
        self.answering = asyncio.Event()
        self.published: list[object] = []
        self.snapshot = _Call(self._snapshot)
        self.publish_metrics = _Call(self._take)

    async def _snapshot(self) -> list[object]:
        await self.answering.wait()
        return list(self.published)

    async def _take(self, *args: object) -> None:
        return None


INGRESS_CLASS = Ingress.func_or_class.__mro__[1]
"""The class under ``@serve.ingress``: Ray Serve's wrapper subclasses it."""


async def _started_ingress(raw: dict, registry: SlowRegistry) -> tuple[object, httpx.AsyncClient]:
    """An ingress of ``raw``'s one model, constructed as Ray Serve constructs it (its
    ``__init__`` must return within 2 s), and a client of its HTTP app."""
    ingress = object.__new__(Ingress.func_or_class)
    binding = ModelBinding(raw, handle=None)
    await asyncio.wait_for(INGRESS_CLASS.__init__(ingress, [binding], registry, None), timeout=2)
    transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
    return ingress, httpx.AsyncClient(transport=transport, base_url="http://ingress")


async def _probe(client: httpx.AsyncClient, path: str = "/readyz") -> httpx.Response:
    """A probe with a load balancer's 1 s timeout."""
    return await asyncio.wait_for(client.get(path), timeout=1)


async def test_probes_answer_while_the_ingress_still_opens_its_models() -> None:
    """Ray Serve routes to an ingress only once its constructor has returned; the ingress
    must therefore not wait in it for its models' job stores (here one that never answers,
    as the app's embedded Redis before its broker has started it) or tokenizers."""
    raw = {"model": {"task": "fake"}, "jobs": {"redis_url": "unix:///nonexistent/redis.sock"}}
    ingress, client = await _started_ingress(raw, SlowRegistry())
    try:
        async with client:
            assert (await _probe(client, "/healthz")).status_code == 200
            ready = await _probe(client)
            assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
            assert ready.json()["error"]["code"] == "starting"
            assert (await client.head("/readyz")).status_code == 503
            # Every other route waits for the models (as Ray Serve's proxy made it wait).
            models = asyncio.ensure_future(client.get("/v1/models"))
            await asyncio.sleep(0.2)
            assert not models.done()
            models.cancel()
    finally:
        INGRESS_CLASS.__del__(ingress)  # stops its background tasks


async def test_readyz_does_not_wait_for_a_registry_that_has_not_started() -> None:
    registry = SlowRegistry()
    ingress, client = await _started_ingress(
        {"model": {"task": "fake", "name": "fake"}, "jobs": {"enabled": False}}, registry)
    try:
        async with client:
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == "fake"
            started = time.monotonic()
            ready = await _probe(client)
            assert time.monotonic() - started < 0.9  # READYZ_WAIT_S, not the registry's start
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "no_replicas"
            registry.published.append(SimpleNamespace(model="fake"))
            registry.answering.set()
            await asyncio.sleep(0)  # the snapshot being fetched arrives
            ready = await _probe(client)
            assert (ready.status_code, ready.json()) == (200, {"status": "ready",
                                                               "replicas": 1})
            # The inference routes came with the engine, after the app was built: served,
            # and in the OpenAPI schema.
            paths = (await client.get("/openapi.json")).json()["paths"]
            assert {"/v1/embeddings", "/v1/completions", "/v1/chat/completions"} <= set(paths)
            assert (await client.get("/v1/embeddings")).status_code == 405  # POST only
    finally:
        INGRESS_CLASS.__del__(ingress)  # stops its background tasks
