"""Under overload the ingress refuses by prediction before it reads the body: a request that
could not start in time whatever its body gets 503 ``predicted_timeout`` from its headers
alone (shown here with a body that is not even JSON). Keyed, asynchronous and
unauthenticated requests go the normal way. The ingress's FastAPI app, built without Ray,
with a real :class:`ModelClient` over a real :class:`ReplicaView` whose registry stand-in
publishes one replica's state."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from deployments.http.model_client import ModelClient
from deployments.http.replica_view import ReplicaView
from serve_app.admission.policy import BudgetPolicy
from serve_app.config import parse_args
from serve_app.memory.cost_model import CorrectedCostModel, FittedCostModel
from serve_app.metrics import ProcessMetrics
from serve_app.replica_state import DeviceFigures, GateFigures, ReplicaState
from tests.ingress_parts import PublishedRegistry, ingress_app

MiB = 1 << 20
BUDGET = 1000 * MiB
KEY = {"Authorization": "Bearer k"}
NOT_JSON = b"{this is not json"


def published_state(thread_wait_s: float) -> ReplicaState:
    """One replica of the model ``fake`` whose inference thread has ``thread_wait_s`` of
    passes to run (nothing leased, no drain rate yet)."""
    cost = CorrectedCostModel(FittedCostModel(("const", "batch_tokens"), (float(MiB), 1024.0),
                                              0.05)).published()
    gate = GateFigures(capacity=BUDGET, reserved_bytes=0, peak_reserved_bytes=0,
                       free_bytes=BUDGET, active_leases=0, queue_depth=0, queued_bytes=0,
                       charged_bytes_total=0, released_bytes_total=0, drain_bytes_per_s=None,
                       thread_wait_s=thread_wait_s)
    device = DeviceFigures(inferences_running=0, inferences_total=0, oom_count=0,
                           device_fault=None, cost_correction_factor=1.0, cost_corrections=0)
    return ReplicaState(replica_id="r", node_id="node", gpu_ids=(), num_gpus=0.0,
                        model="fake", task="fake", kinds=("embed", "generate"),
                        policy="budget", gate_units="bytes", memory={}, cost_model=cost,
                        gate=gate, device=device, budget_bytes=BUDGET,
                        measured_budget_bytes=BUDGET, budget_shrink_count=0,
                        budget_regrow_count=0)


@pytest.fixture()
def ingress() -> Iterator[tuple[TestClient, PublishedRegistry, ProcessMetrics]]:
    args = parse_args({"model": {"task": "fake", "name": "fake"}, "auth": {"api_key": "k"}})
    registry, metrics = PublishedRegistry(), ProcessMetrics("Ingress", "test", use_ray=False)
    # A clock that always moves on: every request reads what is published now.
    ticks = iter(range(0, 10**9, 10))
    replicas = ReplicaView(registry, BudgetPolicy, 10.0, model="fake",
                           clock=lambda: float(next(ticks)))
    client = ModelClient(None, replicas, args.admission.max_queue_wait_s, metrics)
    with TestClient(ingress_app(args, replicas, client=client, metrics=metrics)) as http:
        yield http, registry, metrics


def post(http: TestClient, **headers: str):
    return http.post("/v1/embeddings", content=NOT_JSON,
                     headers={**KEY, "Content-Type": "application/json", **headers})


def test_a_backlog_longer_than_the_client_waits_is_refused_before_the_body(ingress) -> None:
    http, registry, metrics = ingress
    registry.published = [published_state(thread_wait_s=5.0)]

    refused = post(http, **{"X-Stainless-Read-Timeout": "2"})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "predicted_timeout"
    assert "5 s" in refused.json()["error"]["message"]
    assert int(refused.headers["Retry-After"]) >= 3  # 5 s predicted - 2 s it may wait
    assert int(refused.headers["retry-after-ms"]) == 3000
    exposition = metrics.exposition()
    assert re.search(r'vramgate_admission_decisions_total\{[^}]*reason="predicted_timeout"'
                     r'[^}]*\} 1\.0', exposition)
    assert re.search(r'vramgate_http_requests_total\{[^}]*model="fake"[^}]*status="503"'
                     r'[^}]*\} 1\.0', exposition)

    # The body is read, and refused for what it is, when the request goes the normal way:
    assert post(http).status_code == 400  # no client limit: it may wait 10 s
    keyed = post(http, **{"X-Stainless-Read-Timeout": "2", "Idempotency-Key": "a"})
    assert keyed.status_code == 400 and keyed.json()["error"]["code"] == "invalid_json"
    assert post(http, **{"X-Stainless-Read-Timeout": "2",
                         "Prefer": "respond-async"}).status_code == 400
    unauthenticated = http.post("/v1/embeddings", json={"input": "hi"}, headers={
        "Authorization": "Bearer wrong", "X-Stainless-Read-Timeout": "2"})
    assert unauthenticated.status_code == 401  # not told about the load
    assert post(http, **{"X-Stainless-Read-Timeout": "9"}).status_code == 400  # waits 9 s

    # The backlog is gone: nothing is refused before the body.
    registry.published = [published_state(thread_wait_s=0.0)]
    assert post(http, **{"X-Stainless-Read-Timeout": "2"}).status_code == 400


def test_a_route_the_model_does_not_serve_is_left_to_fastapi(ingress) -> None:
    http, registry, _ = ingress
    registry.published = [published_state(thread_wait_s=5.0)]
    response = http.post("/v1/audio/transcriptions", content=NOT_JSON,
                         headers={**KEY, "X-Stainless-Read-Timeout": "2"})
    assert response.status_code == 404


def test_under_a_route_prefix_the_refusal_and_the_probes_see_the_routes_path(ingress) -> None:
    http, registry, _ = ingress
    registry.published = [published_state(thread_wait_s=5.0)]
    # Ray Serve under route_prefix /api: scope["root_path"] is /api, scope["path"] the
    # whole path (as uvicorn sets them)
    prefixed = TestClient(http.app, root_path="/api")
    refused = prefixed.post("/api/v1/embeddings", content=NOT_JSON, headers={
        **KEY, "Content-Type": "application/json", "X-Stainless-Read-Timeout": "2"})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "predicted_timeout"
    assert prefixed.get("/api/healthz").status_code == 200  # a probe needs no key there either


def test_a_tenant_is_refused_for_its_own_backlog_not_another_tenants() -> None:
    """``heavy`` has 100 budgets of requests queued on the replica, which drains one budget a
    second: its next request is refused before its body is read; ``light``'s goes the normal
    way (its share of the backlog ahead of it is a request of ``heavy``'s size at most), and
    both are told their tenant (``X-Tenant``)."""
    args = parse_args({"model": {"task": "fake", "name": "fake"}, "auth": {"tenants": [
        {"name": "heavy", "api_keys": ["kh"]}, {"name": "light", "api_keys": ["kl"]}]}})
    registry, metrics = PublishedRegistry(), ProcessMetrics("Ingress", "test", use_ray=False)
    ticks = iter(range(0, 10**9, 10))
    replicas = ReplicaView(registry, BudgetPolicy, 10.0, model="fake",
                           clock=lambda: float(next(ticks)))
    state = published_state(thread_wait_s=0.0)
    tenants = {"heavy": {"weight": 1.0, "waiting": 100, "queued_bytes": 100 * BUDGET,
                         "held_bytes": BUDGET, "served_byte_s": 1.0},
               "light": {"weight": 1.0, "waiting": 0, "queued_bytes": 0, "held_bytes": 0,
                         "served_byte_s": 0.0}}
    gate = dataclasses.replace(state.gate, reserved_bytes=BUDGET, free_bytes=0,
                               queue_depth=100, queued_bytes=100 * BUDGET,
                               drain_bytes_per_s=BUDGET, busy_drain_bytes_per_s=BUDGET,
                               tenants=tenants)
    registry.published = [dataclasses.replace(state, gate=gate)]
    client = ModelClient(None, replicas, args.admission.max_queue_wait_s, metrics)
    with TestClient(ingress_app(args, replicas, client=client, metrics=metrics)) as http:
        def send(key: str):
            return http.post("/v1/embeddings", content=NOT_JSON, headers={
                "Authorization": f"Bearer {key}", "Content-Type": "application/json"})

        heavy, light = send("kh"), send("kl")
    assert (heavy.status_code, heavy.json()["error"]["code"]) == (503, "predicted_timeout")
    assert (light.status_code, light.json()["error"]["code"]) == (400, "invalid_json")
    assert (heavy.headers["x-tenant"], light.headers["x-tenant"]) == ("heavy", "light")
