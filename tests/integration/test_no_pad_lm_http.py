"""A causal LM whose tokenizer ships without a pad token (Llama-3's conventions: BOS added,
several EOS ids; built offline), served over HTTP: 16 concurrent greedy completions share
passes and each equals its prompt completed alone; a prompt given as token ids completes as
its text does."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from transformers import AutoTokenizer

from tests.model_dirs import build_causal_lm

PROMPTS = [" ".join(["the quick brown fox"] * (1 + i % 5) + [f"word{i}"]) for i in range(16)]
BODY = {"max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_causal_lm(tmp_path_factory.mktemp("llama3") / "tiny-llama3", "llama3")


@pytest.fixture(scope="module")
def app(deploy, model_dir):
    return deploy({"model": {"task": "generate", "path": str(model_dir), "device": "cpu"},
                   "limits": {"max_input_tokens": 64, "max_tokens": 16},
                   "admission": {"max_queue_len": 32}})


def test_the_tokenizer_has_no_pad_token(model_dir):
    assert AutoTokenizer.from_pretrained(str(model_dir)).pad_token is None


async def test_16_concurrent_greedy_completions_equal_each_alone(app, client):
    alone = [client.post("/v1/completions", json={"prompt": p, **BODY}) for p in PROMPTS]
    assert [r.status_code for r in alone] == [200] * 16
    [before] = app.check_invariants()
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as http:
        together = await asyncio.gather(*(
            http.post("/v1/completions", json={"prompt": p, **BODY}) for p in PROMPTS))
    [after] = app.check_invariants()
    assert [r.status_code for r in together] == [200] * 16
    assert [r.json()["choices"] for r in together] == [r.json()["choices"] for r in alone]
    assert [r.json()["usage"] for r in together] == [r.json()["usage"] for r in alone]
    steps = after["kv_cache"]["steps"] - before["kv_cache"]["steps"]
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in together)
    print(f"\n16 concurrent completions (no pad token, {tokens} tokens) ran in {steps} "
          "decode steps")
    # They shared steps: joined a left-padded batch, padded with a token the model has.
    assert 1 <= steps < tokens / 2


def test_a_prompt_of_token_ids_completes_as_its_text(client, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = client.post("/v1/completions", json={"prompt": PROMPTS[3], **BODY}).json()
    for ids in (tokenizer.encode(PROMPTS[3]),  # with BOS
                tokenizer.encode(PROMPTS[3], add_special_tokens=False)):
        response = client.post("/v1/completions", json={"prompt": ids, **BODY})
        assert response.status_code == 200, response.text
        assert response.json()["choices"] == text["choices"]
        assert response.json()["usage"] == text["usage"]
    outside = client.post("/v1/completions", json={"prompt": [1, len(tokenizer) + 5], **BODY})
    assert outside.status_code == 400 and outside.json()["error"]["code"] == "prompt"


def test_the_model_is_named_after_its_directory(client, model_dir):
    [card] = client.get("/v1/models").json()["data"]
    assert card["id"] == "tiny-llama3" and card["root"] == str(model_dir)
    body = client.post("/v1/completions", json={"prompt": "a", "model": "tiny-llama3",
                                                **BODY}).json()
    assert body["model"] == "tiny-llama3"
