"""The dimensions of a transformer that set its memory use, read from ``config.json``.

Pure: no torch. :class:`TransformerShape` is what the analytic cost model
(:class:`serve_app.memory.cost_model.AnalyticCostModel`) prices; the constants below are its
per-layer buffer counts, with their sources.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Live activation buffers of one transformer layer during an inference forward pass (no
# autograd graph is kept under torch.inference_mode, so only about one layer's tensors are
# alive at a time). Counted from the layer's data flow (Vaswani et al. 2017, "Attention Is All
# You Need", section 3; the per-tensor inventory of Korthikanti et al. 2022, "Reducing
# Activation Recomputation in Large Transformer Models", section 4.1, without the tensors kept
# only for backward): the input residual and the attention output projection (2 x hidden);
# Q, K, V and the attention output, each heads x head_dim wide (4 x attention width; K and V
# at the query width because eager attention expands grouped K/V to every query head,
# ``repeat_kv`` in transformers' ``modeling_llama.py``); FFN up-projection and its activation
# (2 x intermediate), or for a gated FFN the activated gate, the up-projection and their
# product (3 x intermediate: ``down_proj(act(gate_proj(x)) * up_proj(x))``, Shazeer 2020, "GLU
# Variants Improve Transformer"); attention scores and probabilities in eager attention
# (2 x heads x seq^2).
RESIDUAL_BUFFERS = 2
HEAD_BUFFERS = 4
INTERMEDIATE_BUFFERS = 2
GATED_INTERMEDIATE_BUFFERS = 3
ATTENTION_MATRICES = 2
# KV cache: K and V per layer, each batch x tokens x kv_heads x head_dim (Pope et al. 2022,
# "Efficiently Scaling Transformer Inference", section 2.1; vLLM's block size arithmetic).
KV_TENSORS = 2

# config.json keys of each required dimension, in the order tried: BERT/Llama names first
# (transformers' ``PretrainedConfig`` attribute names), then GPT-2's (``GPT2Config``: n_embd,
# n_layer, n_head, n_positions, n_ctx, n_inner), T5's (d_model, num_layers, num_heads) and
# Falcon's (``FalconConfig.ffn_hidden_size``).
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_hidden_size"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
    "max_positions": ("max_position_embeddings", "n_positions", "n_ctx"),
}
# model_type values whose MLP is gated (gate, up and down projections: 3 hidden x intermediate
# matrices), per their transformers modeling files (``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``,
# ``GemmaMLP``, ...). Other families are read as a plain two-matrix FFN (BERT, GPT-2, Falcon).
GATED_MLP_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3",
    "olmo", "olmo2", "granite", "stablelm", "cohere"})
# Keys whose presence means rotary or ALiBi positions: no learned position-embedding table.
NO_POSITION_TABLE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim",
                          "rotary_pct", "rotary_emb_base")


class MissingConfigKeysError(KeyError, ValueError):
    """A model config lacks required dimensions: a ``KeyError`` (what callers caught before)
    and a ``ValueError`` (a malformed file). ``missing``: each missing dimension and the config
    keys looked for, none of them set."""

    def __init__(self, missing: dict[str, tuple[str, ...]], where: str) -> None:
        listed = "; ".join(f"{name}: none of {', '.join(keys)}"
                           for name, keys in missing.items())
        super().__init__(f"{where} lacks {len(missing)} required dimension(s) ({listed})")
        self.missing = missing

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0])


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The dimensions of a transformer that set its memory use.

    Attributes:
        hidden_size, intermediate_size, num_layers, num_heads: from the HF ``config.json``.
        vocab_size: embedding rows (and logits width for causal LMs).
        max_positions: longest sequence the model accepts (tokens).
        dtype_bytes: bytes per element of weights and activations (4 for float32).
        num_kv_heads: key/value heads (fewer than ``num_heads`` under grouped-query attention,
            1 under multi-query); ``None`` reads as ``num_heads``.
        is_decoder: a causal LM, which keeps a KV cache and computes logits.
        head_dim: width of one attention head; ``None`` reads as ``hidden_size // num_heads``
            (Gemma and others set it explicitly, e.g. 256 with hidden 2048 and 8 heads).
        gated_mlp: the FFN has gate, up and down projections (Llama, Mistral, Qwen2, Gemma).
        tied_embeddings: a decoder's LM head shares the input embedding matrix.
        learned_positions: a position-embedding table (BERT, GPT-2), not rotary positions.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_positions: int
    dtype_bytes: int
    num_kv_heads: int | None = None
    is_decoder: bool = False
    head_dim: int | None = None
    gated_mlp: bool = False
    tied_embeddings: bool = True
    learned_positions: bool = True

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.hidden_size < 1:
            raise ValueError(f"hidden_size {self.hidden_size} and num_heads {self.num_heads} "
                             "must be positive")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], dtype_bytes: int) -> TransformerShape:
        """Read a Hugging Face ``config.json`` dict (BERT-, GPT-2-, Llama-, Mistral-, Qwen2-,
        Gemma- and Falcon-style keys; a multimodal wrapper's ``text_config``).

        Keys per dimension are :data:`CONFIG_KEYS`. ``head_dim`` is read when set. A missing
        FFN width is guessed only for GPT-2-style configs (``n_embd``): ``GPT2Config``
        documents ``n_inner=None`` as 4 x ``n_embd`` (transformers' GPT-2 docs, and
        ``GPT2MLP`` in ``modeling_gpt2.py``).

        Raises:
            MissingConfigKeysError: (a ``KeyError`` and ``ValueError``) dimensions are missing
                under every known key; its message names each one and the keys looked for.
        """
        dims, where = _language_model_config(config)
        found = {name: _first_int(dims, keys) for name, keys in CONFIG_KEYS.items()}
        if found["intermediate_size"] is None and found["hidden_size"] and "n_embd" in dims:
            found["intermediate_size"] = 4 * found["hidden_size"]
        missing = {name: CONFIG_KEYS[name] for name, value in found.items() if value is None}
        if missing:
            raise MissingConfigKeysError(missing, where)
        model_type = dims.get("model_type")
        return cls(
            **found, dtype_bytes=dtype_bytes,
            num_kv_heads=_kv_heads(dims, found["num_heads"]),
            is_decoder=_is_decoder(config.get("architectures") or [], where != "model config"),
            head_dim=_first_int(dims, ("head_dim",)),
            gated_mlp=model_type in GATED_MLP_MODEL_TYPES,
            tied_embeddings=bool(dims.get("tie_word_embeddings", True)),
            learned_positions=not (any(dims.get(k) is not None for k in NO_POSITION_TABLE_KEYS)
                                   or dims.get("alibi")),
        )

    @property
    def attention_width(self) -> int:
        """``num_heads x head_dim``: the width of Q and of the attention output (elements)."""
        return self.num_heads * self.head_dim

    @property
    def approx_param_count(self) -> int:
        """Weight matrices: embeddings (+ a position table, + an untied LM head) + per layer
        attention (Q and output ``h x heads x head_dim`` each, K and V ``h x kv_heads x
        head_dim`` each) + FFN (2 ``h x i`` matrices, 3 when gated). Biases, norms, BERT's
        token-type table and pooler are left out (well under 1 % for 0.1B+ models)."""
        h, i = self.hidden_size, self.intermediate_size
        embeddings = self.vocab_size * h
        if self.learned_positions:
            embeddings += self.max_positions * h
        if self.is_decoder and not self.tied_embeddings:
            embeddings += self.vocab_size * h  # lm_head
        attention = 2 * h * self.attention_width + 2 * h * self.num_kv_heads * self.head_dim
        ffn = (3 if self.gated_mlp else 2) * h * i
        return embeddings + self.num_layers * (attention + ffn)

    def kv_cache_bytes(self, batch: int, tokens: int) -> int:
        """``2 x batch x tokens x layers x kv_heads x head_dim x dtype_bytes`` (0 for encoders).

        Sliding-window layers (Mistral, Gemma 2/3) are priced as full layers: over the window
        this is more than transformers keeps (``DynamicSlidingWindowLayer``), never less."""
        if not self.is_decoder:
            return 0
        return (KV_TENSORS * batch * tokens * self.num_layers * self.num_kv_heads
                * self.head_dim * self.dtype_bytes)


def _first_int(config: dict[str, Any], keys: Sequence[str]) -> int | None:
    """The first of ``keys`` set (not null) in ``config``, as an int; ``None`` if none is."""
    for key in keys:
        if config.get(key) is not None:
            return int(config[key])
    return None


def max_positions_key(config: dict[str, Any]) -> str:
    """The ``config.json`` key the model's context is read from
    (:data:`CONFIG_KEYS` ``max_positions``: ``max_position_embeddings``, GPT-2's
    ``n_positions``...), for messages; the first candidate when none is set."""
    dims, _ = _language_model_config(config)
    keys = CONFIG_KEYS["max_positions"]
    return next((key for key in keys if dims.get(key) is not None), keys[0])


def _language_model_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The keys to read dimensions from, and where they came from: a multimodal wrapper's
    ``text_config`` (Gemma 3, LLaVA, Qwen2-VL: the language model's dimensions) over the
    top level, else the top level."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config, "model config"
    return ({**config, **{k: v for k, v in text.items() if v is not None}},
            "model config (with its text_config)")


def _kv_heads(config: dict[str, Any], heads: int) -> int:
    """Key/value heads as the installed transformers caches them. Falcon's
    ``new_decoder_architecture`` (Falcon-40B/180B) caches K/V expanded to every query head up
    to transformers 5.24, whatever the config says (:func:`_falcon_expands_kv`); else
    ``num_key_value_heads`` (grouped-query attention; ``FalconConfig`` writes it too from
    5.25); ``multi_query`` without the new architecture (Falcon-7B, GPTBigCode) is 1;
    Falcon's ``num_kv_heads`` (a ``config.json`` saved before 5.25); else ``heads``."""
    if config.get("new_decoder_architecture") and _falcon_expands_kv():
        return heads
    if config.get("num_key_value_heads") is not None:
        return int(config["num_key_value_heads"])
    if config.get("multi_query") and not config.get("new_decoder_architecture"):
        return 1
    return _first_int(config, ("num_kv_heads",)) or heads


FALCON_GROUPED_KV_SINCE = (5, 25)
"""The transformers release whose ``FalconAttention`` keeps ``num_kv_heads`` K/V heads in the
cache and repeats them per query head at attention time (``repeat_kv``, as Llama does); up to
5.24 ``_split_heads`` broadcast K/V to every query head before caching them. Found by
``tests/unit/test_model_configs.py`` measuring the cache of a tiny ``FalconForCausalLM``
under 5.24.0 and 5.25.0."""


@functools.cache
def _falcon_expands_kv() -> bool:
    """Whether the installed transformers caches Falcon's new-architecture K/V expanded to
    every query head (before :data:`FALCON_GROUPED_KV_SINCE`). Read from the package's
    metadata, without importing it."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return False
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    return numbers < FALCON_GROUPED_KV_SINCE


def _is_decoder(architectures: Sequence[str], nested: bool) -> bool:
    """A causal LM by its ``architectures`` (``...ForCausalLM``, GPT-2's ``...LMHeadModel``,
    or a multimodal wrapper's ``...ForConditionalGeneration`` around a text model)."""
    names = " ".join(architectures)
    return ("CausalLM" in names or "LMHead" in names
            or (nested and "ForConditionalGeneration" in names))
