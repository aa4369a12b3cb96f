"""A user's own sentence-transformers directory (CLS pooling, Normalize, prompts left out of
pooling; built offline) served over HTTP: its vectors are ``SentenceTransformer.encode``'s,
token-id inputs as LangChain sends them equal the text's, and what is served is reported."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.embedding_dirs import build_sentence_transformer

TEXTS = ["A man is eating food.", "The girl is carrying a baby.", "Ray Serve routes requests"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_sentence_transformer(
        tmp_path_factory.mktemp("st") / "my-cls-embedder", pooling="cls",
        prompts={"query": "query: "}, default_prompt_name="query", include_prompt=False)


@pytest.fixture(scope="module")
def app(deploy, model_dir):
    return deploy({"model": {"path": str(model_dir), "device": "cpu"},
                   "memory": {"capacity_bytes": 1 << 30, "reserve_bytes": 0},
                   "limits": {"max_input_tokens": 16}})


def _vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]])


def test_vectors_equal_encode_with_the_default_and_a_named_prompt(client, model_dir):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_dir), device="cpu")
    served = _vectors(client.post("/v1/embeddings", json={"input": TEXTS}))
    assert np.abs(served - reference.encode(TEXTS)).max() < 1e-4
    as_documents = _vectors(client.post("/v1/embeddings",
                                        json={"input": TEXTS, "input_type": "document"}))
    assert np.abs(as_documents - reference.encode(TEXTS, prompt_name="document")).max() < 1e-4
    assert np.abs(as_documents - served).max() > 1e-3  # the prompt made a difference


def test_langchain_style_token_ids_give_the_texts_vectors(client, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # Id lists as a client that tokenizes with the model's tokenizer sends them (no specials)
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    body = {"input": ids, "input_type": "document"}
    refused = client.post("/v1/embeddings", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "input_type"
    from_ids = _vectors(client.post("/v1/embeddings", json={"input": ids}))
    from_text = _vectors(client.post("/v1/embeddings",
                                     json={"input": TEXTS, "input_type": "document"}))
    assert np.abs(from_ids - from_text).max() < 1e-5  # no prompt on ids: the plain text's
    one = _vectors(client.post("/v1/embeddings", json={"input": ids[0]}))
    assert np.abs(one[0] - from_ids[0]).max() < 1e-5


def test_an_out_of_vocabulary_id_is_a_400_naming_the_input(client):
    response = client.post("/v1/embeddings", json={"input": [[5, 6], [5, 10**6]]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "input" and "input 1: token id 1000000" in error["message"]


def test_truncate_serves_an_over_long_input_at_the_limit(client):
    long_text = " ".join(TEXTS * 3)
    refused = client.post("/v1/embeddings", json={"input": long_text})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "input"
    served = client.post("/v1/embeddings", json={"input": long_text, "truncate": True})
    assert served.status_code == 200 and served.json()["usage"]["prompt_tokens"] == 16


def test_the_directory_name_is_the_model_name_and_status_says_the_pooling(client, model_dir):
    [card] = client.get("/v1/models").json()["data"]
    assert card["id"] == "my-cls-embedder" and card["root"] == str(model_dir)
    assert card["max_model_len"] == 128
    status = client.get("/v1/status").json()
    assert status["embedding"]["pooling"] == "cls"
    assert status["embedding"]["include_prompt"] is False
    assert status["embedding"]["default_prompt_name"] == "query"
    assert status["embedding"]["normalize"] is True
    wrong = client.post("/v1/embeddings", json={"input": "x", "model": "all-MiniLM-L6-v2"})
    assert wrong.status_code == 404
