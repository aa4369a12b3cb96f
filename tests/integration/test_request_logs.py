"""Structured request logs: under ``logging.encoding: JSON`` a request leaves one JSON line at
each of its four moments, with its request id, estimated bytes, queue wait, replica and a
memory snapshot, in the model replica's Ray Serve log file."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
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


def test_a_request_logs_its_four_moments_as_json(deploy):
    app = deploy(fake_app_args(fake={"bytes_per_token": MiB},
                               limits={"max_inputs": 2, "max_input_tokens": 16, "max_tokens": 4},
                               batching={"pad_to_multiple_of": 1},  # priced exactly
                               logging={"encoding": "JSON"}))
    request_id = f"log-test-{uuid.uuid4()}"
    response = httpx.post(f"{app.base_url}/v1/embeddings", json={"input": ["a b c", "d"]},
                          headers={"X-Request-Id": request_id}, timeout=30)
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10
    while len(lines := _json_lines_with(request_id)) < 4 and time.monotonic() < deadline:
        time.sleep(0.25)
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
