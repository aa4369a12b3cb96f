"""Text completions from a small causal LM built at test time, over HTTP on local Ray Serve."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.support import build_tiny_causal_lm

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def app(deploy, tmp_path_factory):
    model_dir = build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-lm") / "model")
    return deploy({
        "model": {"task": "generate", "path": str(model_dir), "name": "tiny-llama",
                  "device": "cpu"},
        "limits": {"max_input_tokens": 64, "max_tokens": 32},
        "admission": {"max_queue_len": 8},
    })


def complete(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": PROMPT, **body})


def test_greedy_completion_is_deterministic(client):
    first = complete(client, max_tokens=12, temperature=0)
    second = complete(client, max_tokens=12, temperature=0)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny-llama"
    assert body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] and choice["finish_reason"] in {"length", "stop"}
    assert body["usage"]["prompt_tokens"] == 4
    assert 1 <= body["usage"]["completion_tokens"] <= 12
    assert body["usage"]["total_tokens"] == 4 + body["usage"]["completion_tokens"]
    assert second.json()["choices"][0]["text"] == choice["text"]
    assert first.headers["x-queue-position"] == "0"


PROMPTS = ["the quick brown fox", "a memory budget admits requests", "ray serve routes",
           "generation keeps a key value cache", "the quick brown fox jumps", "a budget"]


async def test_concurrent_greedy_completions_share_passes_and_each_gets_its_own_text(
        app, client):
    alone = [complete(client, prompt=p, max_tokens=32, temperature=0).json()
             for p in PROMPTS]
    [before] = app.check_invariants()
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:
        together = await asyncio.gather(*(
            http.post("/v1/completions", json={"prompt": p, "max_tokens": 32,
                                               "temperature": 0}) for p in PROMPTS))
    [after] = app.check_invariants()
    assert [r.status_code for r in together] == [200] * len(PROMPTS)
    assert [r.json()["choices"] for r in together] == [a["choices"] for a in alone]
    assert [r.json()["usage"] for r in together] == [a["usage"] for a in alone]
    steps = after["kv_cache"]["steps"] - before["kv_cache"]["steps"]
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in together)
    print(f"\n{len(PROMPTS)} concurrent completions ({tokens} tokens) ran in {steps} "
          "decode steps")
    assert 1 <= steps < tokens / 2  # they shared steps (continuous batching)
    assert after["inferences_total"] - before["inferences_total"] == len(PROMPTS)


def test_seeded_sampling_is_reproducible(client):
    texts = {complete(client, max_tokens=10, temperature=0.9, seed=7).json()["choices"][0]["text"]
             for _ in range(2)}
    assert len(texts) == 1


def test_stop_string_ends_the_text_before_it(client):
    full = complete(client, max_tokens=16, temperature=0).json()["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = complete(client, max_tokens=16, temperature=0, stop=[stop]).json()["choices"][0]
    assert cut["text"] == full[:full.index(stop)]
    assert cut["finish_reason"] == "stop"


def test_streaming_sends_the_same_text_and_ends_with_done(client):
    full = complete(client, max_tokens=12, temperature=0).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-queue-position"] == "0"
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == full
    assert events[-1]["choices"][0]["finish_reason"] in {"length", "stop"}
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_openai_client_completions_and_stream(app, client):
    sdk = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0)
    result = sdk.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8,
                                    temperature=0)
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert result.choices[0].text == streamed != ""


@pytest.mark.parametrize(("body", "code"), [
    ({"max_tokens": 33}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "fox " * 100}, "prompt"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": False}, "temperature"),  # no JSON number (found by test_openapi_fuzz)
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"echo": True}, "echo"),
])
def test_bad_completion_requests_are_400(client, body, code):
    response = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code


def test_embeddings_route_is_404_on_a_generation_model(client):
    response = client.post("/v1/embeddings", json={"input": "hi"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_status_shows_a_fitted_kv_cache_model(client):
    [replica] = client.get("/v1/status").json()["replicas"]
    assert replica["task"] == "generate"
    model = replica["profile"]["cost_model"]
    assert model["kind"] == "fitted" and model["held_out_error"] >= 0
    assert replica["max_request_bytes"] <= replica["budget_bytes"]
