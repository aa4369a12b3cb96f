"""Idempotency-Key bookkeeping: one execution per key, every caller gets the same answer.

Pure (asyncio only): the state machine behind
:class:`deployments.cluster.idempotency_store.IdempotencyStore`.
A key is *running* from its first request until that request's outcome is recorded; later
requests with the same key and body wait for that outcome (coalescing), requests after it
replay it until ``ttl_s`` has passed, and a different body under the same key is refused.
Transient refusals (503) are not recorded: the key is released so a retry runs again.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: status, headers to replay, JSON body."""

    status_code: int
    headers: dict[str, str]
    body: Any


@dataclass
class _Entry:
    body_hash: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    response: StoredResponse | None = None
    expires_at: float = float("inf")


class IdempotencyTable:
    """Keys -> entries, bounded (``max_entries``, least recently used first out) and expiring.

    Args:
        ttl_s: how long a finished response is replayed.
        max_entries: most keys remembered at once.
        clock: monotonic seconds.
    """

    def __init__(self, ttl_s: float, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s, self._max_entries, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.executions = 0
        self.replays = 0

    def begin(self, key: str, body_hash: str) -> tuple[str, StoredResponse | None]:
        """``("run", None)``: the caller executes and must :meth:`finish` or :meth:`abort`;
        ``("wait", None)``: another caller runs it, :meth:`wait` for the outcome;
        ``("replay", response)``; ``("mismatch", None)``: same key, different body."""
        self._expire()
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _Entry(body_hash)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
            self.executions += 1
            return "run", None
        self._entries.move_to_end(key)
        if entry.body_hash != body_hash:
            return "mismatch", None
        if entry.response is not None:
            self.replays += 1
            return "replay", entry.response
        return "wait", None

    def finish(self, key: str, response: StoredResponse) -> None:
        """Record the outcome of a running key and wake its waiters."""
        entry = self._entries.get(key)
        if entry is not None and entry.response is None:
            entry.response, entry.expires_at = response, self._clock() + self._ttl_s
            entry.done.set()

    def abort(self, key: str) -> None:
        """Forget a running key (its request failed transiently); waiters run it themselves."""
        entry = self._entries.pop(key, None)
        if entry is not None and entry.response is None:
            entry.done.set()

    async def wait(self, key: str, timeout_s: float) -> StoredResponse | None:
        """The outcome of a running key, or ``None`` if it was aborted, expired or took longer
        than ``timeout_s``."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            async with asyncio.timeout(timeout_s):
                await entry.done.wait()
        except TimeoutError:
            return None
        if entry.response is not None:
            self.replays += 1
        return entry.response

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, e in self._entries.items() if e.expires_at <= now]:
            del self._entries[key]
