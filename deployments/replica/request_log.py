"""Per-request log lines of a model replica: one at each moment of a request's life."""

from __future__ import annotations

import logging
from typing import Any

from serve_app.memory.probes import DeviceProbe

logger = logging.getLogger("ray.serve")


class RequestLog:
    """Logs ``arrived``, ``admitted``, ``finished`` and ``lease released`` for each request.

    Args:
        replica: the replica id, on every line.
        probe: the replica's device probe (a memory snapshot on every line).
    """

    def __init__(self, replica: str, probe: DeviceProbe) -> None:
        self.replica, self._probe = replica, probe

    def event(self, event: str, estimated_bytes: int, request_id: str = "",
              level: int = logging.INFO, **fields: Any) -> None:
        """Log one moment of a request with the replica, the request's estimated bytes,
        ``fields`` and a device memory snapshot. The request id is Ray Serve's (it adds it
        within the request's context) or ``request_id`` (a batch runs outside its members'
        contexts); fields that are ``None`` (a peak not measured) are left out; under
        ``logging.encoding: JSON`` every field is a JSON key (Ray's JSON formatter keeps
        ``extra`` attributes)."""
        if not logger.isEnabledFor(level):
            return
        extra = {"event": event, "replica": self.replica, "estimated_bytes": estimated_bytes,
                 **{k: v for k, v in fields.items() if v is not None},
                 **self._probe.memory_snapshot()}
        if request_id:
            extra["request_id"] = request_id
        logger.log(level, "request %s: %s", event,
                   " ".join(f"{k}={v}" for k, v in extra.items() if k != "event"), extra=extra)
