"""The price of a request in bytes of device memory: analytic, and fitted to measurements.

Pure: numpy only, no torch. Every model answers ``request_bytes(batch, prompt_tokens,
new_tokens=0)``: the peak device bytes, above what the loaded model already holds, of one
forward pass (embeddings) or one ``generate`` call (causal LMs) over a batch padded to
``prompt_tokens``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# Live activation buffers of one transformer layer during an inference forward pass (no
# autograd graph is kept under torch.inference_mode, so only about one layer's tensors are
# alive at a time). Counted from the layer's data flow (Vaswani et al. 2017, "Attention Is All
# You Need", section 3; the per-tensor inventory of Korthikanti et al. 2022, "Reducing
# Activation Recomputation in Large Transformer Models", section 4.1, without the tensors kept
# only for backward): input residual, Q, K, V, attention output and its projection
# (6 x hidden); FFN up-projection and its activation (2 x intermediate); attention scores and
# probabilities in eager attention (2 x heads x seq^2).
HIDDEN_BUFFERS = 6
INTERMEDIATE_BUFFERS = 2
ATTENTION_MATRICES = 2
# KV cache: K and V per layer, each batch x tokens x kv_heads x head_dim (Pope et al. 2022,
# "Efficiently Scaling Transformer Inference", section 2.1; vLLM's block size arithmetic).
KV_TENSORS = 2


class Shape(NamedTuple):
    """The size of a request or of a forward pass, as a cost model reads it.

    Attributes:
        inputs: rows of the batch (embedding inputs, or prompts), >= 1.
        prompt_tokens: tokens each row is padded to, >= 1.
        new_tokens: tokens generated per row (0 for an encoder pass).
    """

    inputs: int
    prompt_tokens: int
    new_tokens: int = 0


class CostModel(Protocol):
    def request_bytes(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> int:
        """Peak extra device bytes of a request of this shape."""


@dataclass(frozen=True)
class TransformerShape:
    """The dimensions of a transformer that set its memory use.

    Attributes:
        hidden_size, intermediate_size, num_layers, num_heads: from the HF ``config.json``.
        vocab_size: embedding rows (and logits width for causal LMs).
        max_positions: longest sequence the model accepts (tokens).
        dtype_bytes: bytes per element of weights and activations (4 for float32).
        num_kv_heads: key/value heads (fewer than ``num_heads`` under grouped-query attention).
        is_decoder: a causal LM, which keeps a KV cache and computes logits.
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
        heads = pick("num_attention_heads", "n_head", "num_heads")
        architectures = " ".join(config.get("architectures") or [])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size") or config.get("n_inner")
                                  or 4 * hidden),
            num_layers=pick("num_hidden_layers", "n_layer", "num_layers"),
            num_heads=heads,
            vocab_size=pick("vocab_size"),
            max_positions=pick("max_position_embeddings", "n_positions", "n_ctx"),
            dtype_bytes=dtype_bytes,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            is_decoder="CausalLM" in architectures or "LMHead" in architectures,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def approx_param_count(self) -> int:
        """Embeddings + per layer (4 h^2 attention + 2 h i FFN); biases and norms ignored."""
        h, i = self.hidden_size, self.intermediate_size
        embeddings = (self.vocab_size + self.max_positions) * h
        return embeddings + self.num_layers * (4 * h * h + 2 * h * i)

    def kv_cache_bytes(self, batch: int, tokens: int) -> int:
        """``2 x batch x tokens x layers x kv_heads x head_dim x dtype_bytes`` (0 for encoders)."""
        if not self.is_decoder:
            return 0
        kv_heads = self.num_kv_heads or self.num_heads
        return (KV_TENSORS * batch * tokens * self.num_layers * kv_heads * self.head_dim
                * self.dtype_bytes)


@dataclass(frozen=True)
class AnalyticCostModel:
    """Peak extra bytes from :class:`TransformerShape` alone, before anything is measured.

    ``bytes = dtype_bytes x batch x prompt x (6 h + 2 i + 2 heads x prompt)`` (one layer's live
    activations over the prompt) ``+ KV cache over prompt + new tokens`` (decoders)
    ``+ dtype_bytes x batch x vocab`` (decoders: one position's logits) ``+ overhead``, with the
    constants and sources above. ``overhead_bytes`` covers per-request tensors outside the
    layers (token ids, mask, pooled output).
    """

    shape: TransformerShape
    overhead_bytes: int = 1 << 20

    def request_bytes(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> int:
        """Bytes for ``batch`` inputs padded to ``prompt_tokens`` tokens, generating
        ``new_tokens`` more each (all >= 0; ``batch``, ``prompt_tokens`` >= 1)."""
        s = self.shape
        per_token = (HIDDEN_BUFFERS * s.hidden_size + INTERMEDIATE_BUFFERS * s.intermediate_size
                     + ATTENTION_MATRICES * s.num_heads * prompt_tokens)
        activations = s.dtype_bytes * batch * prompt_tokens * per_token
        logits = s.dtype_bytes * batch * s.vocab_size if s.is_decoder else 0
        kv_cache = s.kv_cache_bytes(batch, prompt_tokens + new_tokens)
        return activations + logits + kv_cache + self.overhead_bytes

    def weights_bytes(self) -> int:
        """Approximate bytes the weights hold (parameters x dtype bytes)."""
        return self.shape.approx_param_count * self.shape.dtype_bytes


# Features a fitted model may use; each is a function of (batch, prompt, new tokens).
FEATURES = {
    "const": lambda b, p, n: 1.0,
    "batch_tokens": lambda b, p, n: float(b * (p + n)),  # activations per token, KV cache
    "batch_prompt": lambda b, p, n: float(b * p),  # prefill activations (decoders)
    "batch_prompt_sq": lambda b, p, n: float(b * p * p),  # attention scores over the prompt
}
ENCODER_FEATURES = ("const", "batch_tokens", "batch_prompt_sq")
DECODER_FEATURES = ("const", "batch_tokens", "batch_prompt", "batch_prompt_sq")
# Measurements below this are counted as this much when computing relative errors: a page or
# two of allocator noise on a tiny request is not a 100 % error of the model.
ERROR_FLOOR_BYTES = 1 << 20


@dataclass(frozen=True)
class FittedCostModel:
    """``bytes = sum(coefficient_k x feature_k(batch, prompt, new))``, fitted to measured peaks.

    Attributes:
        features: names from :data:`FEATURES`.
        coefficients: bytes per unit of each feature (>= 0).
        fit_error: largest relative error on held-out shapes, ``|pred - meas| / max(meas,
            ERROR_FLOOR_BYTES)``; ``nan`` when nothing was held out.
    """

    features: tuple[str, ...]
    coefficients: tuple[float, ...]
    fit_error: float = math.nan

    def request_bytes(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> int:
        total = sum(c * FEATURES[f](batch, prompt_tokens, new_tokens)
                    for f, c in zip(self.features, self.coefficients, strict=True))
        return max(0, math.ceil(total))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "fitted", "features": list(self.features),
                "coefficients": list(self.coefficients), "fit_error": self.fit_error}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FittedCostModel:
        return cls(tuple(raw["features"]), tuple(float(c) for c in raw["coefficients"]),
                   float(raw["fit_error"]))


def fit_cost_model(shapes: Sequence[tuple[int, int, int]], peaks_bytes: Sequence[int],
                   features: Sequence[str]) -> FittedCostModel:
    """Fit non-negative coefficients to measured peaks, minimising relative squared error.

    Least squares on rows scaled by ``1 / max(peak, ERROR_FLOOR_BYTES)``, so small and large
    requests weigh alike; a feature whose coefficient comes out negative is dropped and the
    fit repeated (non-negativity: memory never shrinks as a request grows). The fit is not
    padded: how far it may under-predict is measured on held-out shapes
    (:attr:`FittedCostModel.fit_error`), and ``memory.safety_factor`` is the margin for it.

    Args:
        shapes: ``(batch, prompt_tokens, new_tokens)`` per measurement.
        peaks_bytes: measured peak extra bytes per shape (same length).
        features: candidate feature names from :data:`FEATURES`.

    Raises:
        ValueError: fewer measurements than features, or lengths differ.
    """
    if len(shapes) != len(peaks_bytes) or len(shapes) < len(features):
        raise ValueError(f"need at least {len(features)} measurements, one per shape")
    peaks = np.asarray(peaks_bytes, dtype=float)
    scale = 1.0 / np.maximum(peaks, ERROR_FLOOR_BYTES)
    active = list(features)
    while True:
        design = np.array([[FEATURES[f](*shape) for f in active] for shape in shapes])
        coefficients, *_ = np.linalg.lstsq(design * scale[:, None], peaks * scale, rcond=None)
        negative = [f for f, c in zip(active, coefficients, strict=True) if c < 0]
        if not negative or len(active) == 1:
            break
        active.remove(negative[0])
    coefficients = np.maximum(coefficients, 0.0)
    return FittedCostModel(tuple(active), tuple(float(c) for c in coefficients))


def relative_error(predicted_bytes: int, measured_bytes: int) -> float:
    """``|predicted - measured| / max(measured, ERROR_FLOOR_BYTES)``."""
    return abs(predicted_bytes - measured_bytes) / max(measured_bytes, ERROR_FLOOR_BYTES)


# An OOM'd request that needed up to this much more than its price is within the resolution
# of the observation (CUDA's message rounds the failed allocation to 0.01 of its unit), so it
# does not correct the model.
OOM_CORRECTION_TOLERANCE = 0.05
# Prices rise at most this much from OOM observations. A larger error means the profile is
# wrong (another model, device or limits): profile again rather than patch it. Same factor
# as the documented analytic/measured bound (serve_app.memory.profiler.ANALYTIC_FACTOR_BOUND).
MAX_OOM_CORRECTION = 3.0


class CorrectedCostModel:
    """A cost model whose prices rise when an out-of-memory error proves them too low.

    An OOM'd request needed at least ``observed_min_bytes``: what it had allocated when it
    failed plus the allocation that failed (see :func:`failed_allocation_bytes`). When that is
    more than the request was priced, every later price is scaled up by the ratio (it only
    ever grows, up to ``max_factor``). An OOM with ``observed_min_bytes`` at or under the price
    (another process, fragmentation, an injected fault) says nothing about the model and
    leaves it alone; the AIMD budget (:mod:`serve_app.admission.aimd`) handles those.

    Args:
        base: the measured (fitted) or analytic model.
        max_factor: cap on the correction (default :data:`MAX_OOM_CORRECTION`).

    Not thread-safe: use from the replica's event loop.
    """

    def __init__(self, base: CostModel, max_factor: float = MAX_OOM_CORRECTION) -> None:
        self.base = base
        self.max_factor = max_factor
        self.factor = 1.0
        self.corrections = 0

    def request_bytes(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> int:
        base = self.base.request_bytes(batch, prompt_tokens, new_tokens)
        return base if self.factor == 1.0 else math.ceil(base * self.factor)

    def published(self) -> dict[str, Any]:
        """What the replica publishes so that others price as it does: the base model's
        :meth:`FittedCostModel.to_dict` and the exact ``correction_factor`` (not rounded: a
        rounded factor would price differently from the replica)."""
        return {**self.base.to_dict(), "correction_factor": self.factor}

    @classmethod
    def from_published(cls, raw: dict[str, Any]) -> CorrectedCostModel:
        """The model :meth:`published` describes: it prices every shape exactly as the
        publishing replica does.

        Raises:
            KeyError, ValueError: ``raw`` is not a published fitted model.
        """
        model = cls(FittedCostModel.from_dict(raw))
        model.factor = float(raw.get("correction_factor", 1.0))
        return model

    def observe_oom(self, priced_bytes: int, observed_min_bytes: int) -> bool:
        """Record an OOM'd request priced ``priced_bytes`` that needed at least
        ``observed_min_bytes``; returns ``True`` when prices went up."""
        if priced_bytes <= 0:
            return False
        ratio = observed_min_bytes / priced_bytes
        if ratio <= 1.0 + OOM_CORRECTION_TOLERANCE:
            return False
        factor = min(self.max_factor, self.factor * ratio)
        if factor <= self.factor:
            return False
        self.factor = factor
        self.corrections += 1
        return True


_FAILED_ALLOCATION = re.compile(
    r"Tried to allocate ([0-9]+(?:\.[0-9]+)?) ?(B|bytes|KiB|MiB|GiB|TiB)")
_UNIT_BYTES = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30,
               "TiB": 1 << 40}


def failed_allocation_bytes(message: str) -> int:
    """The size of the allocation an out-of-memory error reports, bytes (0 if it names none).

    Reads PyTorch's CUDA caching-allocator message, ``"CUDA out of memory. Tried to allocate
    20.00 MiB. GPU 0 has a total capacity of ..."`` (``c10/cuda/CUDACachingAllocator.cpp``,
    sizes formatted by ``format_size``), which the simulated device copies.
    """
    match = _FAILED_ALLOCATION.search(message)
    if match is None:
        return 0
    return int(float(match.group(1)) * _UNIT_BYTES[match.group(2)])
