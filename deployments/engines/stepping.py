"""The engine's side of token-level (iteration-level) continuous batching.

An engine that generates and is a :class:`DecodeStepper` offers one call,
:meth:`DecodeStepper.decode_step`, run on the replica's inference thread by
:class:`deployments.replica.decode_loop.DecodeLoop`: drop the sequences that left (their KV
cache is freed), prefill the sequences that join (each gets its first token), and decode one
token for every sequence already running, all in one step; sequences that finish in the step
(an EOS id, a stop string, ``max_tokens``) are freed in it too. What joins when is the loop's
business (:mod:`deployments.replica.decode_loop`); which tokens come out is
the engine's, per sequence: a greedy sequence gets exactly the tokens it gets alone.

Iteration-level scheduling as Orca (Yu et al., OSDI 2022, "Orca: A Distributed Serving
System for Transformer-Based Generative Models") introduced it and vLLM and TGI run it. No
torch here: the fake engine steps on machines without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.request import GenerationParams

KV_BLOCK_TOKENS = 16
"""Tokens per KV-cache block: vLLM's default ``block_size`` (docs.vllm.ai, engine arguments,
``--block-size``). The unit ``/v1/status`` counts the cache in; a completion's lease covers
the blocks of its prompt + ``max_tokens`` (its price is padded to whole blocks:
``batching.pad_to_multiple_of`` defaults to the same 16)."""


def kv_blocks(tokens: int) -> int:
    """Blocks that hold ``tokens`` tokens (ceil division)."""
    return -(-tokens // KV_BLOCK_TOKENS)


@dataclass(frozen=True)
class SequenceStart:
    """A sequence joining the running batch: ``seq_id`` (unique on the replica), its prompt
    token ids and its parameters."""

    seq_id: int
    ids: tuple[int, ...]
    params: GenerationParams


@dataclass(frozen=True)
class SequenceUpdate:
    """What one step did for one sequence.

    Attributes:
        text: new text, final: a stop string never shows, not even in part.
        completion_tokens: tokens generated so far.
        finish_reason: ``stop`` (an EOS id or a stop string), ``length`` (``max_tokens``), or
            ``None`` while it runs (it takes part in the next step).
    """

    text: str
    completion_tokens: int
    finish_reason: str | None = None


class DecodeStepper(ABC):
    """The capability of a :class:`~deployments.engines.base.PassRunner` that generates to
    step a running decode batch (module docstring): what
    :class:`deployments.replica.decode_loop.DecodeLoop` needs. The replica runs completions
    on continuous batching when the engine is one (``isinstance``), its :attr:`decode_steps`
    is true and ``batching.continuous`` is on."""

    @property
    def decode_steps(self) -> bool:
        """Whether this loaded model can step (a model may not, e.g. with sliding-window
        attention); ``True`` by default."""
        return True

    @property
    @abstractmethod
    def kv_bytes_per_token(self) -> int:
        """Device bytes one token's KV cache takes (all layers, K and V)."""

    @abstractmethod
    def decode_step(self, joining: Sequence[SequenceStart],
                    leaving: Sequence[int]) -> dict[int, SequenceUpdate]:
        """One step (see module docstring). Returns an update per sequence in the step (the
        joining ones and those running before it). On any error every sequence of the
        engine is dropped and its memory freed before the error propagates.

        Raises:
            torch.OutOfMemoryError: the device ran out of memory during the step.
        """

    @abstractmethod
    def kv_tokens_held(self) -> int:
        """Token slots of KV cache held now (padding included where the cache is dense)."""

    @abstractmethod
    def kv_tokens_for(self, rows: Sequence[tuple[int, int]]) -> int:
        """The most token slots the cache will hold if sequences with ``rows`` = ``(tokens
        held now, tokens still to generate)`` each run together to their ends, none joining:
        for a paged cache the blocks of each one's total; for a left-padded dense one, at
        each step the sequences still running x the longest of them
        (:meth:`deployments.engines.decode_batch.DenseDecodeBatch.kv_tokens_for`)."""


class StopStrings:
    """Cuts text at the first stop string, and holds back any tail that could still become
    one, so a streamed client never sees part of a stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = tuple(s for s in stop if s)
        self.text = ""
        self.emitted = 0
        self.hit = False

    def feed(self, piece: str, final: bool = False) -> str:
        """Add ``piece``; return the text that may be emitted now ("" once a stop string
        was seen: tokens decoded after it are dropped)."""
        if self.hit:
            return ""
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.text = True, self.text[:cut]
            safe_end = cut
        elif final:
            safe_end = len(self.text)
        else:
            safe_end = len(self.text) - self._held_back()
        out, self.emitted = self.text[self.emitted:safe_end], max(self.emitted, safe_end)
        return out

    def _held_back(self) -> int:
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:n]):
                    longest = max(longest, n)
                    break
        return longest
