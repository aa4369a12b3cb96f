"""A chat template that refuses a conversation (``raise_exception``, as Gemma's refuses a
system message) is the client's 400 naming the template's own message, streamed or not, not
a 500: the ingress's own FastAPI app around a real causal LM's front end, no Ray (the refusal
comes before any replica)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from deployments.engines.registry import engine_class
from deployments.http.idempotency_guard import IdempotencyGuard
from deployments.http.request_factory import RequestFactory
from serve_app.config import parse_args
from serve_app.errors import InvalidRequestError
from serve_app.metrics import ProcessMetrics
from tests.ingress_parts import ingress_app
from tests.model_dirs import build_causal_lm

pytestmark = pytest.mark.unit

# As Gemma's instruction-tuned templates do (google/gemma-2b-it).
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}"
    "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
USER = {"role": "user", "content": "the quick brown fox"}
SYSTEM = {"role": "system", "content": "Be terse."}
REFUSED = {"message": "the model's chat template refuses these messages: System role not "
                      "supported", "type": "invalid_request_error", "code": "messages"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_causal_lm(tmp_path_factory.mktemp("chat") / "tiny-chat", "llama3")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE  # shipped with the model's tokenizer
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def front(model_dir: Path):
    args = parse_args({"model": {"task": "generate", "path": str(model_dir)}})
    return args, engine_class(args).front_end(args)


def test_the_templates_refusal_is_a_400_naming_its_message(front) -> None:
    _, front_end = front
    assert front_end.chat_ids([USER])  # the same model without a system message renders
    with pytest.raises(InvalidRequestError) as refused:
        front_end.chat_ids([SYSTEM, USER])
    assert refused.value.to_body()["error"] == REFUSED


@pytest.fixture(scope="module")
def http(front) -> Iterator[TestClient]:
    args, front_end = front
    guard = IdempotencyGuard(None, None, 1.0, ProcessMetrics("Ingress", "test", use_ray=False))
    app = ingress_app(args, factory=RequestFactory(args, front_end), guard=guard)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_the_chat_route_answers_the_refusal_as_400(http, stream: bool) -> None:
    response = http.post("/v1/chat/completions", json={
        "messages": [SYSTEM, USER], "max_tokens": 4, "stream": stream})
    assert response.status_code == 400
    assert response.json() == {"error": REFUSED}
