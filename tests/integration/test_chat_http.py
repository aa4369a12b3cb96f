"""``/v1/chat/completions`` on a small causal LM built at test time whose tokenizer has no
chat template (``model.chat_template`` supplies one), over HTTP on local Ray Serve: the reply
is the rendered conversation's greedy completion, streamed as ``chat.completion.chunk``
events, and the official ``openai`` client works unchanged."""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from tests.model_dirs import build_causal_lm

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}"
            "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}")
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "the quick brown "},
                                         {"type": "text", "text": "fox"}]}]
FLAT = [MESSAGES[0], {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_causal_lm(tmp_path_factory.mktemp("chat") / "tiny-chat", "llama3")


@pytest.fixture(scope="module")
def app(deploy, model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return deploy({"model": {"task": "generate", "path": str(model_dir), "device": "cpu",
                             "chat_template": str(template)},
                   "limits": {"max_input_tokens": 64, "max_tokens": 16}})


def _rendered_ids(model_dir) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return list(tokenizer.apply_chat_template(FLAT, chat_template=TEMPLATE,
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def test_a_chat_reply_is_the_rendered_conversations_completion(client, model_dir):
    body = {"messages": MESSAGES, "max_completion_tokens": 12, "temperature": 0}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["model"] == "tiny-chat"
    [choice] = data["choices"]
    assert choice["message"]["role"] == "assistant"
    ids = _rendered_ids(model_dir)
    completion = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12,
                                                      "temperature": 0}).json()
    assert choice["message"]["content"] == completion["choices"][0]["text"]
    assert choice["finish_reason"] == completion["choices"][0]["finish_reason"]
    assert data["usage"] == completion["usage"]
    assert data["usage"]["prompt_tokens"] == len(ids)


def test_streamed_chunks_give_role_then_content_then_finish_then_usage(client):
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=body).json()
    with client.stream("POST", "/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, finish, usage = events[1:]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in content) == \
        whole["choices"][0]["message"]["content"]
    assert finish["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


def test_the_openai_client_chats_streamed_and_not(app):
    sdk = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0)
    result = sdk.chat.completions.create(model="tiny-chat", messages=FLAT, max_tokens=8,
                                         temperature=0)
    stream = sdk.chat.completions.create(model="tiny-chat", messages=FLAT, max_tokens=8,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert result.choices[0].message.content == text
    assert chunks[-1].usage.completion_tokens == result.usage.completion_tokens


def test_completions_streams_can_end_with_usage_and_null_means_default(client):
    body = {"prompt": "the quick brown fox", "temperature": 0, "max_tokens": None,
            "stop": None, "seed": None, "user": None}
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["completion_tokens"] <= 16  # max_tokens null: its default
    with client.stream("POST", "/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        lines = [line for line in response.iter_lines() if line]
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"] == [] and last["usage"] == whole.json()["usage"]


@pytest.mark.parametrize(("body", "code"), [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"max_completion_tokens": 17}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "fox " * 80}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
])
def test_unsupported_or_invalid_chat_fields_are_400_naming_the_field(client, body, code):
    response = client.post("/v1/chat/completions", json={"messages": FLAT, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    response = client.post("/v1/chat/completions", json={
        "messages": FLAT, "max_tokens": 2, "n": 1, "logprobs": False, "presence_penalty": 0,
        "frequency_penalty": None, "temperature": 0})
    assert response.status_code == 200, response.text
