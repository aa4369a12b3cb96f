"""The one private Ray Serve API the project calls, isolated behind a version check.

The ingress bounds how long a request may wait in its deployment handle's queue for a model
replica (:meth:`deployments.http.model_client.ModelClient._wait_for_a_replica`). No public API
tells when Ray Serve has handed a request to a replica; ``_fetch_future_result_async()`` of a
``DeploymentResponse`` / ``DeploymentResponseGenerator`` resolves exactly then (in Ray 2.60 it
is what ``await response`` awaits before the result). It is used only on the Ray minor
versions in :data:`CHECKED_RAY_VERSIONS`, and only where it exists.

On a unary call sent over gRPC (``by_reference`` false) it resolves only with the result.
There, and on other Ray versions, :func:`replica_assigned` returns ``None`` and the ingress
does not bound that wait itself: Ray Serve still bounds the handle's queue in length
(``max_queued_requests``, then 503 ``queue_full``), and the replica counts the time since
the ingress sent the request (``sent_at_s``) against ``admission.max_queue_wait_s``, so a
request that waited too long gets 503 ``queue_timeout`` when it reaches a replica rather
than after the limit.
``tests/unit/test_ray_compat.py`` fails when the installed Ray is not one checked here or
lacks the method.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import ray
from ray.serve.handle import DeploymentResponseGenerator

# Ray minor versions on which ``_fetch_future_result_async`` was read and tested.
CHECKED_RAY_VERSIONS = ("2.60",)
PRIVATE_METHOD = "_fetch_future_result_async"


def private_api_checked(version: str) -> bool:
    """Whether Ray ``version`` (``ray.__version__``) is one the private call was checked on."""
    return ".".join(version.split(".")[:2]) in CHECKED_RAY_VERSIONS


def replica_assigned(response: Any, version: str | None = None) -> Awaitable[Any] | None:
    """An awaitable that resolves once Ray Serve has sent ``response``'s request to a
    replica (raising what the assignment raised: back-pressure, no replica), or ``None``
    where that cannot be known (an unchecked Ray ``version``, default the installed one, or
    a response without the method): the caller then does not wait for it.
    """
    if not private_api_checked(ray.__version__ if version is None else version):
        return None
    if getattr(response, "by_reference", True) is False \
            and not isinstance(response, DeploymentResponseGenerator):
        # Sent over gRPC (Ray Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED=1, which sets
        # RAY_SERVE_USE_GRPC_BY_DEFAULT): a unary call's accept comes with its result, so
        # the method resolves only when the request is done. Bounding that by the queue wait
        # refused every request that ran longer (measured: 108 of 512 completions, 503
        # queue_timeout after 4 s). A stream's accept is its first message: still usable.
        return None
    fetch = getattr(response, PRIVATE_METHOD, None)
    return None if fetch is None else fetch()
