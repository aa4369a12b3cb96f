"""Found by the Schemathesis run (tests/integration/test_openapi_fuzz.py), kept as plain tests:
request validation refuses what the declared schema refuses, the schema declares what the
validation requires, and a 405 keeps its ``Allow`` header through the error handlers."""

from __future__ import annotations

import pydantic
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from deployments.http.http_errors import install_error_handlers
from serve_app.schemas import CompletionRequest, EmbeddingRequest

# The exact body the fuzzer sent: `false` is no JSON number, yet it was accepted as 0.0.
FUZZED_COMPLETION = ('{"max_tokens": 16, "model": null, "n": 1, "prompt": "0", "seed": null, '
                     '"stop": null, "stream": false, "temperature": false, "top_p": 1, '
                     '"user": null}')


def test_a_boolean_temperature_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        CompletionRequest.model_validate_json(FUZZED_COMPLETION)
    assert [e["loc"] for e in caught.value.errors()] == [("temperature",)]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [True, False, "0.5"])
def test_sampling_numbers_must_be_json_numbers(field: str, value: object) -> None:
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": "x", field: value})


@pytest.mark.parametrize("field", ["temperature", "top_p", "max_tokens", "stop", "seed", "n",
                                   "stream", "stream_options", "user", "model"])
def test_null_means_the_default(field: str) -> None:
    # OpenAI's schema marks these nullable; a client sending null gets the default.
    assert CompletionRequest.model_validate({"prompt": "x", field: None}) == \
        CompletionRequest.model_validate({"prompt": "x"})


def test_integers_stay_valid_sampling_numbers() -> None:
    request = CompletionRequest.model_validate_json('{"prompt": "x", "temperature": 0, '
                                                    '"top_p": 1}')
    assert (request.temperature, request.top_p) == (0.0, 1.0)


def test_the_embedding_schema_declares_non_empty_inputs() -> None:
    # The fuzzer's "valid" {"input": ""} got 400: the schema now says what validation wants.
    schema = EmbeddingRequest.model_json_schema()["properties"]["input"]
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    assert schema["anyOf"] == [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        ids, {"type": "array", "minItems": 1, "items": ids}]


def test_an_undeclared_method_is_405_with_allow() -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.post("/v1/embeddings")(lambda: {})
    response = TestClient(app).request("TRACE", "/v1/embeddings")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json() == {"error": {"message": "Method Not Allowed",
                                         "type": "invalid_request_error",
                                         "code": "invalid_request"}}


@pytest.mark.parametrize(("value", "what"), [
    (5, "a number"), (1.5, "a number"), (True, "a boolean"), (None, "null"),
    ({"text": "x"}, "an object"), ([], "an empty list")])
def test_an_input_of_the_wrong_type_is_told_its_type(value: object, what: str) -> None:
    # {"input": 5} was told "... not empty".
    forms = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    for model, field, expected in (
            (EmbeddingRequest, "input", f"input must be {forms}, not {what}"),
            (CompletionRequest, "prompt",
             f"prompt must be a string or a list of token ids, not {what}")):
        if value is None and model is CompletionRequest:
            continue  # null is the default there, and a prompt has none: "field required"
        with pytest.raises(pydantic.ValidationError) as refused:
            model.model_validate({field: value})
        [error] = refused.value.errors()
        assert (error["loc"], error["msg"]) == ((field,), f"Value error, {expected}")
