"""Waiting in the open (issue: "know your place while you wait, refuse early"): a streamed
request that waits hears its position as SSE comments; a client whose read timeout cannot be
met by the backlog is refused at once, with ``retry-after-ms``; a client that leaves a stream
half-way is counted as gone (``client_gone``), not logged as a bug."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray

from tests.support import MiB, fake_app_args, settled_scrape, total


@pytest.fixture(scope="module")
def app(deploy):
    # A completion of a ~5-token prompt and 20 new tokens is priced ~25 MiB and takes ~1.5 s
    # (longer than a publish period, so /v1/status sees every queue depth): the 40 MiB budget
    # runs one at a time; the others wait at the replica (not in Ray's handle queue:
    # max_ongoing_requests 32).
    return deploy(fake_app_args(
        fake={"latency_per_token_s": 0.07, "bytes_per_token": MiB},
        memory={"budget_bytes": 40 * MiB},
        limits={"max_inputs": 1, "max_input_tokens": 16, "max_tokens": 20},
        deployment={"max_ongoing_requests": 32},
        batching={"continuous": False, "enabled": False}))


BODY = {"model": "fake", "prompt": "one two three", "max_tokens": 20}


async def _queue_depth(http: httpx.AsyncClient, depth: int) -> None:
    deadline = time.monotonic() + 10
    while (await http.get("/v1/status")).json()["replicas"][0]["queue_depth"] < depth:
        assert time.monotonic() < deadline, "the requests never queued"
        await asyncio.sleep(0.05)


async def test_a_stream_queued_behind_three_hears_3_2_1_before_its_first_token(app):
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200  # warm
        ahead = [asyncio.ensure_future(http.post("/v1/completions", json=BODY))
                 for _ in range(4)]  # one runs, three wait
        await _queue_depth(http, 3)
        positions, first_token_at = [], None
        async with http.stream("POST", "/v1/completions",
                               json={**BODY, "stream": True}) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if match := re.fullmatch(r": queued position=(\d+)( eta_ms=\d+)?", line):
                    assert first_token_at is None
                    positions.append(int(match.group(1)))
                elif line.startswith("data: {") and first_token_at is None:
                    first_token_at = len(positions)
        assert [r.status_code for r in await asyncio.gather(*ahead)] == [200] * 4
    print(f"\npositions heard: {positions}")
    distinct = [p for i, p in enumerate(positions) if i == 0 or p != positions[i - 1]]
    assert distinct[:3] == [3, 2, 1], positions
    assert first_token_at == len(positions)
    app.check_invariants()


async def test_an_openai_client_with_timeout_2_is_refused_at_once_by_a_long_backlog(app):
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200  # a rate
        backlog = [asyncio.ensure_future(http.post("/v1/completions", json=BODY))
                   for _ in range(5)]  # ~1.5 s each, one at a time: ~7 s of work
        await _queue_depth(http, 3)
        client = openai.AsyncOpenAI(base_url=f"{app.base_url}/v1", api_key="unused",
                                    timeout=2, max_retries=0)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model="fake", prompt="hi", max_tokens=20)
        elapsed_s = time.monotonic() - started
        statuses = [r.status_code for r in await asyncio.gather(*backlog)]
    response = refused.value.response
    print(f"\nrefused in {elapsed_s * 1000:.0f} ms: {response.json()['error']['message']}; "
          f"retry-after-ms {response.headers['retry-after-ms']}")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "predicted_timeout"
    assert elapsed_s < 1.0
    assert int(response.headers["retry-after-ms"]) >= 1
    assert int(response.headers["retry-after"]) == -(-int(response.headers["retry-after-ms"])
                                                     // 1000) or \
        int(response.headers["retry-after"]) == 1
    assert statuses == [200] * 5
    app.check_invariants()


async def test_prefer_wait_0_runs_at_once_or_is_refused_at_once(app):
    # Zero means the client waits zero seconds (issue: "Prefer: wait=0 is read as no
    # limit"): served when nothing is ahead of it, else refused at arrival, never queued.
    no_wait = {"prefer": "wait=0"}
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:
        alone = await http.post("/v1/completions", json=BODY, headers=no_wait)
        assert alone.status_code == 200, alone.text
        backlog = [asyncio.ensure_future(http.post("/v1/completions", json=BODY))
                   for _ in range(2)]  # one runs, one waits
        await _queue_depth(http, 1)
        behind = await http.post("/v1/completions", json=BODY, headers=no_wait)
        read_timeout = await http.post("/v1/completions", json=BODY,
                                       headers={"x-stainless-read-timeout": "0.05"})
        statuses = [r.status_code for r in await asyncio.gather(*backlog)]
    for refused in (behind, read_timeout):
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "predicted_timeout"  # at arrival
        assert "x-queue-wait-ms" not in refused.headers  # it never waited in the queue
        assert int(refused.headers["retry-after-ms"]) >= 1
    assert statuses == [200] * 2
    app.check_invariants()


def _log_sizes(deployment: str) -> dict[Path, int]:
    """The sizes of the Ray Serve log files of ``deployment``'s replicas now."""
    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs/serve"
    return {path: path.stat().st_size for path in logs.glob(f"replica_*{deployment}*.log")}


def _written_since(sizes: dict[Path, int]) -> str:
    """What those replicas logged after ``sizes`` was taken."""
    text = ""
    for path, size in sizes.items():
        with path.open("rb") as log:
            log.seek(size)
            text += log.read().decode(errors="replace")
    return text


def _gone(samples: dict) -> float:
    return total(samples, "vramgate_admission_decisions_total", outcome="cancelled",
                 reason="client_gone")


async def test_clients_that_leave_mid_stream_are_counted_gone_not_logged_as_bugs(app):
    before = _gone(settled_scrape(app.base_url, _gone))
    ingress, replica = _log_sizes("Ingress"), _log_sizes("ModelServer")
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:
        for _ in range(20):  # each leaves after its first token, with ~19 still to come
            async with http.stream("POST", "/v1/completions",
                                   json={**BODY, "stream": True}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break
    after = _gone(settled_scrape(app.base_url, _gone))
    logged = _written_since(ingress) + _written_since(replica)
    assert after - before == 20
    assert "unexpected error" not in logged and "Traceback" not in logged, logged
    gone_lines = [line for line in logged.splitlines() if "request client gone:" in line]
    assert len(gone_lines) == 20 and all(line.startswith("INFO") for line in gone_lines)
    app.check_invariants()
