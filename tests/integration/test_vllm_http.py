"""``model.engine: vllm`` over HTTP on local Ray Serve: vLLM's ``AsyncLLM`` in the replica,
vramgate's gate in front. Greedy completions and chats (16 at once, mixed ``max_tokens``,
some streamed, some with stop strings) give what vLLM's offline ``LLM.generate`` gives for the
same token ids, and what vramgate's transformers engine gives on the same model; the status
shows vLLM's KV pool as the budget; a durable job runs on it. The model: a tiny Llama
(hidden 128, 2 heads: head size 64, which vLLM's CPU attention runs), float32, built here."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support import (
    build_tiny_causal_lm,
    require_vllm,
    settled_status,
    vllm_offline_reference,
)

require_vllm()

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["the quick brown fox", "a memory budget admits requests",
           "ray serve routes requests to replicas"]
MAX_TOKENS = (8, 40, 64, 24)
STOPS = ("", "e", "", "the")


def case(index: int) -> dict:
    """Request ``index`` of 16: a chat every fourth, streamed every other, a stop string in
    half, ``max_tokens`` from :data:`MAX_TOKENS`."""
    prompt, stop = PROMPTS[index % 3], STOPS[index % 4]
    body = {"model": "tiny-vllm", "max_tokens": MAX_TOKENS[index % 4] - index // 4,
            "temperature": 0, "stream": index % 2 == 1}
    if stop:
        body["stop"] = [stop]
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if index % 4 == 3:
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_causal_lm(tmp_path_factory.mktemp("vllm") / "tiny-llama",
                                hidden_size=128, num_heads=2, init_std=0.2)


@pytest.fixture(scope="module")
def app_args(model_dir, tmp_path_factory) -> dict:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return {"model": {"engine": "vllm", "path": str(model_dir), "name": "tiny-vllm",
                      "device": "cpu", "chat_template": str(template)},
            "deployment": {"num_gpus": 0},
            "limits": {"max_input_tokens": 64, "max_tokens": 64},
            "batching": {"max_batch_size": 8},
            "admission": {"max_queue_wait_s": 60}}


@pytest.fixture(scope="module")
def app(deploy, app_args):
    return deploy(app_args)


BODIES = [case(i) for i in range(16)]
JOB = {"model": "tiny-vllm", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def offline(app_args, model_dir) -> list[tuple[str, str, int]]:
    """vLLM's offline answers to :data:`BODIES` and :data:`JOB`, in one run."""
    bodies = [*BODIES, JOB]
    return vllm_offline_reference(model_dir, [_prompt_ids(app_args, b) for b in bodies], [
        {"max_tokens": b["max_tokens"], "temperature": 0.0, "stop": b.get("stop")}
        for b in bodies])


async def _send(http: httpx.AsyncClient, body: dict) -> tuple[str, str, int, int]:
    """``(text, finish_reason, prompt tokens, completion tokens)`` of one request, streamed
    or not."""
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body["stream"]:
        response = await http.post(route, json=body)
        assert response.status_code == 200, response.text
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        text = choice["message"]["content"] if "messages" in body else choice["text"]
        return text, choice["finish_reason"], usage["prompt_tokens"], usage["completion_tokens"]
    text, reason, usage = [], None, None
    async with http.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") if "messages" in body \
                    else choice["text"]
                text.append(piece or "")
                reason = choice.get("finish_reason") or reason
    return "".join(text), reason, usage["prompt_tokens"], usage["completion_tokens"]


def _prompt_ids(app_args: dict, body: dict) -> list[int]:
    """The token ids the ingress builds for ``body`` (the engine's own front end)."""
    from deployments.engines.vllm_engine import VLLMEngine
    from serve_app.config import parse_args

    front = VLLMEngine.front_end(parse_args(app_args))
    if "messages" in body:
        return front.chat_ids(body["messages"])
    return front.tokenize([body["prompt"]])[0]


def _transformers_reference(model_dir, ids: list[list[int]], bodies: list[dict]) -> list:
    """vramgate's transformers engine on the same model, each request alone."""
    from deployments.engines.generation import GenerationEngine
    from serve_app.request import GenerationParams

    engine = GenerationEngine(model_dir, "cpu", "float32", 1)
    return [engine.generate_ids(prompt, GenerationParams(
        max_tokens=body["max_tokens"], temperature=0.0, stop=tuple(body.get("stop", ()))))
        for prompt, body in zip(ids, bodies, strict=True)]


async def test_sixteen_mixed_requests_equal_vllm_offline_and_the_transformers_engine(
        app, app_args, model_dir, offline) -> None:
    bodies = BODIES
    async with httpx.AsyncClient(base_url=app.base_url, timeout=300) as http:
        served = await asyncio.gather(*(_send(http, body) for body in bodies))
    ids = [_prompt_ids(app_args, body) for body in bodies]
    assert [(text, reason, tokens) for text, reason, _, tokens in served] == offline[:16]
    assert [prompt for _, _, prompt, _ in served] == [len(i) for i in ids]
    stopped = [i for i, (text, reason, _, n) in enumerate(served)
               if reason == "stop" and n < bodies[i]["max_tokens"]]
    assert stopped, "no stop string was hit: the stop cases test nothing"
    assert any(reason == "length" for _, reason, _, _ in served)
    hf = _transformers_reference(model_dir, ids, bodies)
    for (text, reason, _, tokens), ours in zip(served, hf, strict=True):
        # vLLM's detokenizer and transformers' streamer differ only in a leading space
        assert (text.lstrip(), reason) == (ours.text.lstrip(), ours.finish_reason)
        if reason == "length":
            assert tokens == ours.completion_tokens
        else:  # vLLM stops at the token that completes the stop string; ours may run on
            assert tokens <= ours.completion_tokens
    print(f"\n16 requests on vLLM: {sum(t for *_, t in served)} tokens, "
          f"{len(stopped)} ended by a stop string")


def test_the_status_shows_vllm_s_pool_as_the_budget(app, client) -> None:
    for body in BODIES[:2]:
        assert client.post("/v1/completions", json={**body, "stream": False}).status_code == 200
    [replica] = settled_status(app.base_url)  # published after these requests
    kv, vllm = replica["kv_cache"], replica["vllm"]
    assert (kv["block_tokens"], vllm["block_tokens"]) == (128, 128)
    # max_model_len 128 (64 + 64): one block a sequence, max_num_seqs 8
    assert (vllm["max_model_len"], vllm["max_num_seqs"]) == (128, 8)
    assert kv["block_bytes"] == 128 * 2 * 2 * 2 * 64 * 4  # tokens x K,V x layers x heads x dim
    assert kv["blocks_total"] == vllm["blocks_total"] == 8
    assert replica["budget_bytes"] == 8 * kv["block_bytes"] == vllm["pool_bytes"]
    assert replica["cost_model"]["features"] == ["kv_blocks_128"]
    assert (kv["blocks_leased"], kv["running_sequences"], kv["waiting_sequences"],
            kv["preempted_sequences"]) == (0, 0, 0, 0)
    assert kv["requests_submitted"] >= 2 and replica["inferences_total"] >= 2


def test_a_durable_job_runs_on_vllm(client, offline) -> None:
    submitted = client.post("/v1/completions", json=JOB, headers={"Prefer": "respond-async"})
    assert submitted.status_code == 202, submitted.text
    deadline, done = time.monotonic() + 120, submitted.json()
    while done["status"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.2)
        done = client.get(f"/v1/jobs/{done['id']}").json()
    assert done["status"] == "succeeded", done
    choice = done["result"]["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == offline[16][:2]
