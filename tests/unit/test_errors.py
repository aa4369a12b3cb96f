"""The typed error hierarchy: HTTP meaning per class, and pickling that keeps every field."""

from __future__ import annotations

import copy
import pickle

import pytest

from serve_app.errors import (
    AuthenticationError,
    BodyTooLargeError,
    InferenceTimeoutError,
    InternalError,
    InvalidRequestError,
    ModelNotFoundError,
    NotFoundError,
    OverloadedError,
    RequestTooLargeError,
    ServeAppError,
)

# (class, status_code, type, default code)
TABLE = [
    (ServeAppError, 500, "internal_error", "internal_error"),
    (InternalError, 500, "internal_error", "internal_error"),
    (InvalidRequestError, 400, "invalid_request_error", "invalid_request"),
    (RequestTooLargeError, 400, "invalid_request_error", "request_too_large"),
    (AuthenticationError, 401, "authentication_error", "invalid_api_key"),
    (NotFoundError, 404, "invalid_request_error", "not_found"),
    (ModelNotFoundError, 404, "invalid_request_error", "model_not_found"),
    (BodyTooLargeError, 413, "invalid_request_error", "body_too_large"),
    (OverloadedError, 503, "overloaded", "queue_full"),
    (InferenceTimeoutError, 504, "timeout", "inference_timeout"),
]
CLASSES = [row[0] for row in TABLE]


@pytest.mark.parametrize(("cls", "status_code", "type_", "code"), TABLE)
def test_each_class_has_its_http_meaning(cls, status_code: int, type_: str, code: str) -> None:
    err = cls("something went wrong")
    assert isinstance(err, ServeAppError)
    assert (err.status_code, err.type, err.code) == (status_code, type_, code)
    assert err.message == str(err) == "something went wrong"
    assert err.to_body() == {"error": {"message": "something went wrong", "type": type_,
                                       "code": code}}


def test_request_too_large_is_an_invalid_request() -> None:
    assert issubclass(RequestTooLargeError, InvalidRequestError)


def test_an_explicit_code_replaces_the_default() -> None:
    err = InvalidRequestError("bad field", code="input")
    assert err.code == "input"
    assert err.to_body()["error"]["code"] == "input"


@pytest.mark.parametrize(("given", "kept"), [(None, 1), (0, 1), (-3, 1), (1, 1), (7, 7)])
def test_overloaded_always_carries_retry_after_of_at_least_one_second(given, kept: int) -> None:
    assert OverloadedError("busy", retry_after_s=given).retry_after_s == kept


def test_other_errors_carry_no_retry_after_by_default() -> None:
    assert InvalidRequestError("bad").retry_after_s is None
    assert InvalidRequestError("bad").queue_position is None


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickling_keeps_every_field(cls, protocol: int) -> None:
    err = cls("the message", code="some_code", retry_after_s=9, queue_position=4)
    back = pickle.loads(pickle.dumps(err, protocol=protocol))
    assert type(back) is cls
    assert (back.status_code, back.type, back.code) == (err.status_code, err.type, "some_code")
    assert (back.message, str(back), back.args) == ("the message", "the message",
                                                    ("the message",))
    assert back.retry_after_s == 9
    assert back.queue_position == 4
    assert back.to_body() == err.to_body()


@pytest.mark.parametrize("cls", CLASSES)
def test_pickling_keeps_defaults(cls) -> None:
    err = cls("plain")
    back = pickle.loads(pickle.dumps(err))
    assert (back.code, back.retry_after_s, back.queue_position) == (
        err.code, err.retry_after_s, err.queue_position)


def test_overloaded_queue_timeout_round_trips() -> None:
    err = OverloadedError("waited 10 s", code="queue_timeout", retry_after_s=3,
                          queue_position=2)
    for back in (pickle.loads(pickle.dumps(err)), copy.deepcopy(err), copy.copy(err)):
        assert type(back) is OverloadedError
        assert (back.status_code, back.type, back.code, back.retry_after_s,
                back.queue_position) == (503, "overloaded", "queue_timeout", 3, 2)


def test_a_raised_and_caught_error_still_pickles() -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise OverloadedError("busy", code="oom", retry_after_s=2) from inner
    except OverloadedError as err:
        back = pickle.loads(pickle.dumps(err))
    assert (back.code, back.retry_after_s) == ("oom", 2)


@pytest.mark.parametrize(("given", "sent"), [(None, 1), (0, 1), (0.2, 1), (2.0, 2), (2.7, 3)])
def test_overloaded_retry_after_rounds_up_to_a_whole_second(given, sent) -> None:
    assert OverloadedError("busy", retry_after_s=given).retry_after_s == sent
