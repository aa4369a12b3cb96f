"""What a model replica needs from an engine. Engines are called from the replica's single
inference thread only (never concurrently), except ``count_tokens``, which must be
thread-safe (it runs on a helper thread before admission)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from serve_app.memory.cost_model import TransformerShape


@dataclass(frozen=True)
class GenerationParams:
    """Sampling parameters of one completion (OpenAI names; validated by the ingress).

    Attributes:
        max_tokens: new tokens to generate at most (>= 1).
        temperature: 0 = greedy (deterministic); > 0 samples.
        top_p: nucleus sampling mass in (0, 1].
        seed: makes sampling reproducible when set.
        stop: strings that end the completion (not included in the text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationOutput:
    """A finished completion: its text, why it ended (``stop`` or ``length``), token counts."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class Engine(Protocol):
    """A loaded model.

    Attributes:
        task: ``embed`` or ``generate`` (the routes it serves).
        shape: the model's dimensions, for the analytic cost estimate.
        max_seq_tokens: longest input (prompt) the model accepts, tokens.
    """

    task: str
    shape: TransformerShape
    max_seq_tokens: int

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens per text as the model will see them (special tokens included)."""

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """One real inference of exactly this shape (the profiler's unit of measurement)."""

    def canary(self) -> bool:
        """One small inference; ``True`` when its output holds no NaN/Inf (run after an OOM,
        on the inference thread)."""


class EmbeddingEngineProtocol(Engine, Protocol):
    dimensions: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """float32 ``(len(texts), dimensions)``, rows of unit L2 norm."""


class GenerationEngineProtocol(Engine, Protocol):
    def generate(self, prompt: str, params: GenerationParams,
                 on_text: Callable[[str], bool] | None = None) -> GenerationOutput:
        """Complete ``prompt``. ``on_text`` receives each new piece of text as it is decoded
        and returns ``False`` to stop early (client gone); the output then has
        ``finish_reason`` ``"cancelled"``."""

    def generate_batch(self, prompts: list[str],
                       params: list[GenerationParams]) -> list[GenerationOutput]:
        """Complete ``prompts`` (>= 1) together, in one padded batch, ``params[i]`` for
        ``prompts[i]``: they must share ``temperature`` and ``top_p`` and have no ``stop``
        strings and no ``seed`` (those run alone: a stop string ends one row early, a seed
        owns the random generator); ``max_tokens`` may differ (the batch generates to the
        largest and each row is cut at its own; see :func:`batch_params`). Returns one output
        per prompt, in order, each as :meth:`generate` would give it.

        Raises:
            ValueError: as :func:`batch_params`.
        """


def batch_params(params: list[GenerationParams]) -> GenerationParams:
    """The parameters one batched ``generate`` runs with for rows of ``params``: their
    shared ``temperature`` and ``top_p``, and the largest ``max_tokens`` (each row is cut at
    its own afterwards: greedy decoding of a row does not depend on the other rows, so its
    first ``n`` tokens are what it would make alone with ``max_tokens = n``).

    Raises:
        ValueError: ``params`` is empty, has ``stop`` strings or a ``seed``, or mixes
            temperatures or top_p.
    """
    if not params:
        raise ValueError("generate_batch needs at least one prompt")
    if any(p.stop or p.seed is not None for p in params):
        raise ValueError("generate_batch takes no stop strings and no seed")
    if len({(p.temperature, p.top_p) for p in params}) > 1:
        raise ValueError("rows of one generate_batch must share temperature and top_p")
    return GenerationParams(max_tokens=max(p.max_tokens for p in params),
                            temperature=params[0].temperature, top_p=params[0].top_p)
