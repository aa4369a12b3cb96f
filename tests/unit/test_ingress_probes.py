"""``HEAD`` is answered as ``GET`` without a body (load balancers and uptime monitors probe
with it): the ingress's own FastAPI app, built without Ray around a stand-in replica view."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from deployments.engines.registry import engine_class
from deployments.ingress import Ingress
from deployments.routes import ROUTES, RouteContext
from deployments.served_models import ModelFront, ServedModels
from serve_app.config import PACKAGED_NAME, parse_args
from serve_app.metrics import ProcessMetrics


class StandInReplicas:
    """What ``/readyz`` reads of the model replicas: their published states."""

    def __init__(self) -> None:
        self.published: list[object] = []

    async def states(self) -> list[object]:
        return self.published


@pytest.fixture()
def ingress() -> Iterator[tuple[TestClient, StandInReplicas]]:
    args = parse_args({"model": {"task": "fake"}, "auth": {"api_key": "k"}})
    replica = object.__new__(Ingress.func_or_class)  # no Ray: the parts the routes read
    replicas = StandInReplicas()
    engine = engine_class(args)
    replica._models = ServedModels()
    context = RouteContext(args, None, None, None, None, replica._models)
    routes = {R.path: R(context) for R in ROUTES if R.kind in engine.kinds}
    replica._models.add(ModelFront(args, engine, None, replicas, None, routes, None))
    replica._args, replica._jobs = args, None
    replica._metrics = ProcessMetrics("Ingress", "test", use_ray=False)
    with TestClient(replica.__serve_build_asgi_app__()) as client:
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
