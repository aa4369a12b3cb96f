"""vramgate under Ray Serve's throughput mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: the
ingress reaches the replicas over gRPC, user code on the replica's own loop): ``serve run``
with it set, as an operator sets it, on the fake engine.

Over gRPC a unary call is accepted only with its result, so an ingress that took that for
"a replica has it" refused every request that ran longer than ``admission.max_queue_wait_s``
(503 ``queue_timeout``): a completion of 2 s here, against a bound of 1 s.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.e2e.serve_process import RAY, config_file, serve_run
from tests.support import free_port, interrupt, wait_until_ready

NEW_TOKENS = 100
PASS_S = 0.02  # a decode step of the fake engine: a completion of NEW_TOKENS takes 2 s
# (the replica profiles passes at start-up: at 0.1 s a pass it took 209 s to start)


def test_long_requests_and_streams_under_rays_throughput_mode(tmp_path: Path) -> None:
    port = free_port()
    config = config_file(
        tmp_path, "configs/fake.yaml", port,
        fake={"latency_per_pass_s": PASS_S},
        admission={"max_queue_wait_s": 1.0},
        deployment={"num_replicas": 1, "num_gpus": 0})
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
           "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    base_url = f"http://127.0.0.1:{port}"
    process = serve_run(config, env, tmp_path / "serve.log")
    try:
        begun = time.monotonic()
        wait_until_ready(base_url, timeout_s=240, alive=lambda: process.poll() is None)
        print(f"\nready in {time.monotonic() - begun:.1f} s")
        with httpx.Client(base_url=base_url, timeout=60) as http:
            # first: the replica's published figures lag a completion just finished, and
            # this one's bound is 1 s (it would be refused by prediction)
            embedded = http.post("/v1/embeddings", json={"model": "fake", "input": ["a b"]})
            body = {"model": "fake", "prompt": "a b c", "max_tokens": NEW_TOKENS,
                    "temperature": 0}
            started = time.monotonic()
            answer = http.post("/v1/completions", json=body)
            took_s = time.monotonic() - started
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as sse:
                events = [line for line in sse.iter_lines() if line.startswith("data: ")]
        print(f"answered in {time.monotonic() - begun:.1f} s")
    except Exception:
        print((tmp_path / "serve.log").read_text()[-5000:])
        raise
    finally:
        interrupt(process, timeout_s=90)
        subprocess.run([str(RAY), "stop", "--force"], capture_output=True, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == NEW_TOKENS
    assert took_s > 1.0, "the completion ran within the queue bound: nothing was tested"
    assert sse.status_code == 200 and events[-1] == "data: [DONE]"
    assert len(events) > 3  # the pieces, the finish, [DONE]
    assert embedded.status_code == 200, embedded.text
    assert len(embedded.json()["data"]) == 1
