"""The transformers generation engine on a small random Llama built at test time: a batch of
prompts completed in one left-padded ``generate`` gives each prompt what it gets alone."""

from __future__ import annotations

import pytest

from deployments.engines.generation import GenerationEngine
from serve_app.request import GenerationParams
from tests.support import build_tiny_causal_lm

PROMPTS = ["the quick brown fox", "a memory budget admits requests by measured bytes",
           "ray", "generation keeps a key value cache that grows with every new token",
           "the quick brown fox jumps"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> GenerationEngine:
    path = build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-lm") / "model", num_layers=2,
                                hidden_size=128)
    return GenerationEngine(path, "cpu", "float32", num_threads=1)


def test_a_greedy_batch_gives_each_prompt_its_own_completion(engine) -> None:
    params = [GenerationParams(max_tokens=12, temperature=0.0)] * len(PROMPTS)
    alone = [engine.generate(prompt, p) for prompt, p in zip(PROMPTS, params, strict=True)]
    together = engine.generate_batch(PROMPTS, params)
    assert together == alone
    assert [o.prompt_tokens for o in together] == [len(i) for i in engine.front.tokenize(PROMPTS)]
    assert all(1 <= o.completion_tokens <= 12 for o in together)
    assert {o.finish_reason for o in together} <= {"stop", "length"}


def test_rows_with_different_max_tokens_are_each_cut_at_their_own(engine) -> None:
    params = [GenerationParams(max_tokens=n, temperature=0.0) for n in (3, 12, 1, 7, 12)]
    alone = [engine.generate(prompt, p) for prompt, p in zip(PROMPTS, params, strict=True)]
    together = engine.generate_batch(PROMPTS, params)
    assert together == alone
    assert all(o.completion_tokens <= p.max_tokens for o, p in zip(together, params,
                                                                     strict=True))


def test_sampled_batches_keep_their_lengths(engine) -> None:
    params = [GenerationParams(max_tokens=n, temperature=0.9) for n in (6, 2, 4)]
    outputs = engine.generate_batch(PROMPTS[:3], params)
    assert len(outputs) == 3
    assert all(1 <= o.completion_tokens <= p.max_tokens for o, p in zip(outputs, params,
                                                                          strict=True))


@pytest.mark.parametrize("params", [
    [GenerationParams(temperature=0.0, stop=("fox",))] * 2,
    [GenerationParams(temperature=0.9, seed=3)] * 2,
    [GenerationParams(temperature=0.0), GenerationParams(temperature=0.9)],
    [GenerationParams(temperature=0.9, top_p=0.5), GenerationParams(temperature=0.9)],
])
def test_stop_strings_seeds_and_mixed_sampling_are_not_batched(engine, params) -> None:
    with pytest.raises(ValueError):
        engine.generate_batch(PROMPTS[:2], params)
