"""Helpers shared by the integration and end-to-end suites (HTTP only, loopback only)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The girl is carrying a baby."]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def as_from_a_terminal() -> None:
    """``preexec_fn`` for a ``serve run`` that :func:`interrupt` stops: Ctrl-C (SIGINT) back
    to its default. A shell without job control starts a background command (``pytest ... &``)
    with SIGINT ignored, every child inherits that, and a Python started so never raises
    KeyboardInterrupt: ``serve run`` then ignores the Ctrl-C, is killed after ``timeout_s``
    without deleting its applications, and the next test finds them still serving."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(process: subprocess.Popen, timeout_s: float = 60) -> None:
    """Ctrl-C to a ``serve run`` started in its own session, as an operator stops it (it then
    deletes its applications); killed if it has not exited within ``timeout_s``."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def wait_until_ready(base_url: str, timeout_s: float = 180.0,
                     alive: Callable[[], bool] = lambda: True) -> dict[str, Any]:
    """Poll ``/readyz`` until it answers 200 (bounded); return its body.

    Raises:
        TimeoutError: not ready within ``timeout_s``, or ``alive()`` turned false (the server
            process exited).
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline and alive():
        try:
            response = httpx.get(f"{base_url}/readyz", timeout=5)
            if response.status_code == 200:
                return response.json()
            last = response.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not ready after {timeout_s} s (last: {last!r})")


def settled_status(base_url: str, timeout_s: float = 15.0,
                   headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Replica statuses published after this call, once none holds, queues or runs anything.

    Polls ``/v1/status`` (replicas publish about once a second) and returns the first snapshot
    in which every replica's state is newer than the call and idle, or the last one seen after
    ``timeout_s`` so that the caller's assertions show what was left behind.
    """
    since = time.time()
    deadline = time.monotonic() + timeout_s
    replicas: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{base_url}/v1/status", timeout=5,
                             headers=headers).json()["replicas"]
        if replicas and all(r["updated_at"] >= since and r["active_leases"] == 0
                            and r["queue_depth"] == 0 and r["inferences_running"] == 0
                            for r in replicas):
            return replicas
        time.sleep(0.25)
    return replicas


def assert_idle_invariants(replicas: list[dict[str, Any]]) -> None:
    """The invariants of an idle system (nothing reserved, queued, leased or running; charged
    bytes == released), on every replica."""
    assert replicas, "no replica published its status"
    for r in replicas:
        assert r["reserved_bytes"] == 0, r
        assert r["queue_depth"] == 0, r
        assert r["queued_bytes"] == 0, r
        assert r["inferences_running"] == 0, r
        assert r["charged_bytes_total"] == r["released_bytes_total"], r
        if r["policy"] == "budget":  # (the current budget may have shrunk since the peak)
            assert r["peak_reserved_bytes"] <= r["measured_budget_bytes"], r


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


TINY_LM_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a memory budget admits requests by measured bytes of device memory",
    "ray serve routes requests to replicas that hold a share of a gpu",
    "generation keeps a key value cache that grows with every new token",
] * 20


def _measure(args: dict[str, Any]) -> tuple[dict, int, int]:
    """In the child process: the profile (as a dict), the largest request's price, budget."""
    from deployments.replica.profiling import measure_replica
    from serve_app.config import parse_args

    measured = measure_replica(parse_args(args), on_progress=lambda _: None)
    return measured.profile.to_dict(), measured.max_request_bytes, measured.budget_bytes


def measure_in_fresh_process(args: dict[str, Any]) -> tuple[Any, int, int]:
    """``measure_replica`` on ``args`` in a spawned process, as a replica measures at start-up;
    returns ``(MemoryProfile, largest request's price, budget bytes)``. Host-RSS figures taken
    in the test runner would depend on what ran there before (a model loaded into pages an
    earlier test freed adds little RSS: a saved profile then says the model holds 14 MB, and
    a replica holding 146 MB refuses to reuse it) and on its other threads (a Ray driver's)."""
    from serve_app.memory.profiler import MemoryProfile

    raw, max_request_bytes, budget_bytes = in_fresh_process(_measure, args)
    return MemoryProfile.from_dict(raw), max_request_bytes, budget_bytes


def in_fresh_process(fn: Callable[..., Any], *args: Any, timeout_s: float = 600) -> Any:
    """``fn(*args)`` in a spawned process (a module-level ``fn``; picklable arguments)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=timeout_s)


def build_tiny_causal_lm(path: Path, num_layers: int = 2, max_positions: int = 512,
                         hidden_size: int = 64, num_heads: int = 4,
                         init_std: float = 0.02) -> Path:
    """Save a small random-weight Llama (grouped-query attention) and a word-piece BPE tokenizer
    trained on a few sentences to ``path``: a real causal LM directory, loaded by the same code
    as any Hugging Face model, built offline in about a second. ``hidden_size / num_heads``
    is the head size (vLLM's CPU attention needs 32 or more); an ``init_std`` of 0.2 (Llama
    uses 0.02) makes greedy completions vary instead of repeating a token. (Not byte-level
    BPE: a random model would emit invalid UTF-8, which makes text assertions
    meaningless.)"""
    import torch
    from tokenizers import CharBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    bpe = CharBPETokenizer()
    bpe.train_from_iterator(TINY_LM_CORPUS, vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<unk>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", unk_token="<unk>")
    tokenizer.save_pretrained(str(path))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=2, max_position_embeddings=max_positions,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         initializer_range=init_std)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path



WHISPER_LANGUAGES = ("en", "fr")


def build_tiny_whisper(path: Path, d_model: int = 64, num_layers: int = 2,
                       max_target_positions: int = 24) -> Path:
    """Save a small random-weight Whisper to ``path``: ``WhisperConfig`` (80 mel bins, 30 s
    windows of 1500 encoder positions, as every Whisper), a ``WhisperFeatureExtractor``, a
    byte-level BPE ``WhisperTokenizer`` over the 256 byte symbols with Whisper's special
    tokens (``<|startoftranscript|>``, languages :data:`WHISPER_LANGUAGES`, tasks,
    ``<|startofprev|>``, ``<|notimestamps|>``) and its 1501 timestamp tokens
    ``<|0.00|>`` .. ``<|30.00|>``, and a generation config with the ids transformers'
    long-form ``generate`` reads (``no_timestamps_token_id``, ``lang_to_id``,
    ``task_to_id``, ``prev_sot_token_id``, ``max_initial_timestamp_index``). Built offline in
    a few seconds. Random weights, but the decoder's last layer norm carries a constant
    component that the 256 byte tokens' (tied) output rows align with and the special and
    timestamp tokens' oppose: the model writes text (random bytes, often invalid UTF-8)
    until ``max_target_positions``, never a closing timestamp, so long-form ``generate``
    advances one whole 30 s window per call, which keeps CPU tests fast."""
    import torch
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    path.mkdir(parents=True, exist_ok=True)
    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    specials = ["<|endoftext|>", "<|startoftranscript|>",
                *[f"<|{code}|>" for code in WHISPER_LANGUAGES], "<|translate|>",
                "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                "<|notimestamps|>"]
    timestamps = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    for token in specials + timestamps:
        vocab[token] = len(vocab)
    ids = {token: vocab[token] for token in specials}
    tokenizer = WhisperTokenizer(vocab=vocab, merges=[], additional_special_tokens=specials[1:])
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80),
                     tokenizer=tokenizer).save_pretrained(str(path))
    end, start = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = WhisperConfig(
        vocab_size=len(vocab), num_mel_bins=80, d_model=d_model, encoder_layers=num_layers,
        decoder_layers=num_layers, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model, max_source_positions=1500,
        max_target_positions=max_target_positions, pad_token_id=end, bos_token_id=end,
        eos_token_id=end, decoder_start_token_id=start, begin_suppress_tokens=None,
        suppress_tokens=None)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    with torch.no_grad():  # text tokens outscore timestamps and ends (see the docstring)
        model.model.decoder.layer_norm.bias[0] = 8.0
        model.model.decoder.embed_tokens.weight[:, 0] = -1.0
        model.model.decoder.embed_tokens.weight[:256, 0] = 1.0
    model.generation_config = GenerationConfig(
        decoder_start_token_id=start, eos_token_id=end, pad_token_id=end, bos_token_id=end,
        max_length=max_target_positions, no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"], is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in WHISPER_LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        max_initial_timestamp_index=50, begin_suppress_tokens=[end], suppress_tokens=[])
    model.save_pretrained(str(path))
    return path


def tone(seconds: float, frequency_hz: float, rate_hz: int = 16_000,
         channels: int = 1) -> Any:
    """A tone with a little noise (fixed seed), float32 in [-1, 1]; ``(samples,)`` or
    ``(samples, channels)``."""
    import numpy as np

    t = np.arange(int(seconds * rate_hz)) / rate_hz
    noise = np.random.default_rng(int(frequency_hz)).standard_normal(t.size)
    wave = (0.3 * np.sin(2 * np.pi * frequency_hz * t) + 0.01 * noise).astype(np.float32)
    return wave if channels == 1 else np.stack([wave] * channels, axis=1)


def whisper_reference(path: Path, audio: Any, language: str | None,
                      prompt: str = "") -> str:
    """transformers alone: the processor's features (long-form: unpadded past 30 s, with
    the attention mask), ``generate`` with timestamps (and ``prompt_ids`` of ``prompt``, as
    ``processor.get_prompt_ids`` makes them), ``batch_decode``."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(str(path))
    model = WhisperForConditionalGeneration.from_pretrained(str(path)).eval()
    long = len(audio) > 30 * 16_000
    features = processor(audio, sampling_rate=16_000, return_tensors="pt", truncation=False,
                         padding="longest" if long else "max_length",
                         return_attention_mask=True)
    prompt_ids = processor.get_prompt_ids(prompt, return_tensors="pt") if prompt else None
    with torch.inference_mode():
        ids = model.generate(features.input_features, attention_mask=features.attention_mask,
                             language=language, task="transcribe",
                             return_timestamps=True, prompt_ids=prompt_ids)
    return processor.batch_decode(ids, skip_special_tokens=True)[0]


MiB = 1 << 20


async def embed_at_once(base_url: str, count: int) -> list[httpx.Response]:
    """``count`` embeddings of ten words each, sent at once on their own connections."""
    text = " ".join(["w"] * 10)
    async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                 limits=httpx.Limits(max_connections=count)) as http:
        return await asyncio.gather(*(
            http.post("/v1/embeddings", json={"input": text}) for _ in range(count)))


def fake_app_args(**sections: dict) -> dict:
    """``args:`` of an app on the fake engine (``model.task: fake``, no latency unless given),
    with each keyword a config section merged over that base, e.g.
    ``fake_app_args(fake={"bytes_per_token": MiB}, admission={"max_queue_len": 3})``."""
    base: dict = {"model": {"task": "fake", "name": "fake"},
                  "fake": {"latency_per_token_s": 0.0}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


# --- /metrics -------------------------------------------------------------------------------

def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every ``vramgate_`` sample: ``(name, sorted labels) -> value``."""
    response = httpx.get(f"{base_url}/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            assert sample.name.startswith("vramgate_")
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: dict, name: str, **match: str) -> float:
    """Sum of ``name`` over series whose labels include ``match`` (all replicas)."""
    return sum(value for (n, labels), value in samples.items()
               if n == name and match.items() <= dict(labels).items())


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, labels), value in samples.items():
        if n == name:
            out[dict(labels)[label]] += value
    return dict(out)


def wait_for(base_url: str, done, timeout_s: float = 15) -> dict:
    """Scrape until ``done(samples)`` (replicas publish once a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(base_url)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def settled_scrape(base_url: str, figure, quiet_s: float = 2.5, timeout_s: float = 20) -> dict:
    """Scrape until ``figure(samples)`` has stayed the same for ``quiet_s`` (more than two
    publish periods: every process has published what it counted before this call), bounded
    by ``timeout_s``. A baseline taken right after other traffic may otherwise miss counts
    still on their way to the registry."""
    deadline = time.monotonic() + timeout_s
    samples = scrape(base_url)
    last, since = figure(samples), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.5)
        samples = scrape(base_url)
        if (now := figure(samples)) != last:
            last, since = now, time.monotonic()
    return samples


JOB_KEY = "vramgate:m:job:1"  # a job hash as the job store writes it (serve_app/jobs/store.py)


def write_job(redis_url: str) -> None:
    """Write one queued job's hash (``JOB_KEY``) to the Redis at ``redis_url``."""
    client = redis.Redis.from_url(redis_url)
    try:
        client.hset(JOB_KEY, mapping={"status": "queued"})
    finally:
        client.close()


def read_job(redis_url: str) -> dict[bytes, bytes]:
    """The hash at ``JOB_KEY`` in the Redis at ``redis_url`` (empty if it was lost)."""
    client = redis.Redis.from_url(redis_url)
    try:
        return client.hgetall(JOB_KEY)
    finally:
        client.close()



def require_vllm() -> None:
    """Skip the calling test module when vLLM cannot be imported here (a plain install), or
    fail it when ``VRAMGATE_REQUIRE_VLLM`` is set (CI installs vLLM's CPU build: a missing
    vLLM there is a broken install, not a reason to skip)."""
    import pytest

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("VRAMGATE_REQUIRE_VLLM"):
            pytest.fail(f"VRAMGATE_REQUIRE_VLLM is set but vllm cannot be imported: {exc}",
                        pytrace=False)
        pytest.skip(f"vLLM is not installed ({exc}); bash scripts/install_dev.sh installs "
                    "its CPU build", allow_module_level=True)


def vllm_offline_reference(path: Path, prompts: list[list[int]],
                           params: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """vLLM's offline ``LLM.generate`` of token-id ``prompts``, one ``SamplingParams(**p)``
    each, in a process of its own (:mod:`tests.vllm_reference`): ``(text, finish_reason,
    completion tokens)`` per prompt.

    Raises:
        subprocess.CalledProcessError: the reference failed (its stderr in the error).
    """
    import json
    import sys

    from tests.vllm_reference import MARK

    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm_reference"], check=True, capture_output=True,
        text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent,
        input=json.dumps({"path": str(path), "prompts": prompts, "params": params}))
    [line] = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    return [tuple(row) for row in json.loads(line.removeprefix(MARK))]
