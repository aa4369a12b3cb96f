"""Batches of the Batch API (``/v1/batches``) in the job store's Redis.

Keys, under ``base`` (``vramgate:batches:{namespace}:``, shared with
:class:`~serve_app.batches.files.FileStore`):

- ``batch:{id}`` (hash): ``object`` (the :class:`~serve_app.batches.models.Batch` JSON,
  ``request_counts`` aside), ``tenant``, ``cursor`` (lines submitted so far, in order).
- ``batch:{id}:lines`` (list): the validated lines, ``{"custom_id", "body"}`` JSON, in file
  order.
- ``batch:{id}:running`` (hash): ``custom_id`` -> job id of each line submitted and not
  recorded yet.
- ``batch:{id}:out`` / ``batch:{id}:err`` (hashes): ``custom_id`` -> its output or error line
  (JSON). A line is recorded once, in one of them (:data:`RECORD`, one script).
- ``batches`` (sorted set): ids by creation time; ``active`` (set): ids not final.
- ``lock:{id}`` (string, PX): the ingress that drives the batch now (its token).

Status changes are WATCH/MULTI transactions that check the status they leave, so two
ingresses racing (a cancel against a finish) see one winner.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from serve_app.batches.models import FINAL_BATCH_STATUSES, Batch, BatchStatus, RequestCounts

RECORD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
then return 0 end
redis.call('HSET', KEYS[tonumber(ARGV[3])], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""
"""Record a line's output (``ARGV[3]`` 1) or error (2) unless it is recorded already;
it leaves ``running``. KEYS: out, err, running; ARGV: custom_id, line, 1 or 2."""

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[2] == '0' then return redis.call('DEL', KEYS[1]) end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
"""Renew (``ARGV[2]`` ms) or release (0) a lock held with token ``ARGV[1]``."""


class BatchStore:
    """The batches of one namespace.

    Args:
        client: a ``redis.asyncio.Redis`` returning bytes.
        base: the key prefix, e.g. ``"vramgate:batches:fake:"``.
        clock: unix seconds.

    Attributes:
        locks: the batches' driving locks (:class:`BatchLocks`).
    """

    def __init__(self, client: aioredis.Redis, base: str,
                 clock: Callable[[], float] = time.time) -> None:
        self._client, self._base, self._clock = client, base, clock
        self._record = client.register_script(RECORD)
        self.locks = BatchLocks(client, base)

    def _key(self, *parts: str) -> str:
        return self._base + ":".join(parts)

    async def create(self, batch: Batch, tenant: str) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hset(self._key("batch", batch.id), mapping={
                "object": batch.model_dump_json(exclude={"request_counts"}),
                "tenant": tenant, "cursor": 0})
            # Now, not the whole second of created_at: batches of one second keep their order.
            pipe.zadd(self._key("batches"), {batch.id: self._clock()})
            pipe.sadd(self._key("active"), batch.id)
            await pipe.execute()

    async def get(self, batch_id: str) -> Batch | None:
        """The batch, its ``request_counts`` counted now; ``None`` if unknown."""
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hget(self._key("batch", batch_id), "object")
            pipe.llen(self._key("batch", batch_id, "lines"))
            pipe.hlen(self._key("batch", batch_id, "out"))
            pipe.hlen(self._key("batch", batch_id, "err"))
            raw, total, done, failed = await pipe.execute()
        if raw is None:
            return None
        batch = Batch.model_validate_json(raw)
        batch.request_counts = RequestCounts(total=total, completed=done, failed=failed)
        return batch

    async def tenant(self, batch_id: str) -> str | None:
        raw = await self._client.hget(self._key("batch", batch_id), "tenant")
        return None if raw is None else raw.decode()

    async def list(self, limit: int, after: str | None = None) -> tuple[list[Batch], bool]:
        """Up to ``limit`` batches, newest first, after the batch ``after``; and whether more
        follow."""
        ids = [i.decode() for i in await self._client.zrevrange(self._key("batches"), 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        found = [batch for i in ids[:limit] if (batch := await self.get(i)) is not None]
        return found, len(ids) > limit

    async def active(self) -> list[str]:
        """The ids of the batches not final."""
        return sorted(i.decode() for i in await self._client.smembers(self._key("active")))

    async def transition(self, batch_id: str, leaving: Collection[BatchStatus],
                         to: BatchStatus, **changes: Any) -> Batch | None:
        """Move the batch from a status in ``leaving`` to ``to`` (its ``{to}_at`` set now,
        ``changes`` applied); ``None`` (nothing changed) if it is unknown or in another
        status."""
        key = self._key("batch", batch_id)
        async with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.hget(key, "object")
                    if raw is None or (batch := Batch.model_validate_json(raw)).status \
                            not in leaving:
                        return None
                    if f"{to}_at" in Batch.model_fields:
                        changes[f"{to}_at"] = int(self._clock())
                    batch = batch.model_copy(update={"status": to, **changes})
                    pipe.multi()
                    pipe.hset(key, "object", batch.model_dump_json(exclude={"request_counts"}))
                    if to in FINAL_BATCH_STATUSES:
                        pipe.srem(self._key("active"), batch_id)
                    await pipe.execute()
                    return batch
                except WatchError:
                    continue

    async def set_lines(self, batch_id: str, lines: list[str]) -> None:
        """Store the validated lines (JSON each), replacing any stored before."""
        key = self._key("batch", batch_id, "lines")
        await self._client.delete(key)
        for start in range(0, len(lines), 1000):
            await self._client.rpush(key, *lines[start:start + 1000])

    async def lines(self, batch_id: str, start: int, stop: int) -> list[dict[str, Any]]:
        """Lines ``start`` to ``stop - 1`` (0-based), parsed."""
        raw = await self._client.lrange(self._key("batch", batch_id, "lines"), start,
                                        stop - 1)
        return [json.loads(line) for line in raw]

    async def cursor(self, batch_id: str) -> int:
        return int(await self._client.hget(self._key("batch", batch_id), "cursor") or 0)

    async def submitted(self, batch_id: str, custom_id: str, job_id: str | None,
                        cursor: int) -> None:
        """Note a line's job (``None``: it has none, it was recorded) and the cursor past
        it, together."""
        async with self._client.pipeline(transaction=True) as pipe:
            if job_id is not None:
                pipe.hset(self._key("batch", batch_id, "running"), custom_id, job_id)
            pipe.hset(self._key("batch", batch_id), "cursor", cursor)
            await pipe.execute()

    async def running(self, batch_id: str) -> dict[str, str]:
        """``custom_id`` -> job id of the lines submitted and not recorded."""
        found = await self._client.hgetall(self._key("batch", batch_id, "running"))
        return {k.decode(): v.decode() for k, v in found.items()}

    async def recorded(self, batch_id: str, custom_id: str) -> bool:
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hexists(self._key("batch", batch_id, "out"), custom_id)
            pipe.hexists(self._key("batch", batch_id, "err"), custom_id)
            return any(await pipe.execute())

    async def record(self, batch_id: str, custom_id: str, line: dict[str, Any],
                     failed: bool) -> bool:
        """Record the line's output (or error, ``failed``) once: ``False`` when it was
        recorded already (then nothing changes)."""
        keys = [self._key("batch", batch_id, part) for part in ("out", "err", "running")]
        args = [custom_id, json.dumps(line, separators=(",", ":")), 2 if failed else 1]
        return bool(await self._record(keys=keys, args=args))

    async def results(self, batch_id: str, custom_ids: list[str],
                      failed: bool) -> list[bytes | None]:
        """The recorded output (or error) lines of ``custom_ids``, ``None`` where none."""
        if not custom_ids:
            return []
        key = self._key("batch", batch_id, "err" if failed else "out")
        return await self._client.hmget(key, custom_ids)


class BatchLocks:
    """``lock:{id}``: which ingress drives a batch (its token), for ``ttl_ms`` after its last
    renewal."""

    def __init__(self, client: aioredis.Redis, base: str) -> None:
        self._client, self._base = client, base
        self._renew = client.register_script(RENEW)

    def _key(self, *parts: str) -> str:
        return self._base + ":".join(parts)

    async def lock(self, batch_id: str, token: str, ttl_ms: int) -> bool:
        """Take the batch's lock for ``ttl_ms`` if nobody holds it."""
        return bool(await self._client.set(self._key("lock", batch_id), token, nx=True,
                                           px=ttl_ms))

    async def renew(self, batch_id: str, token: str, ttl_ms: int) -> bool:
        """Extend the lock held with ``token``; ``False`` if it is not held so any more."""
        return bool(await self._renew(keys=[self._key("lock", batch_id)], args=[token, ttl_ms]))

    async def unlock(self, batch_id: str, token: str) -> None:
        await self._renew(keys=[self._key("lock", batch_id)], args=[token, 0])
