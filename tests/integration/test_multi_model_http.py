"""Several models in one app (``args.models``), over HTTP on local Ray Serve.

Three fake models at ``num_gpus: 0.5`` are placed on the session's two declared GPUs, each
replica budgeting at most its share; a request goes to the model its ``model`` names; every
metric carries the model. Then the packaged MiniLM, a tiny causal LM and a tiny Whisper are
served by one app and the official ``openai`` client calls all three through one base URL,
their answers checked against ``SentenceTransformer.encode``, greedy determinism and
transformers' own Whisper ``generate``; the chat model's own template refuses a system
message, which is the client's 400, streamed or not."""

from __future__ import annotations

import collections
import io
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile
from sentence_transformers import SentenceTransformer
from transformers import AutoTokenizer

from deployments.cluster.fail_fast import DeploymentRefused
from serve_app.app import build_app
from serve_app.config import PACKAGED_NAME, parse_args
from tests.model_dirs import build_causal_lm
from tests.support import (
    build_tiny_whisper,
    by_label,
    settled_scrape,
    tone,
    total,
    whisper_reference,
)

CARD_BYTES = 16 << 30
NAMES = ("embedder", "chat", "speech")


def _fake_models() -> dict:
    return {
        "fake": {"device_capacity_bytes": CARD_BYTES, "weights_bytes": 1 << 30,
                 "latency_per_token_s": 0.0},
        "limits": {"max_inputs": 4, "max_input_tokens": 64, "max_tokens": 16},
        "deployment": {"num_gpus": 0.5, "num_cpus": 0},
        "models": [{"model": {"task": "fake", "name": name}} for name in NAMES],
    }


def test_models_whose_gpu_shares_cannot_all_be_placed_are_refused_at_once(serve_base_url):
    # The session's Ray declares 2 GPUs: five halves need three cards.
    args = {**_fake_models(), "models": [{"model": {"task": "fake", "name": f"m{i}"}}
                                         for i in range(5)]}
    with pytest.raises(DeploymentRefused, match="need 3 GPUs .* the cluster has 2; left over: m4 "):
        build_app(args)


def test_three_half_gpu_models_share_two_cards_and_answer_by_name(deploy):
    app = deploy(_fake_models())
    replicas = app.check_invariants()
    assert sorted(r["model"] for r in replicas) == sorted(NAMES)
    per_card = collections.defaultdict(int)
    for replica in replicas:
        assert replica["num_gpus"] == 0.5 and len(replica["gpu_ids"]) == 1
        assert replica["capacity_bytes"] == CARD_BYTES // 2
        assert replica["budget_bytes"] <= CARD_BYTES // 2 - replica["held_bytes"]
        per_card[replica["gpu_ids"][0]] += replica["budget_bytes"] + replica["held_bytes"]
    print(f"\nheld + budget per card: {dict(per_card)} (card {CARD_BYTES})")
    assert len(per_card) == 2 and all(total <= CARD_BYTES for total in per_card.values())
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        listed = [m["id"] for m in http.get("/v1/models").json()["data"]]
        sent = {"embedder": 1, "chat": 3, "speech": 1}
        answered = {name: [http.post("/v1/embeddings", json={"model": name, "input": ["a b"]})
                           for _ in range(count)] for name, count in sent.items()}
        # A job goes to the named model's queue and is found by its id alone.
        jobs = {name: http.post("/v1/jobs", json={"route": "/v1/embeddings", "body": {
            "model": name, "input": ["a b"]}}).json()["id"] for name in ("speech", "chat")}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
                http.get(f"/v1/jobs/{i}").json()["status"] != "succeeded" for i in jobs.values()):
            time.sleep(0.2)
        done = {name: http.get(f"/v1/jobs/{i}").json() for name, i in jobs.items()}
        unknown = http.post("/v1/embeddings", json={"model": "nope", "input": "a"})
        unnamed = http.post("/v1/embeddings", json={"input": "a"})
        status = http.get("/v1/status").json()
    assert listed == list(NAMES)
    assert {name: [(r.status_code, r.json()["model"]) for r in responses]
            for name, responses in answered.items()} == {
        name: [(200, name)] * count for name, count in sent.items()}
    assert {name: (job["status"], job["result"]["model"]) for name, job in done.items()} == {
        "speech": ("succeeded", "speech"), "chat": ("succeeded", "chat")}
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert "['embedder', 'chat', 'speech']" in unknown.json()["error"]["message"]
    assert unnamed.status_code == 400 and unnamed.json()["error"]["code"] == "model"
    assert [m["model"] for m in status["models"]] == list(NAMES) and "model" not in status
    # Each model's series apart: the chat model's replica admitted its three requests.
    def admitted(samples: dict) -> dict[str, float]:
        return {name: total(samples, "vramgate_admission_decisions_total",
                            outcome="admitted", model=name) for name in NAMES}

    samples = settled_scrape(app.base_url, admitted)
    jobs_run = {"embedder": 0, "chat": 1, "speech": 1}
    assert admitted(samples) == {name: float(count + jobs_run[name])
                                 for name, count in sent.items()}
    assert total(samples, "vramgate_http_requests_total", route="/v1/embeddings",
                 status="200", model="chat") == 3.0


# As Gemma's instruction-tuned templates do (google/gemma-2b-it): a system message is refused.
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}"
    "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    chat_dir = build_causal_lm(root / "tiny-chat", "llama3")
    tokenizer = AutoTokenizer.from_pretrained(str(chat_dir))
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE  # shipped with the model's tokenizer
    tokenizer.save_pretrained(str(chat_dir))
    return chat_dir, build_tiny_whisper(root / "tiny-whisper")


def _wav(audio: np.ndarray) -> bytes:
    file = io.BytesIO()
    soundfile.write(file, audio, 16_000, format="WAV")
    return file.getvalue()


def test_the_openai_client_calls_an_embedder_a_chat_model_and_whisper_through_one_url(
        deploy, model_dirs):
    chat_dir, whisper_dir = model_dirs
    app = deploy({"limits": {"max_input_tokens": 64, "max_tokens": 8},
                  "models": [{"model": {"task": "embed", "device": "cpu"}},
                             {"model": {"task": "generate", "name": "tiny-chat",
                                        "path": str(chat_dir), "device": "cpu"}},
                             {"model": {"engine": "transcribe", "name": "tiny-whisper",
                                        "path": str(whisper_dir), "device": "cpu"},
                              "limits": {"max_audio_s": 20}}]})
    client = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0)
    texts = ["the quick brown fox", "memory is the limit"]
    embedded = client.embeddings.create(model=PACKAGED_NAME, input=texts)
    reference = SentenceTransformer(str(parse_args({}).model.resolved_path()), device="cpu")
    expected = reference.encode(texts, normalize_embeddings=True)
    got = np.array([d.embedding for d in embedded.data])
    print(f"\nlargest |served - SentenceTransformer.encode|: {np.abs(got - expected).max():.2e}")
    assert np.allclose(got, expected, atol=1e-5)
    completion = client.completions.create(model="tiny-chat", prompt="the quick brown fox",
                                           max_tokens=6, temperature=0)
    again = client.completions.create(model="tiny-chat", prompt="the quick brown fox",
                                      max_tokens=6, temperature=0)
    assert completion.model == "tiny-chat" and completion.usage.completion_tokens == 6
    assert completion.choices[0].text == again.choices[0].text  # greedy: one answer
    with pytest.raises(openai.NotFoundError, match="does not serve /v1/completions"):
        client.completions.create(model=PACKAGED_NAME, prompt="x", max_tokens=1)
    user = {"role": "user", "content": "the quick brown fox"}
    chat = client.chat.completions.create(model="tiny-chat", messages=[user], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
    for stream in (False, True):  # the template's refusal is the client's error: 400
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="tiny-chat", messages=[{"role": "system", "content": "Be terse."}, user],
                max_tokens=4, stream=stream)
        assert refused.value.status_code == 400
        assert refused.value.body == {
            "message": "the model's chat template refuses these messages: System role not "
                       "supported", "type": "invalid_request_error", "code": "messages"}
    audio = tone(7, 330)
    heard = client.audio.transcriptions.create(model="tiny-whisper", file=("a.wav", _wav(audio)),
                                               language="en")
    assert heard.text == whisper_reference(whisper_dir, audio, "en")
    assert [m.id for m in client.models.list()] == [PACKAGED_NAME, "tiny-chat", "tiny-whisper"]
    # Each model's series apart: one admitted request each (three for the chat model: the
    # refused chats never reached it).
    samples = settled_scrape(app.base_url, lambda s: by_label(
        s, "vramgate_admission_decisions_total", "model"))
    assert by_label(samples, "vramgate_admission_decisions_total", "model") == {
        PACKAGED_NAME: 1.0, "tiny-chat": 3.0, "tiny-whisper": 1.0}
    app.check_invariants()
