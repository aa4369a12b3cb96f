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

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from deployments.engines.base import OpenedEngine
from deployments.engines.fake_stepping import FakeDecodeSteps
from deployments.engines.runners import EmbeddingRunner, GenerationRunner, batch_params
from deployments.engines.spec import EngineSpec
from deployments.engines.words import SPECIAL_TOKENS, VOCAB, WordFrontEnd, decode_words, digest
from serve_app.config import AppArgs, config_error
from serve_app.fake_config import FakeConfig
from serve_app.memory.cost_model import AnalyticCostModel, FittedCostModel, TransformerShape
from serve_app.memory.simulated import Allocation, SimulatedDevice, SimulatedDeviceProbe
from serve_app.request import GenerationOutput, GenerationParams, InferenceRequest


def default_shape(dimensions: int, max_seq_tokens: int) -> TransformerShape:
    """A small pretend decoder (6 layers, ``dimensions`` wide, 64-dim heads, float32)."""
    return TransformerShape(hidden_size=dimensions, intermediate_size=4 * dimensions,
                            num_layers=6, num_heads=max(1, dimensions // 64),
                            vocab_size=len(VOCAB), max_positions=max_seq_tokens,
                            dtype_bytes=4, is_decoder=True)


def exact_cost_model(bytes_per_token: int, bytes_per_request: int) -> FittedCostModel:
    """What a request of the fake engine holds, as a cost model: ``bytes_per_request +
    bytes_per_token x batch x (prompt + new)`` (the ground truth a fitted model should find,
    and the planner's estimate)."""
    return FittedCostModel(("const", "batch_tokens"),
                           (float(bytes_per_request), float(bytes_per_token)))


class FakeSpec(EngineSpec):
    """The fake engine's class-level half, read from the config's ``fake.*`` section: its
    simulated card, front end and exact analytic costs."""

    @classmethod
    def check_args(cls, args: AppArgs) -> None:
        """``memory.capacity_bytes`` / ``budget_bytes`` must fit the replica's share of the
        simulated card.

        Raises:
            ConfigError: naming the knob.
        """
        share = args.deployment.num_gpus or 1.0
        card_share = int(args.fake.device_capacity_bytes * share)
        for knob in ("capacity_bytes", "budget_bytes"):
            value = getattr(args.memory, knob)
            if value is not None and value > card_share:
                raise config_error(
                    f"memory.{knob}", f"{value} does not fit this replica's share of the "
                    f"simulated card: {share:g} x fake.device_capacity_bytes = {card_share}. "
                    "Lower it or raise deployment.num_gpus")

    @classmethod
    def front_end(cls, args: AppArgs) -> WordFrontEnd:
        return WordFrontEnd(args.fake.max_seq_tokens)

    @classmethod
    def describe(cls, args: AppArgs) -> str:
        return "the fake engine on its simulated device"

    @classmethod
    def profile_identity(cls, args: AppArgs) -> str:
        return "fake"

    @classmethod
    def device_kind(cls, args: AppArgs) -> str:
        return "simulated"

    @classmethod
    def device_identity(cls, args: AppArgs) -> tuple[str, int]:
        capacity = args.fake.device_capacity_bytes
        return f"simulated {capacity} byte card", capacity

    @classmethod
    def planned_capacity(cls, args: AppArgs) -> tuple[int, str]:
        share = args.deployment.num_gpus or 1.0
        return (int(args.fake.device_capacity_bytes * share),
                "fake.device_capacity_bytes x num_gpus")

    @classmethod
    def planned_context(cls, args: AppArgs) -> tuple[int, str]:
        return args.fake.max_seq_tokens, "fake.max_seq_tokens"

    @classmethod
    def analytic_costs(cls, args: AppArgs) -> tuple[FittedCostModel, int]:
        """The configured costs, which are exact."""
        fake = args.fake
        return exact_cost_model(fake.bytes_per_token, fake.bytes_per_request), \
            fake.weights_bytes


@dataclass
class FakeEngine(FakeSpec, FakeDecodeSteps, EmbeddingRunner, GenerationRunner):
    """Embeds and generates without a model, holding simulated device memory; serves both
    ``embed`` and ``generate`` (:mod:`deployments.engines.base`). Call from one thread.
    Its front end is :class:`~deployments.engines.words.WordFrontEnd`.

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
        oom_probability: injected fault: each run (not :meth:`profile_run`: the profile
            measures the model, not the faults) raises the device's OOM with this
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
    _: KW_ONLY
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

    kinds = ("embed", "generate")

    def __post_init__(self) -> None:
        self._faults = random.Random(self.fault_seed)
        for name in ("weights_bytes", "bytes_per_token", "bytes_per_request",
                     "latency_per_token_s", "latency_per_pass_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.shape is None:
            self.shape = default_shape(self.dimensions, self.max_seq_tokens)
        self.front = WordFrontEnd(self.max_seq_tokens)
        self.costs = exact_cost_model(self.bytes_per_token, self.bytes_per_request)
        self._rng = random.Random(self.seed)
        self._poisoned = False  # set by an OOM under nan_after_oom
        self._running = {}  # continuous batching's sequences (FakeDecodeSteps)
        self._weights: Allocation = self.device.allocate(self.weights_bytes)

    @classmethod
    def open(cls, args: AppArgs) -> OpenedEngine:
        """The engine on a simulated card of ``fake.device_capacity_bytes``, of which the
        replica holds its ``num_gpus`` share: the simulated device is per process, so it is
        built at the share's size and overruns exactly where the replica's share ends."""
        share, fake = args.deployment.num_gpus or 1.0, args.fake
        device = SimulatedDevice(int(fake.device_capacity_bytes * share),
                                 name=f"{share:g} of a simulated {fake.device_capacity_bytes} "
                                      "byte card")
        engine = cls.from_config(device, fake)
        return OpenedEngine(engine, SimulatedDeviceProbe(
            device, total_bytes=fake.device_capacity_bytes), device.allocated_bytes)

    @classmethod
    def from_config(cls, device: SimulatedDevice, fake: FakeConfig) -> FakeEngine:
        """The engine of the ``fake.*`` knobs on ``device``."""
        return cls(device, weights_bytes=fake.weights_bytes,
                   bytes_per_token=fake.bytes_per_token,
                   bytes_per_request=fake.bytes_per_request,
                   latency_per_token_s=fake.latency_per_token_s, dimensions=fake.dimensions,
                   max_seq_tokens=fake.max_seq_tokens, oom_probability=fake.oom_probability,
                   cuda_error_probability=fake.cuda_error_probability,
                   hang_probability=fake.hang_probability, hang_s=fake.hang_s,
                   nan_after_oom=fake.nan_after_oom, fault_seed=fake.fault_seed,
                   latency_per_pass_s=fake.latency_per_pass_s)

    # --- cost ----------------------------------------------------------------------------

    def request_bytes(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> int:
        """Exact device bytes a request of this shape holds while it runs."""
        return self.costs.request_bytes(batch, prompt_tokens, new_tokens)

    def analytic_model(self) -> AnalyticCostModel:
        return AnalyticCostModel(self.shape)

    def run_batch(self, requests: Sequence[InferenceRequest]) -> list[Any]:
        """One pass of ``embed`` or of ``generate`` requests (they share a kind)."""
        runners = {"embed": self.run_embed, "generate": self.run_generate}
        return runners[requests[0].kind](requests)

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """Hold exactly what a request of this shape holds, for as long as it would run
        (outside the injected faults: the profile measures the model, not the faults)."""
        with self._hold(self.request_bytes(batch, prompt_tokens, new_tokens), faults=False):
            self.sleep(batch * (prompt_tokens + new_tokens) * self.latency_per_token_s
                       + (1 + new_tokens) * self.latency_per_pass_s)

    # --- embeddings ----------------------------------------------------------------------

    def embed_ids(self, input_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """One padded batch: holds ``request_bytes(len(input_ids), longest)`` while it runs
        (inputs longer than ``max_seq_tokens`` are truncated to it).

        Returns:
            float32 ``(len(input_ids), dimensions)``, unit L2 rows; the same ids always get
            the same vector (seeded by a hash of them).

        Raises:
            torch.OutOfMemoryError: the batch does not fit on the device now.
        """
        if not input_ids:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        longest = min(max(len(ids) for ids in input_ids), self.max_seq_tokens)
        with self._hold(self.request_bytes(len(input_ids), longest)):
            self.sleep(len(input_ids) * longest * self.latency_per_token_s
                       + self.latency_per_pass_s)
            return self._vectors(input_ids)

    def canary(self) -> bool:
        """One short embedding, outside the injected faults (it checks the device's state; it
        is not traffic); ``True`` when its output is finite (see ``nan_after_oom``)."""
        with self.device.allocate(self.request_bytes(1, SPECIAL_TOKENS + 1)):
            return bool(np.isfinite(self._vectors([(0,)])).all())

    def _vectors(self, input_ids: Sequence[Sequence[int]]) -> np.ndarray:
        vectors = np.stack([self._vector(ids) for ids in input_ids])
        return np.full_like(vectors, np.nan) if self._poisoned else vectors

    def _vector(self, ids: Sequence[int]) -> np.ndarray:
        raw = np.random.default_rng(digest("embed", *ids)).standard_normal(self.dimensions)
        return (raw / np.linalg.norm(raw)).astype(np.float32)

    # --- generation ----------------------------------------------------------------------

    def generate_ids(self, ids: Sequence[int], params: GenerationParams,
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
        prompt_tokens = len(ids)
        if prompt_tokens > self.max_seq_tokens:
            raise ValueError(f"prompt of {prompt_tokens} tokens exceeds max_seq_tokens "
                             f"{self.max_seq_tokens}")
        with self._hold(self.request_bytes(1, prompt_tokens, params.max_tokens)):
            self.sleep(prompt_tokens * self.latency_per_token_s + self.latency_per_pass_s)
            text, reason, made = decode_words(
                self._words(ids, params), params, on_text,
                lambda: self.sleep(self.latency_per_token_s + self.latency_per_pass_s))
        return GenerationOutput(text, reason, prompt_tokens, made)

    def generate_batch_ids(self, ids: Sequence[Sequence[int]],
                           params: Sequence[GenerationParams]) -> list[GenerationOutput]:
        """Complete prompts together, ``params[i]`` for ``ids[i]``: holds
        ``request_bytes(len(ids), longest prompt, largest max_tokens)`` (one padded KV cache)
        and sleeps what that many tokens and passes take; each output is what
        :meth:`generate_ids` gives its prompt alone with its own ``params`` (its own prompt
        tokens, the same words, cut at its own ``max_tokens``).

        Raises:
            ValueError: as :func:`deployments.engines.base.batch_params`, or the longest
                prompt + the largest ``max_tokens`` is longer than ``max_seq_tokens``.
            torch.OutOfMemoryError: the batch does not fit on the device now.
        """
        shared = batch_params(params)
        longest = max(len(prompt) for prompt in ids)
        if longest + shared.max_tokens > self.max_seq_tokens:  # as a model's positions
            raise ValueError(f"a batch of {longest} prompt tokens (left-padded) + "
                             f"{shared.max_tokens} new exceeds max_seq_tokens "
                             f"{self.max_seq_tokens}")
        with self._hold(self.request_bytes(len(ids), longest, shared.max_tokens)):
            self.sleep(len(ids) * (longest + shared.max_tokens) * self.latency_per_token_s
                       + (1 + shared.max_tokens) * self.latency_per_pass_s)
            decoded = [decode_words(self._words(prompt, own), own, None, lambda: None)
                       for prompt, own in zip(ids, params, strict=True)]
        return [GenerationOutput(text, reason, len(prompt), made)
                for (text, reason, made), prompt in zip(decoded, ids, strict=True)]

    def _words(self, ids: Sequence[int], params: GenerationParams) -> Iterator[str]:
        if params.temperature == 0:
            rng = random.Random(digest("greedy", *ids))
        elif params.seed is not None:
            rng = random.Random(digest("seeded", params.seed, *ids))
        else:
            rng = self._rng
        vocab = VOCAB[:max(1, round(params.top_p * len(VOCAB)))]
        while True:
            yield rng.choice(vocab)

    # --- memory --------------------------------------------------------------------------

    @contextmanager
    def _hold(self, nbytes: int, faults: bool = True) -> Iterator[Allocation]:
        """Allocate ``nbytes`` for one run and free them on every path. Every request's
        memory passes here: the single place for fault injection (``faults``)."""
        if faults:
            self._inject_faults(nbytes)
        try:
            allocation = self.device.allocate(nbytes)
        except Exception:  # the device's OOM: all allocate raises for a size >= 0
            self._poisoned = self.nan_after_oom
            raise
        try:
            yield allocation
        finally:
            allocation.free()

    def _inject_faults(self, nbytes: int) -> None:
        if self.hang_probability and self._faults.random() < self.hang_probability:
            self.sleep(self.hang_s)
        if self.cuda_error_probability and self._faults.random() < self.cuda_error_probability:
            raise RuntimeError("CUDA error: device-side assert triggered")
        if self.oom_probability and self._faults.random() < self.oom_probability:
            self._poisoned = self.nan_after_oom
            raise self.device.out_of_memory(nbytes)

    def close(self) -> None:
        """Free the running sequences and the weights (idempotent)."""
        self.drop_sequences()
        self._weights.free()
