"""A 200-line chat batch through the official ``openai`` client on a real causal LM (a tiny
Llama built at test time, vramgate's transformers engine with continuous batching): every
line's reply is the same greedy completion as the same request answered at once, matched by
``custom_id``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.integration.batch_client import batch_line, batch_results, run_batch
from tests.model_dirs import build_causal_lm

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}"
            "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}")
LINES = 200


@pytest.fixture(scope="module")
def app(deploy, tmp_path_factory):
    model_dir = build_causal_lm(tmp_path_factory.mktemp("chat") / "tiny-chat", "llama3")
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return deploy({"model": {"task": "generate", "path": str(model_dir), "device": "cpu",
                             "chat_template": str(template)},
                   "limits": {"max_input_tokens": 64, "max_tokens": 16},
                   "jobs": {"batch_window": 64, "poll_interval_s": 0.05}})


def test_a_200_line_chat_batch_equals_greedy_answers_at_once(app):
    """Prompts of 2 to 9 words and ``max_tokens`` 4 to 11, so that lines end at different
    steps of the shared decode loop (joins and leaves mid-batch)."""
    asks = {f"chat-{i}": ("say " + " ".join(["more"] * (i % 8)) + f" about {i}",
                          4 + i % 8) for i in range(LINES)}

    def body(ask: str, max_tokens: int) -> dict:
        return {"model": "tiny-chat", "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": ask}]}

    with openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as sdk:
        lines = [batch_line(cid, body(*ask), url="/v1/chat/completions")
                 for cid, ask in asks.items()]
        batch = run_batch(sdk, lines, endpoint="/v1/chat/completions", timeout_s=300)
        assert batch.status == "completed", batch.errors
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
        output, errors = batch_results(sdk, batch)
        assert set(output) == set(asks) and not errors
        with ThreadPoolExecutor(8) as pool:
            direct = dict(zip(asks, pool.map(
                lambda ask: sdk.chat.completions.create(**body(*ask)).choices[0],
                asks.values()), strict=True))
    distinct = set()
    for cid, choice in direct.items():
        [line] = output[cid]["response"]["body"]["choices"]
        assert (line["message"]["content"], line["finish_reason"]) == (
            choice.message.content, choice.finish_reason), cid
        distinct.add(choice.message.content)
    assert len(distinct) > LINES // 4, "replies barely differ: the comparison is weak"
