"""Structured request logs: under ``logging.encoding: JSON`` a request leaves one JSON line at
each of its four moments, with its request id, estimated bytes, queue wait, replica and a
memory snapshot, in the model replica's Ray Serve log file; a refused request leaves an INFO
``refused`` line there, never Ray Serve's ``ERROR ... Request failed.`` with a traceback."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import ray

from tests.support import MiB, fake_app_args


def _json_lines_with(request_id: str) -> list[dict]:
    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs/serve"
    found = []
    for path in logs.glob("replica_*ModelServer*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if request_id in line and line.startswith("{"):
                found.append(json.loads(line))
    return found


def _lines_once(request_id: str, done) -> list[dict]:
    """The replica's JSON lines of ``request_id`` once ``done(lines)`` (bounded: 10 s)."""
    deadline = time.monotonic() + 10
    while not done(lines := _json_lines_with(request_id)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return lines


@pytest.fixture(scope="module")
def app(deploy):
    # A budget of 40 MiB: the largest request (2 inputs x 16 tokens = 32 MiB, 3.2 s at 0.1 s
    # a token: longer than /v1/status takes to show it, a publish period) leaves no room for
    # a second of 10 MiB, which waits max_queue_wait_s (0.5 s) and is refused 503
    # queue_timeout by the replica (nothing is refused by prediction).
    return deploy(fake_app_args(fake={"bytes_per_token": MiB, "latency_per_token_s": 0.1},
                                memory={"budget_bytes": 40 * MiB},
                                limits={"max_inputs": 2, "max_input_tokens": 16,
                                        "max_tokens": 4},
                                admission={"max_queue_wait_s": 0.5,
                                           "refuse_predicted_waits": False},
                                batching={"pad_to_multiple_of": 1},  # priced exactly
                                logging={"encoding": "JSON"}))


def test_a_request_logs_its_four_moments_as_json(app):
    request_id = f"log-test-{uuid.uuid4()}"
    response = httpx.post(f"{app.base_url}/v1/embeddings", json={"input": ["a b c", "d"]},
                          headers={"X-Request-Id": request_id}, timeout=30)
    assert response.status_code == 200, response.text
    lines = _lines_once(request_id, lambda lines: len(lines) >= 4)
    events = {line["event"]: line for line in lines if "event" in line}
    assert set(events) == {"arrived", "admitted", "finished", "lease released"}, lines
    for line in events.values():
        assert line["request_id"] == request_id
        # 2 inputs padded to 5 tokens; the fitted price rounds up (ceil), never down.
        assert 0 <= line["estimated_bytes"] - 2 * 5 * MiB <= 1
        assert line["replica"] and line["device_allocated_bytes"] >= 0
        assert line["host_resident_bytes"] > 0
    assert events["admitted"]["queue_wait_s"] >= 0
    assert events["finished"]["outcome"] == "ok"
    assert events["finished"]["peak_bytes"] == 2 * 5 * MiB  # measured == priced: exact fake
    assert events["lease released"]["ran"] is True


def test_a_refusal_is_an_info_line_of_the_request_log_not_a_failed_request(app):
    long = " ".join(["w"] * 14)  # 16 tokens with the two special ones
    blocker: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: blocker.append(httpx.post(
        f"{app.base_url}/v1/embeddings", json={"input": [long, long]}, timeout=30)))
    thread.start()
    deadline = time.monotonic() + 10
    while httpx.get(f"{app.base_url}/v1/status").json()["replicas"][0]["reserved_bytes"] \
            < 32 * MiB:
        assert time.monotonic() < deadline, "the large request never ran"
        time.sleep(0.02)
    request_id = f"refusal-test-{uuid.uuid4()}"
    refused = httpx.post(f"{app.base_url}/v1/embeddings", json={"input": ["a b c", "d"]},
                         headers={"X-Request-Id": request_id}, timeout=30)
    thread.join()
    assert [r.status_code for r in blocker] == [200]
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("overloaded", "queue_timeout")
    assert error["message"].startswith("waited 0.5 s")
    assert int(refused.headers["retry-after"]) >= 1
    lines = _lines_once(request_id, lambda lines: any(
        line.get("event") == "refused" for line in lines))
    [line] = [line for line in lines if line.get("event") == "refused"]
    assert (line["levelname"], line["code"], line["status"]) == ("INFO", "queue_timeout", 503)
    assert 0 <= line["estimated_bytes"] - 2 * 5 * MiB <= 1
    # Ray Serve logs a failed call before its error goes back: the lines are all there.
    assert [line["message"] for line in lines if line["levelname"] != "INFO"] == []
    assert not any("Request failed" in line["message"] for line in lines)
    app.check_invariants()
