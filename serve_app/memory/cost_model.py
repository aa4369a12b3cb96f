"""The price of a request in bytes of device memory: analytic, and fitted to measurements.

Pure: numpy only, no torch. Every model answers ``request_bytes(batch, prompt_tokens,
new_tokens=0)``: the peak device bytes, above what the loaded model already holds, of one
forward pass (embeddings) or one ``generate`` call (causal LMs) over a batch padded to
``prompt_tokens``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from serve_app.memory.model_shape import (
    ATTENTION_MATRICES,
    GATED_INTERMEDIATE_BUFFERS,
    HEAD_BUFFERS,
    INTERMEDIATE_BUFFERS,
    RESIDUAL_BUFFERS,
    TransformerShape,
)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class Shape(NamedTuple):
    """The size of a request or of a forward pass, as a cost model reads it. The field names
    are the token kinds' (:data:`TOKEN_AXES`); an engine may give the three slots other
    meanings (``Engine.shape_axes``, e.g. files, audio frames, new tokens).

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
class AnalyticCostModel:
    """Peak extra bytes from :class:`TransformerShape` alone, before anything is measured.

    ``bytes = dtype_bytes x batch x prompt x (2 h + 4 heads x head_dim + 2 i + 2 heads x
    prompt)`` (one layer's live activations over the prompt; ``3 i`` for a gated FFN)
    ``+ KV cache over prompt + new tokens`` (decoders)
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
        ffn_buffers = GATED_INTERMEDIATE_BUFFERS if s.gated_mlp else INTERMEDIATE_BUFFERS
        per_token = (RESIDUAL_BUFFERS * s.hidden_size + HEAD_BUFFERS * s.attention_width
                     + ffn_buffers * s.intermediate_size
                     + ATTENTION_MATRICES * s.num_heads * prompt_tokens)
        activations = s.dtype_bytes * batch * prompt_tokens * per_token
        logits = s.dtype_bytes * batch * s.vocab_size if s.is_decoder else 0
        kv_cache = s.kv_cache_bytes(batch, prompt_tokens + new_tokens)
        return activations + logits + kv_cache + self.overhead_bytes

    def weights_bytes(self) -> int:
        """Approximate bytes the weights hold (parameters x dtype bytes)."""
        return self.shape.approx_param_count * self.shape.dtype_bytes


# Features a fitted model may use; each is a function of the three Shape slots (for token
# kinds: batch, prompt tokens, new tokens). Engines add their own with register_feature.
FEATURES: dict[str, Callable[[int, int, int], float]] = {
    "const": lambda b, p, n: 1.0,
    "batch_tokens": lambda b, p, n: float(b * (p + n)),  # activations per token, KV cache
    "batch_prompt": lambda b, p, n: float(b * p),  # prefill activations (decoders)
    "batch_prompt_sq": lambda b, p, n: float(b * p * p),  # attention scores over the prompt
}
TOKEN_AXES = ("inputs", "prompt_tokens", "new_tokens")
"""What the three :class:`Shape` slots mean for the token kinds (``embed``, ``generate``);
an engine whose cost grows along other axes names its own (``Engine.shape_axes``)."""


class UnknownFeatureError(ValueError):
    """A fitted cost model names a feature nobody registered in this process."""


class NoAnalyticCostModelError(ValueError):
    """An engine prices nothing before a replica has measured it (it has no analytic cost
    model): planning then knows no price, for a reason other than an unreadable config."""


def register_feature(name: str, fn: Callable[[int, int, int], float]) -> None:
    """Make ``name`` usable in fitted cost models: ``fn(slot0, slot1, slot2)`` of a
    :class:`Shape`'s three slots, returning the feature's value (a float, >= 0). Call it at
    import of the module that defines the engine using it, so that the name resolves wherever
    that engine class is imported (the replica, the ingress, the planner, the CLI).

    Raises:
        ValueError: ``name`` is already registered with another function (two engines must
            not give one saved name two meanings).
    """
    known = FEATURES.get(name)
    if known is not None and known is not fn:
        raise ValueError(f"cost-model feature {name!r} is already registered")
    FEATURES[name] = fn


def feature(name: str) -> Callable[[int, int, int], float]:
    """The registered feature ``name``.

    Raises:
        UnknownFeatureError: nothing registered ``name``: the engine module that registers
            it (:func:`register_feature`) was not imported in this process.
    """
    try:
        return FEATURES[name]
    except KeyError:
        raise UnknownFeatureError(
            f"cost-model feature {name!r} is not registered (known: {sorted(FEATURES)}); "
            "import the engine module that registers it (register_feature) before reading "
            "a cost model fitted with it") from None


ENCODER_FEATURES = ("const", "batch_tokens", "batch_prompt_sq")
DECODER_FEATURES = ("const", "batch_tokens", "batch_prompt", "batch_prompt_sq")
# Measurements below this are counted as this much when computing relative errors: a page or
# two of allocator noise on a tiny request is not a 100 % error of the model.
ERROR_FLOOR_BYTES = 1 << 20


@dataclass(frozen=True)
class FittedCostModel:
    """``bytes = sum(coefficient_k x feature_k(batch, prompt, new))``, fitted to measured peaks.

    Attributes:
        features: names from :data:`FEATURES` (built in, or added by an engine module with
            :func:`register_feature`).
        coefficients: bytes per unit of each feature (>= 0).
        held_out_error: the fit's largest relative error on the held-out shapes (measured,
            not fitted), ``|pred - meas| / max(meas, ERROR_FLOOR_BYTES)``; ``nan`` when
            nothing was held out.
    """

    features: tuple[str, ...]
    coefficients: tuple[float, ...]
    held_out_error: float = math.nan

    def request_bytes(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> int:
        total = sum(c * feature(f)(batch, prompt_tokens, new_tokens)
                    for f, c in zip(self.features, self.coefficients, strict=True))
        return max(0, math.ceil(total))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``/v1/status``, saved profiles, what a replica publishes):
        ``held_out_error`` is ``None`` when nothing was held out (JSON has no NaN)."""
        error = None if math.isnan(self.held_out_error) else self.held_out_error
        return {"kind": "fitted", "features": list(self.features),
                "coefficients": list(self.coefficients), "held_out_error": error}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FittedCostModel:
        """The model :meth:`to_dict` wrote (or, before ``held_out_error`` was named so, wrote
        as ``fit_error``: older saved profiles and replicas).

        Raises:
            UnknownFeatureError: it names a feature not registered in this process.
            KeyError, ValueError: ``raw`` is not a fitted model.
        """
        features = tuple(raw["features"])
        for name in features:
            feature(name)
        error = raw["held_out_error"] if "held_out_error" in raw else raw["fit_error"]
        return cls(features, tuple(float(c) for c in raw["coefficients"]),
                   math.nan if error is None else float(error))


def fit_cost_model(shapes: Sequence[tuple[int, int, int]], peaks_bytes: Sequence[int],
                   features: Sequence[str]) -> FittedCostModel:
    """Fit non-negative coefficients to measured peaks, minimising relative squared error.

    Least squares on rows scaled by ``1 / max(peak, ERROR_FLOOR_BYTES)``, so small and large
    requests weigh alike; a feature whose coefficient comes out negative is dropped and the
    fit repeated (non-negativity: memory never shrinks as a request grows). The fit is not
    padded: how far it may under-predict is measured on held-out shapes
    (:attr:`FittedCostModel.held_out_error`), and ``memory.safety_factor`` is the margin for
    it.

    Args:
        shapes: ``(batch, prompt_tokens, new_tokens)`` per measurement.
        peaks_bytes: measured peak extra bytes per shape (same length).
        features: candidate feature names from :data:`FEATURES`.

    Raises:
        UnknownFeatureError: a name is not registered (:func:`register_feature`).
        ValueError: fewer measurements than features, or lengths differ.
    """
    if len(shapes) != len(peaks_bytes) or len(shapes) < len(features):
        raise ValueError(f"need at least {len(features)} measurements, one per shape")
    peaks = np.asarray(peaks_bytes, dtype=float)
    scale = 1.0 / np.maximum(peaks, ERROR_FLOOR_BYTES)
    active = list(features)
    while True:
        design = np.array([[feature(f)(*shape) for f in active] for shape in shapes])
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
    def from_published(cls, raw: dict[str, Any], base: CostModel | None = None,
                       ) -> CorrectedCostModel:
        """The model :meth:`published` describes: it prices every shape exactly as the
        publishing replica does. ``base``: the base model already read from ``raw`` (default:
        a :class:`FittedCostModel`; :func:`serve_app.memory.expected_output.published_model`
        reads any).

        Raises:
            KeyError, ValueError: ``raw`` is not a published fitted model.
        """
        model = cls(base if base is not None else FittedCostModel.from_dict(raw))
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
