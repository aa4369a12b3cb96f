"""Where model replicas publish their admission state for ``/v1/status`` and ``/readyz``.

Ray Serve routes a handle call to *some* replica; it offers no call to every replica. So each
model replica pushes its status here every ``publish_period_s``, and the ingress reads the
snapshot. An entry not refreshed within ``stale_after_s`` (a replica that died without saying
goodbye) is dropped. The registry is one small Serve deployment of the same application, so it
lives and dies with the app; if it restarts, it is full again within one publish period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.metrics import ProcessMetrics
from serve_app.replica_state import ReplicaState

logger = logging.getLogger("ray.serve")

PUBLISH_PERIOD_S = 1.0
STALE_AFTER_S = 5.0
# A departed process's last metrics stay this long, so that a scrape soon after a replica is
# replaced still sees its final counts.
METRICS_RETENTION_S = 600.0


@serve.deployment(num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})
class ReplicaRegistry:
    """Latest :class:`~serve_app.replica_state.ReplicaState` per model replica id, and the
    latest metrics exposition per process (model and ingress replicas) for ``GET /metrics``."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S,
                 metrics_retention_s: float = METRICS_RETENTION_S) -> None:
        self._stale_after_s = stale_after_s
        self._metrics_retention_s = metrics_retention_s
        self._entries: dict[str, tuple[float, ReplicaState]] = {}
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

    async def publish(self, state: ReplicaState) -> None:
        """Store a model replica's latest state."""
        self._entries[state.replica_id] = (time.monotonic(), state)

    async def snapshot(self) -> list[ReplicaState]:
        """Fresh states, sorted by replica id."""
        now = time.monotonic()
        self._entries = {k: v for k, v in self._entries.items()
                         if now - v[0] <= self._stale_after_s}
        return [state for _, (_, state) in sorted(self._entries.items())]


async def publish_forever(registry: DeploymentHandle, source_id: str, metrics: ProcessMetrics,
                          state: Callable[[], ReplicaState] | None = None) -> None:
    """Every ``PUBLISH_PERIOD_S``: a model replica's ``state()`` (when given) and the
    process's metrics exposition to the registry. Runs until cancelled; a registry that is
    restarting is logged and tried again next period, never fatal."""
    while True:
        try:
            if state is not None:
                await registry.publish.remote(state())
            await registry.publish_metrics.remote(source_id, metrics.exposition())
        except Exception:
            logger.warning("could not publish to the registry", exc_info=True)
        await asyncio.sleep(PUBLISH_PERIOD_S)
