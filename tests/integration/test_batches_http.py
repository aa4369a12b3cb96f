"""OpenAI's Batch API end to end, through the official ``openai`` client unchanged: a JSONL
file uploaded (``files.create(purpose="batch")``), a batch created, polled to ``completed``,
its output downloaded (``files.content``): the same answers as the same requests answered at
once, every ``custom_id`` exactly once across the output and error files. Bad files and
lines are refused at the right step (upload, or the batch's validation) while the service
keeps serving, and lines for another url or an unserved model become error lines; a cancel
keeps the finished lines; a batch survives its app being deleted and deployed again mid-run
(its state in the embedded Redis's append-only file), and its Redis killed mid-run."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from ray import serve

from tests.integration.batch_client import (
    batch_line,
    batch_results,
    create_batch,
    jsonl,
    run_batch,
    started_batch,
    wait_batch,
)
from tests.support import fake_app_args

ARGS = fake_app_args(
    # 1 ms per token: a 40-token line takes 40 ms, a batch of 150 seconds.
    fake={"latency_per_token_s": 0.001},
    limits={"max_inputs": 1, "max_input_tokens": 64, "max_tokens": 16},
    # Two ingresses: each may take a batch; its lock makes one drive it.
    deployment={"ingress_replicas": 2},
    jobs={"batch_max_file_bytes": 256 * 1024, "batch_max_lines": 1000, "batch_window": 16,
          "poll_interval_s": 0.05})


@pytest.fixture(scope="module")
def app(deploy):
    return deploy(ARGS)


@pytest.fixture()
def sdk(app):
    with openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as sdk:
        yield sdk


def test_an_embeddings_batch_equals_the_requests_answered_at_once(sdk):
    inputs = {f"emb-{i}": f"batch sentence {i} " + "w " * (i % 7) for i in range(48)}
    batch = run_batch(sdk, [batch_line(cid, {"model": "fake", "input": text})
                       for cid, text in inputs.items()])
    assert batch.status == "completed", batch.errors
    assert batch.error_file_id is None
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (48, 48, 0)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    output, errors = batch_results(sdk, batch)
    assert set(output) == set(inputs) and not errors
    for cid, text in inputs.items():
        direct = sdk.embeddings.create(model="fake", input=text).data[0].embedding
        line = output[cid]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["data"][0]["embedding"] == pytest.approx(
            direct, abs=1e-6)


def test_a_completions_batch_equals_greedy_answers_at_once(sdk):
    prompts = {f"cmp-{i}": f"tell me about number {i}" for i in range(10)}
    body = {"model": "fake", "max_tokens": 8, "temperature": 0}
    batch = run_batch(sdk, [batch_line(cid, {**body, "prompt": p}, url="/v1/completions")
                       for cid, p in prompts.items()], endpoint="/v1/completions")
    assert batch.status == "completed", batch.errors
    output, errors = batch_results(sdk, batch)
    assert set(output) == set(prompts) and not errors
    for cid, prompt in prompts.items():
        direct = sdk.completions.create(prompt=prompt, **body).choices[0].text
        assert output[cid]["response"]["body"]["choices"][0]["text"] == direct


def _refused_upload(sdk: openai.OpenAI, data: bytes) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as refused:
        sdk.files.create(file=("bad.jsonl", data), purpose="batch")
    return refused.value


def test_bad_files_are_refused_at_upload_and_the_service_keeps_serving(sdk, app):
    not_jsonl = _refused_upload(sdk, b'{"custom_id": "a"}\nthis is not json\n')
    assert (not_jsonl.status_code, not_jsonl.body["code"]) == (400, "invalid_jsonl")
    assert "line 2" in not_jsonl.body["message"]
    too_large = _refused_upload(sdk, b'{"pad": "' + b"x" * 300_000 + b'"}\n')
    assert (too_large.status_code, too_large.body["code"]) == (413, "body_too_large")
    too_many = _refused_upload(sdk, b'{"a": 1}\n' * 1001)
    assert (too_many.status_code, too_many.body["code"]) == (400, "too_many_lines")
    with httpx.Client(base_url=app.base_url) as http:
        purpose = http.post("/v1/files", data={"purpose": "fine-tune"},
                            files={"file": ("f.jsonl", b'{"a": 1}\n')})
        assert (purpose.status_code, purpose.json()["error"]["code"]) == (
            400, "invalid_purpose")
        # A body over the limit with no Content-Length (chunked): refused while streaming.
        head = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="f"\r\n'
                b"Content-Type: application/jsonl\r\n\r\n")
        chunked = http.post("/v1/files", content=iter([head, *[b"x" * 100_000] * 4]),
                            headers={"content-type": "multipart/form-data; boundary=b"})
        assert (chunked.status_code, chunked.json()["error"]["code"]) == (
            413, "body_too_large")
        missing = http.get("/v1/files/file-nope")
        assert (missing.status_code, missing.json()["error"]["code"]) == (
            404, "file_not_found")
        assert http.get("/v1/batches/batch_nope").status_code == 404
    assert sdk.embeddings.create(model="fake", input="still serving").data


@pytest.mark.parametrize(("bad", "code", "param"), [
    (batch_line("b", {"input": "x"}, colour="red"), "colour", "colour"),
    (batch_line("a", {"input": "x"}), "duplicate_custom_id", "custom_id"),
    (batch_line("b", {"input": []}), "input", "input"),
])
def test_a_bad_line_fails_the_batch_naming_the_line(sdk, bad, code, param):
    lines = [batch_line("a", {"input": "fine"}), bad, batch_line("c", {"input": "fine too"})]
    batch = run_batch(sdk, lines)
    assert batch.status == "failed" and batch.failed_at
    assert batch.output_file_id is None and batch.request_counts.completed == 0
    [error] = batch.errors.data
    assert (error.line, error.code, error.param) == (2, code, param), error
    assert sdk.embeddings.create(model="fake", input="still serving").data


def test_lines_for_another_url_or_an_unserved_model_are_error_lines(sdk):
    """Well-formed lines that are not for this batch (another route, a model not served)
    are not a malformed file: each gets an error line with the route's code, and the batch
    runs the others to ``completed``."""
    lines = [batch_line("a", {"input": "fine"}),
             batch_line("u", {"input": "x"}, url="/v1/completions"),
             batch_line("m", {"input": "x", "model": "nope"}),
             batch_line("c", {"input": "fine too"})]
    batch = run_batch(sdk, lines)
    assert batch.status == "completed" and batch.errors is None
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (4, 2, 2)
    output, errors = batch_results(sdk, batch)
    assert set(output) == {"a", "c"}
    assert {cid: line["error"]["code"] for cid, line in errors.items()} == {
        "u": "invalid_url", "m": "model_not_found"}
    assert errors["u"]["response"] is None and "/v1/completions" in errors["u"]["error"][
        "message"]


def test_cancel_keeps_finished_lines_and_gives_the_rest_errors(sdk):
    lines = [batch_line(f"c-{i}", {"input": f"cancel me {i} " + "w " * 30}) for i in range(200)]
    batch = create_batch(sdk, lines)
    deadline = time.monotonic() + 60
    while sdk.batches.retrieve(batch.id).request_counts.completed < 5:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled", "completed")
    batch = wait_batch(sdk, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.cancelling_at
    output, errors = batch_results(sdk, batch)
    assert set(output) | set(errors) == {line["custom_id"] for line in lines}
    assert len(output) >= 5 and len(errors) > 0, (len(output), len(errors))
    assert {line["error"]["code"] for line in errors.values()} == {"batch_cancelled"}
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (200, len(output), len(errors))


def test_files_and_batches_list_and_delete(sdk, app):
    file = sdk.files.create(file=("list.jsonl", jsonl([batch_line("x", {"input": "y"})])),
                            purpose="batch")
    assert file.id in [f.id for f in sdk.files.list()]
    assert sdk.files.retrieve(file.id).filename == "list.jsonl"
    assert sdk.files.content(file.id).content == jsonl([batch_line("x", {"input": "y"})])
    made = [sdk.batches.create(input_file_id=file.id, endpoint="/v1/embeddings",
                               completion_window="24h").id for _ in range(3)]
    page = sdk.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    after = sdk.batches.list(limit=1, after=made[1])
    assert [b.id for b in after.data] == [made[0]]
    for batch_id in made:
        assert wait_batch(sdk, batch_id).status == "completed"
    assert sdk.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(file.id)
    with httpx.Client(base_url=app.base_url) as http:
        unknown = http.post("/v1/batches", json={"input_file_id": "file-nope",
                                                 "endpoint": "/v1/embeddings",
                                                 "completion_window": "24h"})
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (
            404, "file_not_found")


def test_a_batch_survives_its_app_deleted_and_deployed_again(sdk, app, deploy):
    lines = [batch_line(f"r-{i}", {"input": f"restart {i} " + "w " * 40}) for i in range(150)]
    batch, done = started_batch(sdk, lines, completed=10)
    serve.delete(app.name)  # the app and its Redis go; the append-only file stays
    app = deploy(ARGS)
    with openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as again:
        batch = wait_batch(again, batch.id, timeout_s=180)
        assert batch.status == "completed", batch
        output, errors = batch_results(again, batch)
    assert set(output) == {line["custom_id"] for line in lines} and not errors
    assert done < 150, "the batch finished before the restart: nothing was tested"
    print(f"\n{done} of 150 lines done before the restart")


def test_a_batch_survives_its_redis_killed_mid_run(sdk, app):
    """The embedded Redis killed (SIGKILL) while a batch runs: the broker starts it again on
    its append-only file, the driver picks the batch up from its records, and every line is
    answered exactly once, none in the error file."""
    lines = [batch_line(f"k-{i}", {"input": f"redis {i} " + "w " * 40}) for i in range(150)]
    batch, done = started_batch(sdk, lines, completed=10)
    pid_path = Path(app.args["jobs"]["data_dir"]) / "fake" / "redis.pid"
    killed_pid = int(pid_path.read_text())
    os.kill(killed_pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:  # while the Redis is down the routes answer 503 jobs_unavailable
        try:
            batch = wait_batch(sdk, batch.id, timeout_s=180)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.body["code"] == "jobs_unavailable", exc
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert batch.status == "completed", batch
    output, errors = batch_results(sdk, batch)
    assert set(output) == {line["custom_id"] for line in lines} and not errors
    assert int(pid_path.read_text()) != killed_pid
    assert done < 150, "the batch finished before the kill: nothing was tested"
    print(f"\n{done} of 150 lines done before the kill")


def test_a_thousand_line_batch_equals_the_requests_answered_at_once(sdk):
    """The issue's scale: 1,000 embeddings lines, each answered once and equal (within 1e-6)
    to the same request answered at once, in a time the test prints (the fake engine: the
    job path's own overhead)."""
    inputs = {f"k-{i}": f"line {i} of a thousand " + "w " * (i % 11) for i in range(1000)}
    started = time.monotonic()
    batch = run_batch(sdk, [batch_line(cid, {"input": text}) for cid, text in inputs.items()],
                      timeout_s=300)
    took_s = time.monotonic() - started
    assert batch.status == "completed", batch.errors
    output, errors = batch_results(sdk, batch)
    assert set(output) == set(inputs) and not errors
    with ThreadPoolExecutor(8) as pool:
        direct = dict(zip(inputs, pool.map(
            lambda text: sdk.embeddings.create(model="fake", input=text).data[0].embedding,
            inputs.values()), strict=True))
    for cid, vector in direct.items():
        line = output[cid]["response"]
        assert line["status_code"] == 200
        assert line["body"]["data"][0]["embedding"] == pytest.approx(vector, abs=1e-6), cid
    assert len({tuple(v) for v in direct.values()}) > 900, "vectors barely differ"
    print(f"\n1000 lines in {took_s:.1f} s")
