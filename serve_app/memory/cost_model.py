"""Analytic price of a request in bytes of device memory, from the model's config alone.

Pure: no torch. Measured profiles (fitted at replica start-up) refine these figures later; this
estimate is what a replica charges before it has measured anything, and the cross-check for
what it measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# Live activation buffers of one encoder layer during an inference forward pass (no autograd
# graph is kept under torch.inference_mode, so only about one layer's tensors are alive at a
# time). Counted from the layer's data flow (Vaswani et al. 2017, "Attention Is All You Need",
# section 3; the per-tensor inventory of Korthikanti et al. 2022, "Reducing Activation
# Recomputation in Large Transformer Models", section 4.1, without the tensors kept only for
# backward): input residual, Q, K, V, attention output and its projection (6 x hidden); FFN
# up-projection and its activation (2 x intermediate); attention scores and probabilities in
# eager attention (2 x heads x seq^2).
HIDDEN_BUFFERS = 6
INTERMEDIATE_BUFFERS = 2
ATTENTION_MATRICES = 2


@dataclass(frozen=True)
class TransformerShape:
    """The dimensions of a transformer that set its memory use.

    Attributes:
        hidden_size, intermediate_size, num_layers, num_heads: from the HF ``config.json``.
        vocab_size: embedding rows.
        max_positions: longest sequence the model accepts (tokens).
        dtype_bytes: bytes per element of weights and activations (4 for float32).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_positions: int
    dtype_bytes: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], dtype_bytes: int) -> TransformerShape:
        """Read a Hugging Face ``config.json`` dict (BERT-, GPT-2- and Llama-style keys).

        Raises:
            KeyError: a dimension is missing under every known key.
        """
        def pick(*keys: str) -> int:
            for key in keys:
                if config.get(key) is not None:
                    return int(config[key])
            raise KeyError(f"model config has none of {keys}")

        hidden = pick("hidden_size", "n_embd", "d_model")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size") or config.get("n_inner")
                                  or 4 * hidden),
            num_layers=pick("num_hidden_layers", "n_layer", "num_layers"),
            num_heads=pick("num_attention_heads", "n_head", "num_heads"),
            vocab_size=pick("vocab_size"),
            max_positions=pick("max_position_embeddings", "n_positions", "n_ctx"),
            dtype_bytes=dtype_bytes,
        )

    @property
    def approx_param_count(self) -> int:
        """Embeddings + per layer (4 h^2 attention + 2 h i FFN); biases and norms ignored."""
        h, i = self.hidden_size, self.intermediate_size
        return (self.vocab_size + self.max_positions) * h + self.num_layers * (4 * h * h + 2 * h * i)


@dataclass(frozen=True)
class AnalyticCostModel:
    """Peak extra bytes of one forward pass over a padded batch, from :class:`TransformerShape`.

    ``bytes(batch, seq) = dtype_bytes * batch * seq * (6 h + 2 i + 2 heads * seq) + overhead``
    (constants and sources above). ``overhead_bytes`` covers per-request tensors outside the
    layers (token ids, mask, pooled output), charged once per request.
    """

    shape: TransformerShape
    overhead_bytes: int = 1 << 20

    def request_bytes(self, batch: int, seq_tokens: int) -> int:
        """Bytes for ``batch`` inputs padded to ``seq_tokens`` tokens each (both >= 1)."""
        s = self.shape
        per_token = (HIDDEN_BUFFERS * s.hidden_size + INTERMEDIATE_BUFFERS * s.intermediate_size
                     + ATTENTION_MATRICES * s.num_heads * seq_tokens)
        return s.dtype_bytes * batch * seq_tokens * per_token + self.overhead_bytes

    def weights_bytes(self) -> int:
        """Approximate bytes the weights hold (parameters x dtype bytes)."""
        return self.shape.approx_param_count * self.shape.dtype_bytes
