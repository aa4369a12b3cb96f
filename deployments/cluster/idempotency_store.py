"""The cluster-wide Idempotency-Key table: one Serve deployment with one replica.

Every ingress replica asks it before running a keyed request, so concurrent duplicates
coalesce on one execution however many ingress and model replicas there are. One small actor
is the simplest mechanism that is right across replicas: routing by key would still need the
model replicas to share results, and a cache per ingress replica would run duplicates that
land on different ingress replicas. If it restarts, keys in flight are forgotten (their
duplicates then run again); it holds no lease and no device memory.
"""

from __future__ import annotations

from ray import serve

from serve_app.idempotency import IdempotencyTable, StoredResponse


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000,
                  ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})
class IdempotencyStore:
    """:class:`serve_app.idempotency.IdempotencyTable` behind a Serve handle."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._table = IdempotencyTable(ttl_s, max_entries)

    async def begin(self, key: str, body_hash: str) -> tuple[str, StoredResponse | None]:
        return self._table.begin(key, body_hash)

    async def finish(self, key: str, response: StoredResponse) -> None:
        self._table.finish(key, response)

    async def abort(self, key: str) -> None:
        self._table.abort(key)

    async def wait(self, key: str, timeout_s: float) -> StoredResponse | None:
        return await self._table.wait(key, timeout_s)

    async def stats(self) -> dict[str, int]:
        """``executions`` (keys run) and ``replays`` (answers served from the table)."""
        return {"executions": self._table.executions, "replays": self._table.replays}
