"""Files of the Batch API (``/v1/files``) in the job store's Redis.

Keys, under ``base`` (``vramgate:batches:{namespace}:``):

- ``file:{id}`` (hash): ``object`` (the :class:`~serve_app.batches.models.FileObject` JSON),
  ``lines`` (its count of non-empty lines).
- ``file:{id}:data`` (string): the content.
- ``files`` (sorted set): file ids by creation time (the listing's order).
- ``upload:{uuid}`` (string): an upload being received; renamed to ``file:{id}:data`` once it
  is whole and valid, deleted otherwise.

Why Redis rather than a directory under ``jobs.data_dir``: every ingress (on any node) reads
and writes the same files with no shared filesystem, Redis is already the place that survives
restarts (its append-only file), and one ``RENAME`` publishes a finished upload atomically. An
upload is appended chunk by chunk (``APPEND``), so it is never held in memory whole, let alone
twice; content is read back in ranges (``GETRANGE``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable

import redis.asyncio as aioredis

from serve_app.batches.models import FileObject, new_file_id
from serve_app.errors import BodyTooLargeError, InvalidRequestError

READ_CHUNK_BYTES = 1 << 20
"""The size of one ``GETRANGE`` when a file is read back."""


class JsonlChecker:
    """Checks a stream of bytes as JSONL as it arrives: every non-empty line one JSON
    object, at most ``max_lines`` lines, at most ``max_bytes`` bytes.

    Raises (from :meth:`feed` and :meth:`close`):
        InvalidRequestError: ``invalid_jsonl`` (naming the 1-based line) or
            ``too_many_lines`` (400).
        BodyTooLargeError: over ``max_bytes`` (413).
    """

    def __init__(self, max_bytes: int, max_lines: int) -> None:
        self.max_bytes, self.max_lines = max_bytes, max_lines
        self.size = self.lines = self._lineno = 0
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise BodyTooLargeError(
                f"the file exceeds jobs.batch_max_file_bytes = {self.max_bytes} bytes")
        *whole, self._partial = (self._partial + chunk).split(b"\n")
        for line in whole:
            self._line(line)

    def close(self) -> None:
        self._line(self._partial)
        self._partial = b""
        if not self.lines:
            raise InvalidRequestError("the file has no lines", code="invalid_jsonl")

    def _line(self, line: bytes) -> None:
        self._lineno += 1
        if not line.strip():
            return
        try:
            parsed = json.loads(line)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise InvalidRequestError(f"line {self._lineno} is not a JSON object: the file "
                                      "must be JSONL", code="invalid_jsonl")
        self.lines += 1
        if self.lines > self.max_lines:
            raise InvalidRequestError(
                f"the file has more than jobs.batch_max_lines = {self.max_lines} lines",
                code="too_many_lines")


class FileStore:
    """The Batch API's files of one namespace.

    Args:
        client: a ``redis.asyncio.Redis`` returning bytes.
        base: the key prefix, e.g. ``"vramgate:batches:fake:"``.
        clock: unix seconds.
    """

    def __init__(self, client: aioredis.Redis, base: str,
                 clock: Callable[[], float] = time.time) -> None:
        self._client, self._base, self._clock = client, base, clock

    def _key(self, *parts: str) -> str:
        return self._base + ":".join(parts)

    async def write(self, chunks: AsyncIterable[bytes], filename: str, purpose: str,
                    checker: JsonlChecker | None = None) -> FileObject:
        """Store the bytes of ``chunks`` as a new file, each chunk checked by ``checker``
        first; nothing is kept when a chunk raises (what ``checker`` raises passes on)."""
        temp, size = self._key("upload", uuid.uuid4().hex), 0
        try:
            await self._client.set(temp, b"")
            async for chunk in chunks:
                if checker is not None:
                    checker.feed(chunk)
                if chunk:
                    await self._client.append(temp, chunk)
                    size += len(chunk)
            if checker is not None:
                checker.close()
            return await self._publish(temp, size, filename, purpose,
                                       checker.lines if checker else 0)
        finally:
            await self._client.delete(temp)  # gone already once renamed

    async def _publish(self, temp: str, size: int, filename: str, purpose: str,
                       lines: int) -> FileObject:
        now = self._clock()
        file = FileObject(id=new_file_id(), bytes=size, created_at=int(now),
                          filename=filename, purpose=purpose)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.rename(temp, self._key("file", file.id, "data"))
            pipe.hset(self._key("file", file.id),
                      mapping={"object": file.model_dump_json(), "lines": lines})
            pipe.zadd(self._key("files"), {file.id: now})
            await pipe.execute()
        return file

    async def get(self, file_id: str) -> FileObject | None:
        raw = await self._client.hget(self._key("file", file_id), "object")
        return None if raw is None else FileObject.model_validate_json(raw)

    async def list(self, purpose: str | None = None, limit: int = 10000,
                   after: str | None = None) -> list[FileObject]:
        """Files, newest first, those after the file ``after`` (by that order)."""
        ids = [i.decode() for i in await self._client.zrevrange(self._key("files"), 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        found = []
        for file_id in ids:
            file = await self.get(file_id)
            if file is not None and purpose in (None, file.purpose):
                found.append(file)
                if len(found) >= limit:
                    break
        return found

    async def delete(self, file_id: str) -> bool:
        """Whether the file existed (it is gone now)."""
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("file", file_id), self._key("file", file_id, "data"))
            pipe.zrem(self._key("files"), file_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def read(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's content in chunks of ``READ_CHUNK_BYTES`` (none if it is gone)."""
        key, start = self._key("file", file_id, "data"), 0
        while chunk := await self._client.getrange(key, start, start + READ_CHUNK_BYTES - 1):
            yield chunk
            start += len(chunk)

    async def lines(self, file_id: str) -> AsyncIterator[tuple[int, bytes]]:
        """The file's non-empty lines with their 1-based numbers."""
        partial, number = b"", 0
        async for chunk in self.read(file_id):
            *whole, partial = (partial + chunk).split(b"\n")
            for line in whole:
                number += 1
                if line.strip():
                    yield number, line
        if partial.strip():
            yield number + 1, partial
