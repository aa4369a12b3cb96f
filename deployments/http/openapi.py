"""OpenAPI declarations of the ingress's routes (documentation only: the routes render their
responses themselves, so these describe the README's HTTP API;
tests/integration/test_openapi_fuzz.py holds the server to them)."""

from typing import Any

from serve_app.schemas import ErrorResponse, JobResponse

ERROR_MEANINGS = {
    400: "Invalid request (malformed JSON, failed validation, `request_too_large`).",
    401: "Missing or wrong API key (only when one is configured).",
    404: "Unknown model, or one that does not serve this route (`model_not_found`); unknown "
         "job, file or batch (`job_not_found`, `file_not_found`, `batch_not_found`).",
    413: "Body larger than `limits.max_body_bytes`, or a `/v1/files` upload larger than "
         "`jobs.batch_max_file_bytes` (`body_too_large`).",
    422: "Idempotency-Key reused with a different body (`idempotency_key_reused`).",
    429: "The request's tenant holds or waits for its whole quota (`tenant_quota`: "
         "`auth.tenants[].max_share` / `max_waiting`); retry after `Retry-After` seconds.",
    503: "Transient capacity refusal (`queue_full`, `queue_timeout`, `predicted_timeout`, "
         "`oom`, `no_replicas`, `draining`, `jobs_full`, `jobs_unavailable`); retry after "
         "`Retry-After` seconds (`retry-after-ms`: the same wait in milliseconds). Under a "
         "flood, Ray Serve's HTTP proxy answers 503 before the ingress sees the request, with "
         "`Retry-After` but a plain-text body (`deployment.ingress_max_queued_requests`).",
    504: "Inference ran longer than `admission.inference_timeout_s` (`inference_timeout`).",
}
INFERENCE_ERRORS = (400, 401, 404, 413, 422, 429, 503, 504)


def _header(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "required": True, "schema": schema}


_COUNT = {"type": "integer", "minimum": 0}
REQUEST_ID_HEADER = {"X-Request-Id": _header(
    "The request's `X-Request-Id`, or one generated for it.", {"type": "string"})}
ADMITTED_HEADERS = {
    "X-Queue-Wait-Ms": _header("Time spent waiting for admission, in ms.", _COUNT),
    "X-Queue-Position": _header("Requests ahead of this one when it was queued (0: admitted at "
                                "once).", _COUNT),
}
RETRY_AFTER_HEADER = {
    "Retry-After": _header("Whole seconds to wait before retrying.",
                           {"type": "integer", "minimum": 1}),
    "retry-after-ms": _header("The same wait in milliseconds, not rounded up (read first by "
                              "the OpenAI SDKs).", {"type": "integer", "minimum": 1})}
LOCATION_HEADER = {"Location": _header("The job: `/v1/jobs/{id}`.", {"type": "string"})}
INFERENCE_PARAMETERS = [
    {"name": "Idempotency-Key", "in": "header", "required": False,
     "description": "The same key with the same body within `idempotency.ttl_s` runs the model "
                    "once; with another body: 422. Not with `stream: true`.",
     "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"}},
    {"name": "X-Request-Id", "in": "header", "required": False,
     "description": "Echoed back; generated when absent.", "schema": {"type": "string"}},
    {"name": "Prefer", "in": "header", "required": False,
     "description": "RFC 7240: `wait=N` (seconds the client will wait; a longer predicted wait "
                    "is refused at once with 503 `predicted_timeout`), `respond-async` (run it "
                    "as a durable job: 202). Not `respond-async` with `stream: true`.",
     "schema": {"type": "string"}},
    {"name": "X-Stainless-Read-Timeout", "in": "header", "required": False,
     "description": "The OpenAI SDKs' read timeout, seconds: read as `Prefer: wait`.",
     "schema": {"type": "string"}},
]


def responses(ok: type, *errors: int, inference: bool = False,
               event_stream: str = "", ok_status: int = 200) -> dict[int | str, Any]:
    """OpenAPI ``responses`` of a route: ``ok_status`` (200) with the ``ok`` body (and, where
    ``event_stream`` describes one, a ``text/event-stream`` alternative), each listed error
    status in the OpenAI error shape, 503 with ``Retry-After``; an ``inference`` route's
    responses with their headers (``X-Request-Id``, ``X-Queue-Wait-Ms``,
    ``X-Queue-Position``), and its 202 job (``Prefer: respond-async``); a 202 with its
    ``Location``."""
    common = REQUEST_ID_HEADER if inference else {}
    declared: dict[int | str, Any] = {ok_status: {"model": ok}}
    if inference:
        declared[202] = {"model": JobResponse, "description": "`Prefer: respond-async`: "
                         "accepted as a durable job (`GET` its `Location`)."}
    if event_stream:  # one server-sent event, as FastAPI declares its own (`itemSchema`)
        declared[200]["content"] = {"text/event-stream": {"itemSchema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string", "description": event_stream}}}}}
    for status in errors:
        declared[status] = {"model": ErrorResponse, "description": ERROR_MEANINGS[status]}
    for status, response in declared.items():
        headers = {**common, **(ADMITTED_HEADERS if inference and status == 200 else {}),
                   **(RETRY_AFTER_HEADER if status == 503 else {}),
                   **(LOCATION_HEADER if status == 202 else {})}
        if headers:
            response["headers"] = headers
    return declared
