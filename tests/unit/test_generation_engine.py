"""The transformers generation engine on a small random Llama built at test time: a batch of
prompts completed in one left-padded ``generate`` gives each prompt what it gets alone."""

from __future__ import annotations

import pytest

from deployments.engines.base import GenerationParams
from deployments.engines.generation import GenerationEngine
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
    params = GenerationParams(max_tokens=12, temperature=0.0)
    alone = [engine.generate(prompt, params) for prompt in PROMPTS]
    together = engine.generate_batch(PROMPTS, params)
    assert together == alone
    assert [o.prompt_tokens for o in together] == engine.count_tokens(PROMPTS)
    assert all(1 <= o.completion_tokens <= 12 for o in together)
    assert {o.finish_reason for o in together} <= {"stop", "length"}


def test_sampled_batches_keep_their_lengths(engine) -> None:
    outputs = engine.generate_batch(PROMPTS[:3], GenerationParams(max_tokens=6,
                                                                  temperature=0.9))
    assert len(outputs) == 3
    assert all(1 <= o.completion_tokens <= 6 for o in outputs)


@pytest.mark.parametrize("params", [GenerationParams(temperature=0.0, stop=("fox",)),
                                    GenerationParams(temperature=0.9, seed=3)])
def test_stop_strings_and_seeds_are_not_batched(engine, params) -> None:
    with pytest.raises(ValueError):
        engine.generate_batch(PROMPTS[:2], params)
