"""``serve_app.app:build_app``: the ``import_path`` of every ``serve run`` config."""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import Application

from deployments.idempotency import IdempotencyStore
from deployments.ingress import Ingress
from deployments.model_server import ModelServer
from deployments.registry import ReplicaRegistry
from serve_app.config import parse_args
from serve_app.planning import plan_deployment

logger = logging.getLogger(__name__)

MODEL_CONSTRUCTOR_RETRIES = 3


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Build the vramgate application from a config's ``args:``.

    The graph is Ingress (HTTP, FastAPI) -> ModelServer replicas (the model behind the
    byte-budget gate), plus the ReplicaRegistry they publish their state to. Deployment options
    (``num_gpus``, ``max_ongoing_requests``) come from :func:`serve_app.planning.plan_deployment`.

    Raises:
        serve_app.config.ConfigError: unknown, misplaced or invalid keys (named in the message).
    """
    cfg = parse_args(args)
    plan = plan_deployment(cfg)
    logger.info("model deployment: num_gpus=%s max_ongoing_requests=%d (%s)",
                plan.num_gpus, plan.max_ongoing_requests, plan.how)
    raw = cfg.model_dump(mode="json")
    dep = cfg.deployment
    logging_config = {"encoding": cfg.logging.encoding, "log_level": cfg.logging.log_level}
    registry = ReplicaRegistry.bind()
    idempotency = IdempotencyStore.bind(cfg.idempotency.ttl_s, cfg.idempotency.max_entries)
    model = ModelServer.options(
        num_replicas=dep.num_replicas,
        max_ongoing_requests=plan.max_ongoing_requests,
        max_queued_requests=plan.max_queued_requests,
        ray_actor_options={"num_gpus": plan.num_gpus, "num_cpus": dep.num_cpus},
        health_check_period_s=dep.health_check_period_s,
        health_check_timeout_s=dep.health_check_timeout_s,
        # A replica that cannot hold the largest allowed request fails the same way every
        # time: give up after a few tries instead of Ray's default 20 restarts.
        max_constructor_retry_count=MODEL_CONSTRUCTOR_RETRIES,
        # A replica being removed gets no new requests from Ray; what it holds (running and
        # queued) finishes or times out within this, so nothing is cut off mid-inference.
        graceful_shutdown_timeout_s=(cfg.admission.max_queue_wait_s
                                     + cfg.admission.inference_timeout_s + 5),
        logging_config=logging_config,
    ).bind(raw, registry)
    return Ingress.options(
        num_replicas=dep.ingress_replicas,
        max_ongoing_requests=dep.ingress_max_ongoing_requests,
        logging_config=logging_config,
    ).bind(raw, model, registry, idempotency)
