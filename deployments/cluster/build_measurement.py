"""Measure the model on the cluster before its deployment is created.

Where ``serve run`` builds the app there may be no GPU at all (a CPU-only head node), so
the size of a replica's share of a card, and what the model holds on it, are unknown there.
:func:`measure_before_deploy` runs one Ray task with a replica's resources (its
``num_gpus`` share, its ``num_cpus``, the application's ``runtime_env`` and so its allocator
setting), which loads the model and profiles it exactly as a replica does at start-up
(:func:`deployments.replica.profiling.measure_replica`); :func:`serve_app.planning.plan_deployment`
derives ``max_ongoing_requests`` from what it measured. The task looks in
:class:`~serve_app.measurement.MeasurementCache` first, on the node it runs on, and measures
only when nothing was cached for this config on a card of the same name and size.
"""

from __future__ import annotations

import logging
import time

import ray

from deployments.engines.registry import engine_class
from serve_app.config import AppArgs
from serve_app.measurement import (
    Measurement,
    MeasurementCache,
    measured_before_deploy,
    measurement_identity,
    measurement_key,
)

logger = logging.getLogger(__name__)


def measure_before_deploy(args: AppArgs) -> Measurement | None:
    """The measurement the deployment of ``args`` is planned from, or ``None`` where none is
    made: CPU replicas (``num_gpus: 0``), ``memory.measure_before_deploy: false``, an
    operator's own ``memory.profile_path``, or no measurement within
    ``deployment.measure_timeout_s`` (logged; the analytic estimate plans then).

    When the cluster has no GPU share free right now (the app is being redeployed over
    replicas that hold them), nothing is measured: a measurement cached here for the same
    config is used if there is one, without checking the card.

    Raises:
        the errors a replica raises when it refuses to start, unwrapped from Ray's
        (``InsufficientMemoryError``, ``OSError``, ``DeviceUnavailableError``,
        ``ConfigError``).
    """
    dep = args.deployment
    if not measured_before_deploy(args):
        return None
    if ray.available_resources().get("GPU", 0.0) < dep.num_gpus:
        return _cached_here(args)
    task = _measure.options(num_gpus=dep.num_gpus, num_cpus=dep.num_cpus)
    started = time.monotonic()
    ref = task.remote(args)
    ready, _ = ray.wait([ref], timeout=dep.measure_timeout_s)
    if not ready:
        ray.cancel(ref, force=True)
        logger.warning("no measurement within deployment.measure_timeout_s=%g s (no GPU share "
                       "free to run it on?); planning from the analytic estimate",
                       dep.measure_timeout_s)
        return None
    try:
        measurement = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        raise exc.cause from None
    logger.info("%s in %.1f s", measurement.describe(), time.monotonic() - started)
    return measurement


def _cached_here(args: AppArgs) -> Measurement | None:
    cls = engine_class(args)
    key = measurement_key(measurement_identity(args, cls.profile_identity(args)))
    found = MeasurementCache(args.memory.measurement_cache_dir).get(key)
    logger.warning("no GPU share free to measure on; %s", (
        f"planning from {found.describe()} (the card is not checked)" if found else
        "nothing cached for this config here: planning from the analytic estimate"))
    return found


# max_calls=1: the worker exits after the task, so the model and the CUDA context it held
# are freed before the replicas start (https://docs.ray.io/en/latest/ray-core/api/doc/
# ray.remote.html: max_calls).
@ray.remote(max_retries=0, max_calls=1)
def _measure(args: AppArgs) -> Measurement:
    """In a replica's resources: the cached measurement for this config and card, else a
    new one (cached)."""
    from deployments.replica.profiling import measure_replica

    cls = engine_class(args)
    device = cls.device_identity(args)
    identity = measurement_identity(args, cls.profile_identity(args))
    key = measurement_key(identity)
    cache = MeasurementCache(args.memory.measurement_cache_dir)
    if (found := cache.get(key, device)) is not None:
        return found
    measured = measure_replica(args)
    device_name, card_bytes = device
    return cache.put(Measurement(key=key, identity=identity, device_name=device_name,
                                 card_bytes=card_bytes, profile=measured.profile,
                                 max_request_bytes=measured.max_request_bytes,
                                 measured_at=time.time()))
