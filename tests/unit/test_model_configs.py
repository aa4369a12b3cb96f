"""``TransformerShape.from_hf_config`` against real transformers models of each common family.

Each case builds a tiny random-weight model from its transformers config class, runs one
forward pass with ``use_cache=True`` and checks the analytic KV-cache bytes against the bytes
of every tensor transformers cached, and the parameter estimate against the model's weight
matrices. The config is read both as ``config.to_dict()`` and as the ``config.json`` that
``save_pretrained`` writes (``to_json_string()``, which leaves out some defaults).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from serve_app.memory.cost_model import AnalyticCostModel
from serve_app.memory.model_shape import (
    MissingConfigKeysError,
    TransformerShape,
    _falcon_expands_kv,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BATCH, TOKENS, VOCAB = 2, 7, 100
FLOAT32 = 4
# Biases, norms and other 1-D parameters are all the estimate leaves out; in these tiny models
# (hidden 64) they are at most this fraction of all parameters (GPT-2 with n_inner 96: 2.1 %;
# at 0.1B+ parameters, well under 1 %).
PARAM_TOLERANCE = 0.025
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB,
               max_position_embeddings=64)
FALCON_NEW = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  new_decoder_architecture=True, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
GPT2_STYLE = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                  bos_token_id=0, eos_token_id=0)


@dataclass(frozen=True)
class Family:
    """A tiny model: its config and model class names in transformers and their arguments."""

    config: str
    model: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The estimate counts exactly the weight matrices (every parameter of 2+ dimensions).
    exact_matrices: bool = True


FAMILIES = {
    "llama-gqa": Family("LlamaConfig", "LlamaForCausalLM",
                        dict(DECODER, num_attention_heads=4, num_key_value_heads=2)),
    "llama-explicit-head-dim": Family(
        "LlamaConfig", "LlamaForCausalLM",
        dict(DECODER, num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    "mistral": Family("MistralConfig", "MistralForCausalLM",
                      dict(DECODER, num_attention_heads=4, num_key_value_heads=1)),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM",  # q/k/v biases
                    dict(DECODER, num_attention_heads=4, num_key_value_heads=2)),
    "qwen2-tied": Family("Qwen2Config", "Qwen2ForCausalLM",
                         dict(DECODER, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=True)),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM",  # head_dim 32 != 64 / 4, one kv head
                    dict(DECODER, num_attention_heads=4, num_key_value_heads=1, head_dim=32)),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM",
                     dict(DECODER, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          sliding_window=16)),
    "gemma3-text": Family("Gemma3TextConfig", "Gemma3ForCausalLM",
                          dict(DECODER, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, sliding_window=16)),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", GPT2_STYLE),  # n_inner None: 4 x n_embd
    "gpt2-n-inner": Family("GPT2Config", "GPT2LMHeadModel", dict(GPT2_STYLE, n_inner=96)),
    "gpt-bigcode-multi-query": Family("GPTBigCodeConfig", "GPTBigCodeForCausalLM", GPT2_STYLE),
    "falcon-multi-query": Family("FalconConfig", "FalconForCausalLM",
                                 dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)),
    # Projects 2 K/V heads. transformers up to 5.24 caches them expanded to all 4 (the
    # estimate then counts 4, over the matrices); from 5.25 it caches 2.
    "falcon-new-decoder": Family(
        "FalconConfig", "FalconForCausalLM",
        dict(FALCON_NEW, num_kv_heads=2), exact_matrices=not _falcon_expands_kv()),
    # Falcon-40B's config.json sets multi_query too; the new architecture ignores it.
    "falcon-40b-style": Family(
        "FalconConfig", "FalconForCausalLM",
        dict(FALCON_NEW, num_kv_heads=2, multi_query=True),
        exact_matrices=not _falcon_expands_kv()),
}


def build(family: Family) -> Any:
    """The tiny model in eval mode, its config naming its class as ``config.json`` does."""
    config_class = getattr(transformers, family.config, None)
    model_class = getattr(transformers, family.model, None)
    if config_class is None or model_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family.model}")
    config = config_class(**family.kwargs)
    config.architectures = [family.model]  # as save_pretrained writes it
    torch.manual_seed(0)
    return model_class(config).eval()


def cached_bytes(model: Any) -> int:
    """Bytes of every tensor in the cache of one forward pass over (BATCH, TOKENS) ids."""
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    assert len(cache.layers) == model.config.num_hidden_layers
    return sum(t.numel() * t.element_size()
               for layer in cache.layers for t in (layer.keys, layer.values))


def shapes(model: Any) -> tuple[TransformerShape, TransformerShape]:
    """The shape read from ``to_dict()`` and from the ``config.json`` text."""
    config = model.config
    return (TransformerShape.from_hf_config(config.to_dict(), FLOAT32),
            TransformerShape.from_hf_config(json.loads(config.to_json_string()), FLOAT32))


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cache_bytes_equal_what_transformers_caches(name: str) -> None:
    model = build(FAMILIES[name])
    from_dict, from_json = shapes(model)
    assert from_dict == from_json
    assert from_dict.is_decoder
    assert from_dict.kv_cache_bytes(BATCH, TOKENS) == cached_bytes(model)


@pytest.mark.parametrize("name", ["falcon-new-decoder", "falcon-40b-style"])
def test_a_falcon_config_saved_before_transformers_5_25_prices_what_this_one_caches(
        name: str) -> None:
    """The Hub's Falcon-40B/180B ``config.json`` files were saved by transformers before 5.25,
    so they lack ``num_key_value_heads`` (5.25's ``FalconConfig`` writes it): the heads
    cached are then read from ``new_decoder_architecture`` and ``num_kv_heads`` as the
    installed transformers uses them."""
    model = build(FAMILIES[name])
    saved = json.loads(model.config.to_json_string())
    saved.pop("num_key_value_heads", None)
    shape = TransformerShape.from_hf_config(saved, FLOAT32)
    assert shape.kv_cache_bytes(BATCH, TOKENS) == cached_bytes(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_param_count_estimate_matches_the_weight_matrices(name: str) -> None:
    family = FAMILIES[name]
    model = build(family)
    estimate = shapes(model)[0].approx_param_count
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    total = sum(p.numel() for p in model.parameters())
    if family.exact_matrices:
        assert estimate == matrices
        assert abs(estimate - total) / total <= PARAM_TOLERANCE
    else:
        assert estimate > matrices  # over, never under


def test_explicit_head_dim_is_read_and_prices_the_activations() -> None:
    model = build(FAMILIES["gemma"])
    shape = shapes(model)[0]
    assert (shape.hidden_size, shape.num_heads, shape.head_dim, shape.num_kv_heads) == (
        64, 4, 32, 1)
    derived = TransformerShape(**{**vars(shape), "head_dim": None})
    assert derived.head_dim == 16
    # Q, K, V and the attention output are heads x head_dim wide: 4 x (128 - 64) more elements
    # per token than with the derived head width.
    priced, underpriced = (AnalyticCostModel(s, overhead_bytes=0) for s in (shape, derived))
    extra = priced.request_bytes(BATCH, TOKENS) - underpriced.request_bytes(BATCH, TOKENS)
    assert extra == FLOAT32 * BATCH * TOKENS * 4 * (128 - 64) + (
        shape.kv_cache_bytes(BATCH, TOKENS) - derived.kv_cache_bytes(BATCH, TOKENS))


def test_a_multimodal_wrapper_is_read_from_its_text_config() -> None:
    text = dict(DECODER, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                sliding_window=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                       boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    shape = TransformerShape.from_hf_config(json.loads(config.to_json_string()), FLOAT32)
    assert (shape.hidden_size, shape.head_dim, shape.num_kv_heads, shape.is_decoder) == (
        64, 32, 1, True)
    assert shape.kv_cache_bytes(BATCH, TOKENS) == cached_bytes_of_language_model(model)


def cached_bytes_of_language_model(model: Any) -> int:
    ids = torch.randint(0, VOCAB - 3, (BATCH, TOKENS))  # no image tokens
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    return sum(t.numel() * t.element_size()
               for layer in cache.layers for t in (layer.keys, layer.values))


# --- configs that cannot be read --------------------------------------------------------------


def test_missing_dimensions_are_all_named_with_the_keys_looked_for() -> None:
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
              "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(MissingConfigKeysError) as raised:
        TransformerShape.from_hf_config(config, FLOAT32)
    message = str(raised.value)
    assert set(raised.value.missing) == {"intermediate_size", "num_layers", "vocab_size",
                                         "max_positions"}
    for key in ("intermediate_size", "n_inner", "ffn_hidden_size", "num_hidden_layers",
                "n_layer", "num_layers", "vocab_size", "max_position_embeddings",
                "n_positions", "n_ctx"):
        assert key in message
    assert "hidden_size: none" not in message and "num_heads: none" not in message
    assert "lacks 4 required dimension(s)" in message


def test_a_llama_config_without_an_ffn_width_is_not_guessed() -> None:
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64}
    with pytest.raises(MissingConfigKeysError, match="intermediate_size: none of "
                       "intermediate_size, n_inner, ffn_hidden_size"):
        TransformerShape.from_hf_config(config, FLOAT32)


def test_a_text_config_miss_says_where_it_looked() -> None:
    config = {"architectures": ["LlavaForConditionalGeneration"],
              "text_config": {"hidden_size": 64}}
    with pytest.raises(MissingConfigKeysError, match="with its text_config"):
        TransformerShape.from_hf_config(config, FLOAT32)


def test_the_error_is_caught_as_key_error_and_as_value_error() -> None:
    # serve_app.planning catches (OSError, KeyError, ValueError); the profile loader too.
    error = MissingConfigKeysError({"vocab_size": ("vocab_size",)}, "model config")
    assert isinstance(error, KeyError) and isinstance(error, ValueError)
    assert str(error) == "model config lacks 1 required dimension(s) (vocab_size: none of " \
                         "vocab_size)"


def test_zero_heads_is_a_value_error() -> None:
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 0, "vocab_size": VOCAB, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match="num_heads 0"):
        TransformerShape.from_hf_config(config, FLOAT32)
