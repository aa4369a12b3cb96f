"""What a client sees for errors raised outside our own types."""

from __future__ import annotations

import json

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from deployments.http_errors import as_serve_app_error, error_response


@pytest.mark.parametrize("exc", [RedisConnectionError("Error 111 connecting to unix socket"),
                                 RedisTimeoutError("Timeout reading from socket")])
def test_a_job_store_that_does_not_answer_is_a_503_to_retry(exc) -> None:
    response = error_response(as_serve_app_error(exc))
    assert response.status_code == 503
    assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == ("1", "1000")
    assert json.loads(response.body)["error"] == {
        "message": "the job store (Redis) does not answer; retry", "type": "overloaded",
        "code": "jobs_unavailable"}


def test_anything_unknown_is_a_500_that_names_nothing_inside(caplog) -> None:
    response = error_response(as_serve_app_error(KeyError("secret detail")))
    assert response.status_code == 500
    assert "secret" not in response.body.decode()
    assert "unexpected error" in caplog.text
