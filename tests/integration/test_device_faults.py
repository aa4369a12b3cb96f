"""A non-OOM CUDA error, or an inference stuck far past its timeout, makes the replica fail its
health check; Ray Serve replaces it. Clients get 503/504, never a hang or a 500."""

from __future__ import annotations

import time

import httpx

from tests.support import fake_app_args


def _replica_ids(base_url: str) -> set[str]:
    return {r["replica_id"] for r in httpx.get(f"{base_url}/v1/status").json()["replicas"]}


def _wait_for_a_new_replica(base_url: str, old: set[str], timeout_s: float = 90) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = _replica_ids(base_url)
        if ids and not ids & old:
            return ids
        time.sleep(0.5)
    raise AssertionError(f"replica {old} was not replaced within {timeout_s} s")


def fake_args(admission: dict | None = None, **fake) -> dict:
    return fake_app_args(fake=fake, admission=admission or {},
                         limits={"max_inputs": 1, "max_input_tokens": 16, "max_tokens": 4},
                         deployment={"health_check_period_s": 1, "health_check_timeout_s": 5})


def test_a_device_fault_is_503_and_the_replica_is_replaced(deploy):
    app = deploy(fake_args(cuda_error_probability=1.0))
    old = _replica_ids(app.base_url)
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        faulted = http.post("/v1/embeddings", json={"input": "a b"})
        assert faulted.status_code == 503, faulted.text
        assert faulted.json()["error"]["code"] == "draining"
        assert int(faulted.headers["retry-after"]) >= 1
        refused = http.post("/v1/embeddings", json={"input": "a b"})
        assert refused.status_code == 503  # no admission after the fault
    _wait_for_a_new_replica(app.base_url, old)


def test_a_stuck_inference_gets_504_and_the_replica_is_replaced(deploy):
    app = deploy(fake_args({"inference_timeout_s": 1.0, "stuck_after_timeouts": 2,
                            "max_queue_wait_s": 2.0}, hang_probability=1.0, hang_s=600))
    old = _replica_ids(app.base_url)
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        started = time.monotonic()
        stuck = http.post("/v1/embeddings", json={"input": "a b"})
        assert stuck.status_code == 504, stuck.text
        waiting = http.post("/v1/embeddings", json={"input": "a b"})  # behind the stuck one
        # Never longer than max_queue_wait_s + inference_timeout_s (+ slack for the HTTP hops).
        assert time.monotonic() - started < 1.0 + 2.0 + 1.0 + 2.0
        assert waiting.status_code in (503, 504), waiting.text
    _wait_for_a_new_replica(app.base_url, old)
