"""What a client sees for errors raised outside our own types: Starlette's 404s and 413s,
a job store that does not answer, a bug; and what a client that leaves a stream does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import pytest
from fastapi.testclient import TestClient
from ray.exceptions import TaskCancelledError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from deployments.http.http_errors import as_serve_app_error, error_response
from deployments.http.http_middleware import BodyLimitMiddleware
from serve_app.config import parse_args
from tests.ingress_parts import ingress_app


@pytest.mark.parametrize("exc", [RedisConnectionError("Error 111 connecting to unix socket"),
                                 RedisTimeoutError("Timeout reading from socket")])
def test_a_job_store_that_does_not_answer_is_a_503_to_retry(exc) -> None:
    response = error_response(as_serve_app_error(exc))
    assert response.status_code == 503
    assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == ("1", "1000")
    assert json.loads(response.body)["error"] == {
        "message": "the job store (Redis) does not answer; retry", "type": "overloaded",
        "code": "jobs_unavailable"}


def test_anything_unknown_is_a_500_that_names_nothing_inside(caplog) -> None:
    response = error_response(as_serve_app_error(KeyError("secret detail")))
    assert response.status_code == 500
    assert "secret" not in response.body.decode()
    assert "unexpected error" in caplog.text


@pytest.fixture(scope="module")
def fake_ingress() -> Iterator[TestClient]:
    """The ingress of the fake model (embeddings, completions and chat; no speech)."""
    args = parse_args({"model": {"task": "fake", "name": "fake"},
                       "limits": {"max_body_bytes": 1000}})
    with TestClient(ingress_app(args)) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/nonexistent", "/nope"])
def test_a_path_that_exists_nowhere_is_a_plain_404_not_found(fake_ingress, path) -> None:
    for response in (fake_ingress.post(path, json={"input": "x"}), fake_ingress.get(path)):
        assert response.status_code == 404
        assert response.json() == {"error": {
            "message": f"no such route: {path} (GET /openapi.json lists the routes)",
            "type": "invalid_request_error", "code": "not_found"}}


def test_a_route_no_model_here_serves_is_404_model_not_found_saying_so(fake_ingress) -> None:
    path = "/v1/audio/transcriptions"
    named = fake_ingress.post(path, json={"model": "fake"})
    other = fake_ingress.post(path, json={"model": "whisper"})
    unnamed = fake_ingress.post(path, files={"file": ("a.wav", b"RIFF")})
    assert {named.status_code, other.status_code, unnamed.status_code} == {404}
    tail = f"no model here serves {path} (GET /v1/models lists every model)"
    assert named.json()["error"] == {"message": f"model 'fake' does not serve {path}; {tail}",
                                     "type": "invalid_request_error",
                                     "code": "model_not_found"}
    assert other.json()["error"]["message"] == f"model 'whisper' is not served here; {tail}"
    assert unnamed.json()["error"]["message"] == tail
    assert path not in fake_ingress.get("/openapi.json").json()["paths"]


def test_a_body_over_the_limit_names_the_knob(fake_ingress) -> None:
    response = fake_ingress.post("/v1/embeddings", json={"input": "x" * 1000})
    assert response.status_code == 413
    assert response.json()["error"] == {
        "message": "the body exceeds limits.max_body_bytes = 1000 bytes",
        "type": "invalid_request_error", "code": "body_too_large"}


async def test_a_receive_that_ray_cancelled_ends_a_stream_as_a_disconnect() -> None:
    # When the client leaves, Ray Serve's proxy cancels the ingress's pull of the request's
    # messages: `receive` raises TaskCancelledError where Starlette listens for the
    # disconnect. It is one, not a bug (it was logged "unexpected error" with a traceback).
    sent: list[Message] = []
    asked, first_event_sent = 0, asyncio.Event()

    async def receive() -> Message:
        nonlocal asked
        asked += 1
        if asked == 1:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await first_event_sent.wait()  # the client leaves after the first event
        raise TaskCancelledError()

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            first_event_sent.set()

    async def events() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        await asyncio.Event().wait()  # a stream that would go on

    async def streaming(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the body
        await StreamingResponse(events())(scope, receive, send)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST",
             "path": "/v1/completions", "headers": []}
    await asyncio.wait_for(BodyLimitMiddleware(streaming, 1000)(scope, receive, send), 5)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b"data: 1\n\n"
