"""``st run`` (Schemathesis) against the ingress's own OpenAPI schema at ``/openapi.json``.

Every operation gets schema-valid and schema-violating requests (Schemathesis's ``coverage``
and ``fuzzing`` phases, ``mode = "all"``), the inference routes with and without their
``Idempotency-Key``/``X-Request-Id`` headers, while the fake engine throws an out-of-memory
error at one inference in ten. Nothing a client sends may yield a 500, a 5xx that the README
does not document (503 with ``Retry-After`` and 504 are), an undeclared status, content type or
missing declared header, a body that does not match the schema declared for its status, an
error outside the OpenAI error shape or a traceback (``schemathesis_hooks.py``); every
schema-violating request is refused and every undeclared method gets 405 with ``Allow``.

Run through the CLI rather than ``schemathesis.pytest.from_fixture``: the lazy pytest loader
of Schemathesis 4.32 reads ``Node._nodeid``, which pytest 9.2 no longer has.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import MiB, fake_app_args

HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
# Test cases per operation in each phase (the coverage phase adds its own boundary cases): the
# run (about 350 requests) takes about 6 s on 2 cores.
MAX_EXAMPLES = 50
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "unsupported_method",
    "allow_header_conformance",
    "contract_errors",  # schemathesis_hooks.py
]
# Not checked: positive_data_acceptance (a schema-valid request may be refused by limits the
# schema does not know: `limits.max_tokens`, `limits.max_inputs`, the model's name and
# dimensions, the budget; and by JSON Schema an `integer` may be written 16.0), and the checks
# for authentication and stateful resources, which this API has not.

CONFIG = f"""
hooks = {json.dumps(str(HOOKS))}
request-timeout = 30

[generation]
mode = "all"
max-examples = {MAX_EXAMPLES}
database = "none"

[phases.stateful]
enabled = false

[checks.not_a_server_error]
# README's error table: 503 (with Retry-After) and 504 are documented outcomes; a 500 never is.
expected-statuses = ["2xx", "3xx", "4xx", "503", "504"]
"""


@pytest.fixture(scope="module")
def app(deploy):
    # The fake engine serves both /v1/embeddings and /v1/completions. Small limits, so that
    # generated requests reach both the model and the limit checks; injected OOMs for 503s.
    return deploy(fake_app_args(
        fake={"oom_probability": 0.1, "bytes_per_token": MiB},
        limits={"max_inputs": 8, "max_input_tokens": 64, "max_tokens": 32},
        admission={"max_queue_len": 64, "max_queue_wait_s": 10, "inference_timeout_s": 10}))


def test_the_schema_declares_every_route(app):
    spec = httpx.get(f"{app.base_url}/openapi.json", timeout=10).json()
    operations = {(method.upper(), path) for path, item in spec["paths"].items()
                  for method in item}
    assert operations == {("POST", "/v1/embeddings"), ("POST", "/v1/completions"),
                          ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                          ("GET", "/v1/status"), ("GET", "/metrics"), ("GET", "/healthz"),
                          ("GET", "/readyz"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/{job_id}"),
                          ("DELETE", "/v1/jobs/{job_id}"), ("POST", "/v1/files"),
                          ("GET", "/v1/files"), ("GET", "/v1/files/{file_id}"),
                          ("DELETE", "/v1/files/{file_id}"),
                          ("GET", "/v1/files/{file_id}/content"), ("POST", "/v1/batches"),
                          ("GET", "/v1/batches"), ("GET", "/v1/batches/{batch_id}"),
                          ("POST", "/v1/batches/{batch_id}/cancel")}


def test_schemathesis_finds_no_server_error_and_no_nonconformance(app, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
               f"{app.base_url}/openapi.json", "--checks", ",".join(CHECKS),
               "--phases", "coverage,fuzzing", "--continue-on-failure",
               # One worker: Schemathesis's workers are threads, and CPython 3.11.7 raised
               # a spurious "SystemError: AST constructor recursion depth mismatch" in CI
               # from Hypothesis's ast.parse (describing a filter) with two of them, an
               # error reported of threaded programs (python/cpython#106905). With one, the
               # operations with a string path parameter (a job, file or batch id), which
               # failed inside Hypothesis in the same way and were excluded, pass too.
               "--workers", "1",
               "--no-color", "--report", "json", "--report-json-path", str(report)]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
    summary = json.loads(report.read_text())
    assert summary["operations"]["tested"] == 20, summary  # every operation
    assert summary["test_cases"]["generated"] >= 250, summary
    assert summary["failures"] == [] and summary["errors"] == [], summary
    app.check_invariants()  # and the fuzzing left nothing leased or queued behind
