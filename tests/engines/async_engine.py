"""A test engine that schedules itself (:class:`deployments.engines.base.AsyncScheduler`): one
``asyncio`` task steps every running request at once, a word per request per tick, as an
engine with its own continuous batching would. Each running request holds ``BYTES_PER_TOKEN``
per token of prompt + ``max_tokens`` (touched host memory, so a profile measures it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from deployments.engines.base import AsyncScheduler
from deployments.engines.words import VOCAB, WordFrontEnd
from serve_app.admission.budget import Lease
from serve_app.config import AppArgs
from serve_app.request import InferenceRequest
from serve_app.stream_events import Finished, TextPiece

BYTES_PER_TOKEN = 64 << 10
TICK_S = 0.002


class TickingScheduler(AsyncScheduler):
    """Serves ``generate``: every request's text is the words ``VOCAB[1..max_tokens]``, one
    per tick of ``tick_s`` seconds."""

    kinds = ("generate",)
    max_seq_tokens = 64

    def __init__(self, tick_s: float = TICK_S) -> None:
        self.tick_s = tick_s
        self.steps: dict[int, asyncio.Queue[None]] = {}  # running requests, by lease id
        self.aborted: list[int] = []
        self._ticker: asyncio.Task | None = None

    @classmethod
    def front_end(cls, args: AppArgs) -> WordFrontEnd:
        return WordFrontEnd(cls.max_seq_tokens)

    @classmethod
    def load(cls, args: AppArgs, device: str) -> TickingScheduler:
        return cls()

    async def submit(self, request: InferenceRequest, lease: Lease,
                     ) -> AsyncIterator[TextPiece | Finished]:
        tokens = request.params.max_tokens
        held = b"\1" * (BYTES_PER_TOKEN * (request.prompt_tokens + tokens))  # noqa: F841
        step = self.steps[lease.lease_id] = asyncio.Queue()
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick())
        try:
            for n in range(1, tokens + 1):
                await step.get()
                yield TextPiece(f" {VOCAB[n % len(VOCAB)]}")
            yield Finished("length", request.prompt_tokens, tokens)
        finally:
            self.steps.pop(lease.lease_id, None)

    async def _tick(self) -> None:
        while self.steps:  # one step for every running request, then the next tick
            for step in list(self.steps.values()):
                step.put_nowait(None)
            await asyncio.sleep(self.tick_s)

    async def abort(self, lease_id: int) -> None:
        self.aborted.append(lease_id)
        self.steps.pop(lease_id, None)
