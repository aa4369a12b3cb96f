"""A batch line's job key and the output or error line a finished job becomes."""

from __future__ import annotations

import json

from deployments.http.batch_lines import line_key, result_line
from deployments.http.idempotency_guard import checked_key
from serve_app.jobs.view import JobStatus, JobView


def _job(status: JobStatus, **fields) -> JobView:
    return JobView(id="job-1", route="/v1/embeddings", status=status, created_at=1.0,
                   attempts=1, price_bytes=10, request=b"", body_json="{}", **fields)


def test_a_line_key_is_a_valid_idempotency_key_whatever_the_custom_id():
    assert line_key("batch_1", "doc-7") == "batch:batch_1:doc-7"
    for custom_id in ("with space", "é", "x" * 512, "tab\t"):
        key = line_key("batch_1", custom_id)
        assert key.startswith("batch:batch_1:sha256:") and checked_key(key) == key
    assert line_key("b", "é") != line_key("b", "è")


def test_a_succeeded_job_is_an_output_line():
    body = {"object": "list", "data": []}
    line, failed = result_line("a", _job(JobStatus.SUCCEEDED, result_json=json.dumps(body)))
    assert not failed and line["custom_id"] == "a" and line["error"] is None
    assert line["response"] == {"status_code": 200, "request_id": "job-1", "body": body}
    assert line["id"].startswith("batch_req_")


def test_a_failed_cancelled_or_lost_job_is_an_error_line():
    error = {"error": {"message": "too long", "type": "invalid_request_error",
                       "code": "input"}}
    line, failed = result_line("a", _job(JobStatus.FAILED, error_json=json.dumps(error),
                                         status_code=400))
    assert failed and line["response"]["status_code"] == 400
    assert line["response"]["body"] == error
    assert line["error"] == {"code": "input", "message": "too long"}
    line, failed = result_line("b", _job(JobStatus.CANCELLED))
    assert failed and line["error"]["code"] == "batch_cancelled" and line["response"] is None
    line, failed = result_line("c", None)
    assert failed and line["error"]["code"] == "job_lost"


def test_a_queued_or_running_job_has_no_line_yet():
    assert result_line("a", _job(JobStatus.QUEUED)) is None
    assert result_line("a", _job(JobStatus.RUNNING)) is None
