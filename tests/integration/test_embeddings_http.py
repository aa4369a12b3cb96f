"""The embeddings API over HTTP on a local Ray Serve: results, errors and headers."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import pytest

from tests.support import SENTENCES, cosine

ARGS = {
    "model": {"device": "cpu"},
    "memory": {"capacity_bytes": 2 << 30, "reserve_bytes": 0},
    "limits": {"max_inputs": 64, "max_input_tokens": 256, "max_body_bytes": 1 << 20},
    "admission": {"max_queue_len": 16},
}


@pytest.fixture(scope="module")
def app(deploy):
    return deploy(ARGS)


def test_three_sentences_give_unit_vectors_with_the_expected_similarity(client):
    response = client.post("/v1/embeddings", json={"input": SENTENCES})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
    vectors = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [len(v) for v in vectors] == [384, 384, 384]
    assert np.allclose(np.linalg.norm(np.array(vectors), axis=1), 1.0, atol=1e-5)
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.5
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 3 * 2
    assert response.headers["x-queue-position"] == "0"
    assert int(response.headers["x-queue-wait-ms"]) >= 0
    assert response.headers["x-request-id"]


def test_request_id_is_echoed(client):
    response = client.post("/v1/embeddings", json={"input": "hi"},
                           headers={"X-Request-Id": "req-123"})
    assert response.headers["x-request-id"] == "req-123"
    assert client.get("/healthz").headers["x-request-id"]


def test_openai_client_gets_the_same_vectors(app, client):
    raw = client.post("/v1/embeddings", json={"input": SENTENCES}).json()
    sdk = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0)
    result = sdk.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES)  # base64 on wire
    got = np.array([d.embedding for d in result.data])
    want = np.array([d["embedding"] for d in raw["data"]])
    assert got.shape == (3, 384)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert [m.id for m in sdk.models.list().data] == ["all-MiniLM-L6-v2"]


def test_base64_and_dimensions(client):
    body = client.post("/v1/embeddings", json={
        "input": "hello", "encoding_format": "base64", "dimensions": 64}).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (64,)
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"{bad", 400, "invalid_json"),
    (b'{"input": "\xff\xfe"}', 400, "invalid_json"),
    (json.dumps({"input": []}).encode(), 400, "input"),
    (json.dumps({"input": 5}).encode(), 400, "input"),
    (json.dumps({"input": ""}).encode(), 400, "input"),
    (json.dumps({"input": [1, "a"]}).encode(), 400, "input"),  # token ids mixed with text
    (json.dumps({"input": [[1], "a"]}).encode(), 400, "input"),
    (json.dumps({"input": [[]]}).encode(), 400, "input"),
    (json.dumps({"input": [-1]}).encode(), 400, "input"),
    (json.dumps({"input": [True]}).encode(), 400, "input"),
    (json.dumps({"input": [1.5]}).encode(), 400, "input"),
    (json.dumps({"input": [30522]}).encode(), 400, "input"),  # outside MiniLM's vocabulary
    (json.dumps({"input": [[2023]], "input_type": "query"}).encode(), 400, "input_type"),
    (json.dumps({"input": "x", "input_type": "nope"}).encode(), 400, "input_type"),
    (json.dumps({"input": "x", "truncate": "yes"}).encode(), 400, "truncate"),
    (json.dumps({}).encode(), 400, "input"),
    (json.dumps([1]).encode(), 400, "body"),
    (json.dumps({"input": "x", "bogus": 1}).encode(), 400, "bogus"),
    (json.dumps({"input": "x", "encoding_format": "int8"}).encode(), 400, "encoding_format"),
    (json.dumps({"input": "x", "dimensions": 0}).encode(), 400, "dimensions"),
    (json.dumps({"input": "x", "dimensions": 385}).encode(), 400, "dimensions"),
    (json.dumps({"input": "x", "dimensions": "8"}).encode(), 400, "dimensions"),
    (json.dumps({"input": "x", "dimensions": True}).encode(), 400, "dimensions"),
    (json.dumps({"input": ["ok", "\ud800"]}).encode(), 400, "input"),
    (json.dumps({"input": ["x"] * 65}).encode(), 400, "input"),
    (json.dumps({"input": "word " * 400}).encode(), 400, "input"),
    (json.dumps({"input": "x", "model": "gpt-4"}).encode(), 404, "model_not_found"),
])
def test_bad_requests_get_typed_errors(client, body, status, code):
    response = client.post("/v1/embeddings", content=body,
                           headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["type"] == ("invalid_request_error")
    assert "Traceback" not in error["message"]


def test_body_over_the_limit_is_413_with_or_without_content_length(client):
    big = json.dumps({"input": ["x" * 1000] * 2000}).encode()  # ~2 MB > 1 MiB limit
    declared = client.post("/v1/embeddings", content=big,
                           headers={"content-type": "application/json"})
    chunked = client.post("/v1/embeddings", content=iter([big[:500_000], big[500_000:]]),
                          headers={"content-type": "application/json"})
    for response in (declared, chunked):
        assert response.status_code == 413
        assert response.json()["error"] == {
            "message": "the body exceeds limits.max_body_bytes = 1048576 bytes",
            "type": "invalid_request_error", "code": "body_too_large"}


@pytest.mark.parametrize(("value", "what"), [
    (5, "a number"), (1.5, "a number"), (True, "a boolean"), (None, "null"),
    ({"text": "x"}, "an object"), ([], "an empty list")])
def test_an_input_of_the_wrong_type_is_told_its_type(client, value, what):
    response = client.post("/v1/embeddings", json={"input": value})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "input: input must be a string, a list of strings, a list of token ids or "
                   f"a list of lists of token ids, not {what}",
        "type": "invalid_request_error", "code": "input"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions",
                                  "/v1/audio/transcriptions"])
def test_a_route_no_model_here_serves_is_404_model_not_found_saying_so(client, path):
    named = client.post(path, json={"prompt": "hi", "model": "all-MiniLM-L6-v2"})
    unnamed = client.post(path, json={"prompt": "hi"})
    assert (named.status_code, unnamed.status_code) == (404, 404)
    assert named.json()["error"] == {
        "message": f"model 'all-MiniLM-L6-v2' does not serve {path}; no model here serves "
                   f"{path} (GET /v1/models lists every model)",
        "type": "invalid_request_error", "code": "model_not_found"}
    assert unnamed.json()["error"]["message"] == \
        f"no model here serves {path} (GET /v1/models lists every model)"
    assert path not in client.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize("path", ["/v1/nonexistent", "/nope"])
def test_a_path_that_exists_nowhere_is_a_plain_404_not_found(client, path):
    for response in (client.post(path, json={"input": "hi"}), client.get(path)):
        assert response.status_code == 404
        assert response.json()["error"] == {
            "message": f"no such route: {path} (GET /openapi.json lists the routes)",
            "type": "invalid_request_error", "code": "not_found"}


def test_a_wrong_method_is_405_listing_the_allowed_ones(client):
    response = client.request("TRACE", "/v1/embeddings")  # found by test_openapi_fuzz
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_status_and_probes(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    [replica] = client.get("/v1/status").json()["replicas"]
    assert replica["device"] == "cpu"
    assert replica["capacity_bytes"] == 2 << 30
    assert 0 < replica["held_bytes"] < replica["capacity_bytes"]
    expected = int((replica["capacity_bytes"] - replica["held_bytes"]) * 0.9)
    assert replica["budget_bytes"] == expected
    assert replica["max_request_bytes"] <= replica["budget_bytes"]
    profile = replica["profile"]
    assert profile["reused"] is False and profile["points"] >= 5
    assert profile["method"].startswith("host RSS")
    assert "batch_tokens" in profile["cost_model"]["features"]
    assert all(c >= 0 for c in profile["cost_model"]["coefficients"])


async def test_health_and_status_answer_while_the_model_is_busy(app):
    long_inputs = ["word " * 250] * 64  # the largest request the limits allow
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as http:
        busy = asyncio.create_task(http.post("/v1/embeddings", json={"input": long_inputs}))
        running = None
        for _ in range(200):  # bounded: until the replica reports the inference running
            status = (await http.get("/v1/status")).json()["replicas"][0]
            if status["inferences_running"]:
                running = status
                break
            await asyncio.sleep(0.05)
        assert running is not None, "the long inference was never seen running"
        health = await http.get("/healthz")
        assert health.status_code == 200
        assert not busy.done(), "healthz should answer while the inference is still running"
        assert (await busy).status_code == 200
    app.check_invariants()
