"""A model-free engine on a :class:`~serve_app.memory.simulated.SimulatedDevice`.

It embeds and generates (task ``fake``) with memory and time costs that are known exactly, so
admission, profiling, OOM handling and recovery can be tested on CPU without a model:

- the "weights" are ``weights_bytes`` allocated at construction and held until :meth:`close`;
- a request of ``batch`` inputs padded to ``prompt`` tokens, generating ``new`` more, holds
  ``batch x (prompt + new) x bytes_per_token + bytes_per_request`` while it runs
  (:meth:`FakeEngine.request_bytes`, the ground truth a fitted cost model should find);
- it takes ``batch x (prompt + new) x latency_per_token_s``, plus ``latency_per_pass_s`` per
  forward pass (a batch, a prefill, each new token), through the injected ``sleep``.

Every request's memory goes through :meth:`FakeEngine._hold`, the one place where fault
injection can be added. No torch import (the device imports it only to raise an OOM).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from deployments.engines.base import GenerationOutput, GenerationParams, batch_params
from serve_app.memory.cost_model import TransformerShape
from serve_app.memory.simulated import Allocation, SimulatedDevice

SPECIAL_TOKENS = 2  # like [CLS] ... [SEP] or <s> ... </s>
# The fake vocabulary: generated text is these words, one token each, space-separated.
VOCAB = tuple(
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber azure "
    "bronze cedar coral ember fern flint frost garnet hazel indigo ivory jade jasper lemon "
    "maple marble mint moss ochre olive onyx pearl pine quartz rust sable sage slate steel "
    "teal topaz umber violet willow".split())


def _digest(*parts: object) -> int:
    """A 64-bit hash stable across processes (Python's ``hash`` of ``str`` is salted)."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def default_shape(dimensions: int, max_seq_tokens: int) -> TransformerShape:
    """A small pretend decoder (6 layers, ``dimensions`` wide, 64-dim heads, float32)."""
    return TransformerShape(hidden_size=dimensions, intermediate_size=4 * dimensions,
                            num_layers=6, num_heads=max(1, dimensions // 64),
                            vocab_size=len(VOCAB), max_positions=max_seq_tokens,
                            dtype_bytes=4, is_decoder=True)


@dataclass
class FakeEngine:
    """Embeds and generates without a model, holding simulated device memory. Satisfies both
    ``EmbeddingEngineProtocol`` and ``GenerationEngineProtocol`` of
    :mod:`deployments.engines.base`. Call from one thread, except :meth:`count_tokens`.

    Args:
        device: the simulated device the memory is taken from.
        weights_bytes: held from construction to :meth:`close` (what the model holds).
        bytes_per_token: device bytes per token of ``batch x (prompt + new)`` while running.
        bytes_per_request: fixed device bytes per request while running.
        latency_per_token_s: seconds per token of ``batch x (prompt + new)``.
        latency_per_pass_s: fixed seconds per forward pass whatever its batch (an embedding
            batch, a prompt's prefill, each generated token): what makes batching pay.
        dimensions: embedding width.
        max_seq_tokens: longest input, tokens (special tokens included); longer texts are
            truncated by :meth:`embed` and refused by :meth:`generate`.
        shape: the pretend model's dimensions. They only feed the *analytic* cost estimate
            (``AnalyticCostModel``); the memory actually used is set by the byte arguments
            above. Default: :func:`default_shape`.
        seed: seeds the sampler used when a generation has ``temperature > 0`` and no seed.
        sleep: called with the seconds a run takes (inject a no-op in tests).
        oom_probability: injected fault: each run raises the device's OOM with this
            probability, as if fragmentation or another process had taken its memory.
        cuda_error_probability: injected fault: each run raises a non-OOM CUDA error
            (``RuntimeError("CUDA error: device-side assert triggered")``).
        hang_probability, hang_s: injected fault: each run first sleeps ``hang_s``.
        nan_after_oom: injected fault: after an OOM (injected or real) every output is NaN,
            as from a corrupted device; :meth:`canary` reports it.
        fault_seed: seeds the fault injection (reproducible storms).

    Raises:
        torch.OutOfMemoryError: ``weights_bytes`` do not fit on the device.
        ValueError: a negative byte or latency argument.
    """

    device: SimulatedDevice
    weights_bytes: int
    bytes_per_token: int
    bytes_per_request: int = 0
    latency_per_token_s: float = 0.0
    dimensions: int = 384
    max_seq_tokens: int = 512
    shape: TransformerShape | None = None
    seed: int = 0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    oom_probability: float = 0.0
    cuda_error_probability: float = 0.0
    hang_probability: float = 0.0
    hang_s: float = 3600.0
    nan_after_oom: bool = False
    fault_seed: int = 0
    latency_per_pass_s: float = 0.0

    task = "fake"

    def __post_init__(self) -> None:
        self._faults = random.Random(self.fault_seed)
        for name in ("weights_bytes", "bytes_per_token", "bytes_per_request",
                     "latency_per_token_s", "latency_per_pass_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.shape is None:
            self.shape = default_shape(self.dimensions, self.max_seq_tokens)
        self._rng = random.Random(self.seed)
        self._poisoned = False  # set by an OOM under nan_after_oom
        self._weights: Allocation = self.device.allocate(self.weights_bytes)

    # --- cost ----------------------------------------------------------------------------

    def request_bytes(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> int:
        """Exact device bytes a request of this shape holds while it runs."""
        return batch * (prompt_tokens + new_tokens) * self.bytes_per_token \
            + self.bytes_per_request

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Whitespace-separated words + 2 special tokens per text. Thread-safe (pure)."""
        return [len(text.split()) + SPECIAL_TOKENS for text in texts]

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """Hold exactly what a request of this shape holds, for as long as it would run."""
        with self._hold(self.request_bytes(batch, prompt_tokens, new_tokens)):
            self.sleep(batch * (prompt_tokens + new_tokens) * self.latency_per_token_s
                       + (1 + new_tokens) * self.latency_per_pass_s)

    # --- embeddings ----------------------------------------------------------------------

    def embed(self, texts: list[str]) -> np.ndarray:
        """One padded batch: holds ``request_bytes(len(texts), longest)`` while it runs.

        Returns:
            float32 ``(len(texts), dimensions)``, unit L2 rows; the same text always gets the
            same vector (seeded by a hash of the text).

        Raises:
            torch.OutOfMemoryError: the batch does not fit on the device now.
        """
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        longest = min(max(self.count_tokens(texts)), self.max_seq_tokens)
        with self._hold(self.request_bytes(len(texts), longest)):
            self.sleep(len(texts) * longest * self.latency_per_token_s
                       + self.latency_per_pass_s)
            return self._vectors(texts)

    def canary(self) -> bool:
        """One short embedding, outside the injected faults (it checks the device's state; it
        is not traffic); ``True`` when its output is finite (see ``nan_after_oom``)."""
        with self.device.allocate(self.request_bytes(1, SPECIAL_TOKENS + 1)):
            return bool(np.isfinite(self._vectors(["canary"])).all())

    def _vectors(self, texts: list[str]) -> np.ndarray:
        vectors = np.stack([self._vector(text) for text in texts])
        return np.full_like(vectors, np.nan) if self._poisoned else vectors

    def _vector(self, text: str) -> np.ndarray:
        raw = np.random.default_rng(_digest("embed", text)).standard_normal(self.dimensions)
        return (raw / np.linalg.norm(raw)).astype(np.float32)

    # --- generation ----------------------------------------------------------------------

    def generate(self, prompt: str, params: GenerationParams,
                 on_text: Callable[[str], bool] | None = None) -> GenerationOutput:
        """Up to ``params.max_tokens`` fake words, one token each, passed to ``on_text`` as
        they are made. Holds ``request_bytes(1, prompt_tokens, max_tokens)`` throughout (a
        pre-allocated KV cache); sleeps the prompt's latency, then one token's per word.

        ``temperature == 0`` gives text determined by the prompt; ``seed`` makes sampling
        reproducible; ``top_p`` samples from that fraction of the vocabulary. Text matching a
        ``params.stop`` string ends the completion, excluded from the text; text that could be
        the start of a stop string is held back from ``on_text`` until it is decided. A falsy
        return from ``on_text`` cancels (``finish_reason`` ``"cancelled"``), as in
        :mod:`deployments.engines.generation` (so a callback must return ``True``).

        Raises:
            ValueError: the prompt is longer than ``max_seq_tokens``.
            torch.OutOfMemoryError: the request does not fit on the device now.
        """
        prompt_tokens = self.count_tokens([prompt])[0]
        if prompt_tokens > self.max_seq_tokens:
            raise ValueError(f"prompt of {prompt_tokens} tokens exceeds max_seq_tokens "
                             f"{self.max_seq_tokens}")
        with self._hold(self.request_bytes(1, prompt_tokens, params.max_tokens)):
            self.sleep(prompt_tokens * self.latency_per_token_s + self.latency_per_pass_s)
            text, reason, made = _decode(
                self._words(prompt, params), params, on_text,
                lambda: self.sleep(self.latency_per_token_s + self.latency_per_pass_s))
        return GenerationOutput(text, reason, prompt_tokens, made)

    def generate_batch(self, prompts: list[str],
                       params: list[GenerationParams]) -> list[GenerationOutput]:
        """Complete ``prompts`` together, ``params[i]`` for ``prompts[i]``: holds
        ``request_bytes(len(prompts), longest prompt, largest max_tokens)`` (one padded KV
        cache) and sleeps what that many tokens and passes take; each output is what
        :meth:`generate` gives its prompt alone with its own ``params`` (its own prompt
        tokens, the same words, cut at its own ``max_tokens``).

        Raises:
            ValueError: as :func:`deployments.engines.base.batch_params`, or the longest
                prompt + the largest ``max_tokens`` is longer than ``max_seq_tokens``.
            torch.OutOfMemoryError: the batch does not fit on the device now.
        """
        shared = batch_params(params)
        counts = self.count_tokens(prompts)
        longest = max(counts)
        if longest + shared.max_tokens > self.max_seq_tokens:  # as a model's positions
            raise ValueError(f"a batch of {longest} prompt tokens (left-padded) + "
                             f"{shared.max_tokens} new exceeds max_seq_tokens "
                             f"{self.max_seq_tokens}")
        with self._hold(self.request_bytes(len(prompts), longest, shared.max_tokens)):
            self.sleep(len(prompts) * (longest + shared.max_tokens) * self.latency_per_token_s
                       + (1 + shared.max_tokens) * self.latency_per_pass_s)
            decoded = [_decode(self._words(prompt, own), own, None, lambda: None)
                       for prompt, own in zip(prompts, params, strict=True)]
        return [GenerationOutput(text, reason, tokens, made)
                for (text, reason, made), tokens in zip(decoded, counts, strict=True)]

    def _words(self, prompt: str, params: GenerationParams) -> Iterator[str]:
        if params.temperature == 0:
            rng = random.Random(_digest("greedy", prompt))
        elif params.seed is not None:
            rng = random.Random(_digest("seeded", params.seed, prompt))
        else:
            rng = self._rng
        vocab = VOCAB[:max(1, round(params.top_p * len(VOCAB)))]
        while True:
            yield rng.choice(vocab)

    # --- memory --------------------------------------------------------------------------

    @contextmanager
    def _hold(self, nbytes: int) -> Iterator[Allocation]:
        """Allocate ``nbytes`` for one run and free them on every path. Every request's
        memory passes here: the single place for fault injection."""
        if self.hang_probability and self._faults.random() < self.hang_probability:
            self.sleep(self.hang_s)
        if self.cuda_error_probability and self._faults.random() < self.cuda_error_probability:
            raise RuntimeError("CUDA error: device-side assert triggered")
        if self.oom_probability and self._faults.random() < self.oom_probability:
            self._poisoned = self.nan_after_oom
            raise self.device.out_of_memory(nbytes)
        try:
            allocation = self.device.allocate(nbytes)
        except Exception:  # the device's OOM: all allocate raises for a size >= 0
            self._poisoned = self.nan_after_oom
            raise
        try:
            yield allocation
        finally:
            allocation.free()

    def close(self) -> None:
        """Free the weights (idempotent)."""
        self._weights.free()


def _decode(words: Iterator[str], params: GenerationParams,
            on_text: Callable[[str], bool] | None,
            step: Callable[[], None]) -> tuple[str, str, int]:
    """Append words until ``max_tokens``, a stop string, or ``on_text`` returning ``False``.

    Returns ``(text, finish_reason, tokens made)``. What ``on_text`` received, joined, is a
    prefix of ``text`` (all of it unless cancelled).
    """
    hold_back = max((len(s) for s in params.stop if s), default=1) - 1
    text, sent = "", 0
    for made in range(1, params.max_tokens + 1):
        step()
        text += (" " if text else "") + next(words)
        cut = min((i for i in (text.find(s) for s in params.stop if s) if i >= 0),
                  default=-1)
        if cut >= 0:
            text = text[:cut]
            if on_text is not None and cut > sent:
                on_text(text[sent:])
            return text, "stop", made
        safe = len(text) if made == params.max_tokens else len(text) - hold_back
        if on_text is not None and safe > sent:
            if not on_text(text[sent:safe]):
                return text, "cancelled", made
            sent = safe
    return text, "length", params.max_tokens
