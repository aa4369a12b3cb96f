"""Where model replicas publish their admission state for ``/v1/status`` and ``/readyz``.

Ray Serve routes a handle call to *some* replica; it offers no call to every replica. So each
model replica pushes its status here every ``publish_period_s``, and the ingress reads the
snapshot. An entry not refreshed within ``stale_after_s`` (a replica that died without saying
goodbye) is dropped. The registry is one small Serve deployment of the same application, so it
lives and dies with the app; if it restarts, it is full again within one publish period.
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve

PUBLISH_PERIOD_S = 1.0
STALE_AFTER_S = 5.0
# A departed process's last metrics stay this long, so that a scrape soon after a replica is
# replaced still sees its final counts.
METRICS_RETENTION_S = 600.0


@serve.deployment(num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})
class ReplicaRegistry:
    """Latest status dict per model replica id, and the latest metrics exposition per
    process (model and ingress replicas) for ``GET /metrics``."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S,
                 metrics_retention_s: float = METRICS_RETENTION_S) -> None:
        self._stale_after_s = stale_after_s
        self._metrics_retention_s = metrics_retention_s
        self._entries: dict[str, tuple[float, dict[str, Any]]] = {}
        self._metrics: dict[str, tuple[float, str]] = {}

    async def publish_metrics(self, source_id: str, exposition: str) -> None:
        """Store ``source_id``'s latest metrics (Prometheus text; its series are cumulative,
        so the latest replaces the previous)."""
        self._metrics[source_id] = (time.monotonic(), exposition)

    async def metrics(self) -> list[str]:
        """Every process's latest exposition, sorted by source id."""
        now = time.monotonic()
        self._metrics = {k: v for k, v in self._metrics.items()
                         if now - v[0] <= self._metrics_retention_s}
        return [text for _, (_, text) in sorted(self._metrics.items())]

    async def publish(self, replica_id: str, status: dict[str, Any]) -> None:
        self._entries[replica_id] = (time.monotonic(), status)

    async def withdraw(self, replica_id: str) -> None:
        self._entries.pop(replica_id, None)

    async def snapshot(self) -> list[dict[str, Any]]:
        """Fresh statuses, sorted by replica id."""
        now = time.monotonic()
        self._entries = {k: v for k, v in self._entries.items()
                         if now - v[0] <= self._stale_after_s}
        return [status for _, (_, status) in sorted(self._entries.items())]
