"""A Batch API batch outlives ``serve run``: stopped with Ctrl-C mid-batch (Ray, the app and
its embedded Redis all go) and started again on the same config, the new ingress takes the
batch over from the records in the Redis's append-only file and completes it; every
``custom_id`` appears exactly once in the output, none in the error file."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import openai

from tests.e2e.serve_process import RAY, config_file, serve_run
from tests.integration.batch_client import batch_line, batch_results, started_batch, wait_batch
from tests.support import MiB, free_port, interrupt, wait_until_ready

LINES = 150


def _started(config: Path, env: dict[str, str], log: Path, base_url: str):
    process = serve_run(config, env, log)
    try:
        wait_until_ready(base_url, timeout_s=240, alive=lambda: process.poll() is None)
    except TimeoutError:
        interrupt(process)
        raise AssertionError(log.read_text()[-5000:]) from None
    return process


def test_a_batch_completes_across_serve_run_stopped_and_started_again(tmp_path: Path) -> None:
    port = free_port()
    # Lines priced 32 MiB, running 0.1 s each, three at a time: 150 lines take about 20 s.
    config = config_file(
        tmp_path, "configs/fake.yaml", port,
        fake={"latency_per_token_s": 0.005, "bytes_per_token": MiB},
        memory={"budget_bytes": 100 * MiB},
        limits={"max_inputs": 1, "max_input_tokens": 32},
        deployment={"num_replicas": 1, "num_gpus": 0},
        jobs={"data_dir": str(tmp_path / "jobs"), "batch_window": 8})
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray
    base_url = f"http://127.0.0.1:{port}"
    lines = [batch_line(f"s-{i}", {"input": f"serve run {i} " + "w " * 17})
             for i in range(LINES)]
    try:
        first = _started(config, env, tmp_path / "first.log", base_url)
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                           timeout=60) as sdk:
            batch, done = started_batch(sdk, lines, completed=20, timeout_s=120)
        stopped_at = time.monotonic()
        interrupt(first, timeout_s=90)
        second = _started(config, env, tmp_path / "second.log", base_url)
        try:
            with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                               timeout=60) as sdk:
                batch = wait_batch(sdk, batch.id, timeout_s=240)
                assert batch.status == "completed", batch
                output, errors = batch_results(sdk, batch)
        finally:
            interrupt(second, timeout_s=90)
    finally:
        subprocess.run([str(RAY), "stop", "--force"], capture_output=True, timeout=120)
    assert set(output) == {line["custom_id"] for line in lines} and not errors
    assert all(line["response"]["status_code"] == 200 for line in output.values())
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
    assert done < LINES, "the batch finished before serve run stopped: nothing was tested"
    print(f"\n{done} of {LINES} lines done when serve run was stopped; completed "
          f"{time.monotonic() - stopped_at:.0f} s after the stop")
