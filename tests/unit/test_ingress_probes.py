"""``HEAD`` is answered as ``GET`` without a body (load balancers and uptime monitors probe
with it): the ingress's own FastAPI app, built without Ray around a stand-in replica view."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from serve_app.config import PACKAGED_NAME, parse_args
from tests.ingress_parts import ingress_app


class StandInReplicas:
    """What ``/readyz`` reads of the model replicas: their published states."""

    def __init__(self) -> None:
        self.published: list[object] = []

    async def states(self) -> list[object]:
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
