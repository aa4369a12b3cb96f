"""The fake engine's continuous batching: the decode-step schedule of
:mod:`deployments.engines.stepping` on the simulated device, with a paged KV cache.

Each running sequence holds its KV cache as blocks of
:data:`~deployments.engines.stepping.KV_BLOCK_TOKENS` tokens (``bytes_per_token`` each),
taken from the simulated device as it grows, as vLLM's paged cache does; a step also holds
``bytes_per_request`` per sequence in it while it runs (its activations). A completion's lease
(``bytes_per_token x (prompt + max_tokens)`` rounded up to whole blocks + ``bytes_per_request``:
its price) therefore covers everything it ever holds. A step takes ``latency_per_pass_s`` plus
``latency_per_token_s`` per token it processes (each joining prompt, one per running
sequence): a lone completion of ``p`` prompt and ``m`` new tokens costs ``(p + m)`` tokens, as in
a whole pass, in ``m`` steps. Injected faults apply once per step: an OOM fails every sequence
of the step (their memory is freed first).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from deployments.engines.stepping import (
    KV_BLOCK_TOKENS,
    DecodeStepper,
    SequenceStart,
    SequenceUpdate,
    StopStrings,
    kv_blocks,
)
from serve_app.memory.simulated import Allocation


@dataclass(eq=False)
class _FakeSequence:
    start: SequenceStart
    words: Iterator[str]
    stop: StopStrings
    blocks: list[Allocation] = field(default_factory=list)
    tokens: int = 0

    @property
    def cached(self) -> int:
        return len(self.start.ids) + self.tokens


class FakeDecodeSteps(DecodeStepper):
    """:class:`deployments.engines.stepping.DecodeStepper` for
    :class:`deployments.engines.fake.FakeEngine` (see module docstring)."""

    @property
    def kv_bytes_per_token(self) -> int:
        return self.bytes_per_token

    _running: dict[int, _FakeSequence]  # by seq_id; the engine's __post_init__ makes it

    def kv_tokens_held(self) -> int:
        return sum(len(s.blocks) for s in self._running.values()) * KV_BLOCK_TOKENS

    @staticmethod
    def kv_tokens_for(rows: Sequence[tuple[int, int]]) -> int:
        return sum(kv_blocks(held + coming) for held, coming in rows) * KV_BLOCK_TOKENS

    def decode_step(self, joining: Sequence[SequenceStart],
                    leaving: Sequence[int]) -> dict[int, SequenceUpdate]:
        """One step. Raises ``ValueError`` for a prompt + ``max_tokens`` over
        ``max_seq_tokens``, the device's OOM (injected, or the cache does not fit)."""
        running = self._running
        for seq_id in leaving:
            if (sequence := running.pop(seq_id, None)) is not None:
                _free(sequence)
        for start in joining:
            if len(start.ids) + start.params.max_tokens > self.max_seq_tokens:
                self.drop_sequences()
                raise ValueError(f"prompt of {len(start.ids)} tokens + max_tokens "
                                 f"{start.params.max_tokens} exceeds max_seq_tokens "
                                 f"{self.max_seq_tokens}")
            running[start.seq_id] = _FakeSequence(start, self._words(start.ids, start.params),
                                                  StopStrings(start.params.stop))
        if not running:
            return {}
        work_tokens = sum(len(s.ids) for s in joining) + len(running) - len(joining)
        try:
            with self._hold(self.bytes_per_request * len(running)):
                for sequence in running.values():
                    self._grow(sequence, sequence.cached + 1)
                self.sleep(self.latency_per_pass_s + work_tokens * self.latency_per_token_s)
        except BaseException:
            self.drop_sequences()
            raise
        updates = {seq_id: self._advance(s) for seq_id, s in running.items()}
        for seq_id, update in updates.items():
            if update.finish_reason is not None:
                _free(running.pop(seq_id))
        return updates

    def drop_sequences(self) -> None:
        """Free every running sequence (after a failed step)."""
        for sequence in self._running.values():
            _free(sequence)
        self._running.clear()

    def _grow(self, sequence: _FakeSequence, tokens: int) -> None:
        while len(sequence.blocks) * KV_BLOCK_TOKENS < tokens:
            sequence.blocks.append(
                self.device.allocate(KV_BLOCK_TOKENS * self.bytes_per_token))

    def _advance(self, sequence: _FakeSequence) -> SequenceUpdate:
        params = sequence.start.params
        sequence.tokens += 1
        word = next(sequence.words)
        last = sequence.tokens >= params.max_tokens
        text = sequence.stop.feed((" " if sequence.tokens > 1 else "") + word, final=last)
        if sequence.stop.hit:
            return SequenceUpdate(text, sequence.tokens, "stop")
        return SequenceUpdate(text, sequence.tokens, "length" if last else None)


def _free(sequence: _FakeSequence) -> None:
    for block in sequence.blocks:
        block.free()
    sequence.blocks.clear()
