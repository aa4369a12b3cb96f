"""``serve_app.app:build_app``: the ``import_path`` of every ``serve run`` config."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import ray
from ray.serve import Application
from ray.serve.config import BackpressureConfig

from deployments.cluster.autoscaling import QUEUE_POLICY_CLASS_PATH
from deployments.cluster.build_measurement import measure_before_deploy
from deployments.cluster.fail_fast import REFUSALS, DeploymentRefused, stop_serve_run_with
from deployments.cluster.idempotency_store import IdempotencyStore
from deployments.cluster.job_broker import JobBroker, broker_data_dir
from deployments.cluster.replica_registry import ReplicaRegistry
from deployments.cluster.router import ROUTER_CLASS_PATH
from deployments.engines.registry import engine_class
from deployments.http.ingress import Ingress
from deployments.http.served_models import ModelBinding
from deployments.replica.model_server import ModelServer
from serve_app.app_config import parse_models
from serve_app.config import AppArgs
from serve_app.kinds import context_problems
from serve_app.placement import cluster_cards, gpu_placement_problem, packing_problem
from serve_app.planning import DeploymentPlan, plan_deployment

logger = logging.getLogger(__name__)

MODEL_CONSTRUCTOR_RETRIES = 3
#: ``deployment.request_router`` -> the router class (``None``: Ray Serve's default).
REQUEST_ROUTERS = {"budget": ROUTER_CLASS_PATH, "pow2": None}


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Build the vramgate application from a config's ``args:``.

    The graph is Ingress (HTTP, FastAPI) -> one model deployment per model (``args.models``,
    :func:`serve_app.app_config.parse_models`; one without it): ModelServer replicas, the
    model behind the byte-budget gate, plus the ReplicaRegistry they publish their state to
    and, for durable jobs without ``jobs.redis_url``, the JobBroker that runs each model's
    embedded Redis. Deployment options (``num_gpus``, ``max_ongoing_requests``) come from
    :func:`serve_app.planning.plan_deployment`, per model.

    The deployments get the validated args (parsed once, here) and the engine is resolved
    here too (:func:`deployments.engines.registry.engine_class`), so a bad engine name or
    engine-specific setting fails the deployment at once.

    Raises:
        serve_app.config.ConfigError: unknown, misplaced or invalid keys (named in the
            message), or an engine that cannot be resolved or refuses the args.
        DeploymentRefused: no node of the cluster can ever place a model replica, or the
            models' GPU shares cannot all be placed at once.
        InsufficientMemoryError, OSError, DeviceUnavailableError: the measurement made
            before the deployment refused (:mod:`deployments.cluster.build_measurement`).

    Every refusal is final: it is logged as one line and ends any ``serve run`` waiting on
    this cluster (:func:`deployments.cluster.fail_fast.stop_serve_run`), which would otherwise wait
    forever on an application that cannot deploy.
    """
    try:
        models = parse_models(args)
        planned = [_plan_on_cluster(cfg) for cfg in _placeable(models)]
    except REFUSALS as exc:
        stop_serve_run_with(exc)
        raise
    cfg = planned[0][0]
    logging_config = {"encoding": cfg.logging.encoding, "log_level": cfg.logging.log_level}
    registry = ReplicaRegistry.bind()
    idempotency = IdempotencyStore.bind(cfg.idempotency.ttl_s, cfg.idempotency.max_entries)
    bindings = [_bind_model(cfg, plan, registry, logging_config, len(planned) > 1)
                for cfg, plan in planned]
    return Ingress.options(**_ingress_options(cfg), logging_config=logging_config,
                           ).bind(bindings, registry, idempotency)


def _ingress_options(cfg: AppArgs) -> dict[str, Any]:
    """The ingress deployment's Ray Serve options."""
    dep = cfg.deployment
    return dict(
        num_replicas=dep.ingress_replicas,
        max_ongoing_requests=dep.ingress_max_ongoing_requests,
        # Overload beyond the ingress's cap is refused by Ray's proxy, before it costs the
        # ingress anything: on a saturated CPU the ingress's own refusals came too late.
        max_queued_requests=dep.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503,
                                               retry_after_s=dep.ingress_retry_after_s),
        # A redeploy starts the new ingress before the old one stops: it holds no device and
        # no state, so HTTP is never left without one (it may wait for the job store).
        max_surge_percent=100,
    )


def _bind_model(cfg: AppArgs, plan: DeploymentPlan, registry: Application,
                logging_config: dict[str, Any], named: bool) -> ModelBinding:
    """One model's deployment (and its embedded job broker): named ``ModelServer`` in an
    app of one model, ``ModelServer:<model.name>`` (``JobBroker:<model.name>``) in an app of
    several."""
    logger.info("model deployment of %r: num_gpus=%s max_ongoing_requests=%d (%s)",
                cfg.model.name, plan.num_gpus, plan.max_ongoing_requests, plan.how)
    suffix = f":{cfg.model.name}" if named else ""
    broker = JobBroker.options(name=f"JobBroker{suffix}").bind(broker_data_dir(cfg)) \
        if cfg.jobs.enabled and not cfg.jobs.redis_url else None
    model = ModelServer.options(name=f"ModelServer{suffix}", **_model_options(cfg, plan),
                                logging_config=logging_config,
                                ).bind(cfg, registry, plan.summary(), broker)
    return ModelBinding(cfg, model, broker)


def _placeable(models: list[AppArgs]) -> list[AppArgs]:
    """``models``, once the cluster is known to be able to place all their replicas.

    Raises:
        DeploymentRefused: no node can ever hold one of them, or their GPU shares cannot all
            be packed onto the cluster's GPUs (:mod:`serve_app.placement`)."""
    if ray.is_initialized():
        nodes = ray.nodes()
        for cfg in models:
            if problem := gpu_placement_problem(cfg, nodes):
                raise DeploymentRefused(problem)
        if problem := packing_problem(models, cluster_cards(nodes)):
            raise DeploymentRefused(problem)
    return models


def _model_options(cfg: AppArgs, plan: DeploymentPlan) -> dict[str, Any]:
    """The model deployment's Ray Serve options."""
    dep = cfg.deployment
    return dict(
        **_scaling_options(cfg),
        max_ongoing_requests=plan.max_ongoing_requests,
        max_queued_requests=plan.max_queued_requests,
        ray_actor_options={"num_gpus": plan.num_gpus, "num_cpus": dep.num_cpus},
        health_check_period_s=dep.health_check_period_s,
        health_check_timeout_s=dep.health_check_timeout_s,
        max_surge_percent=dep.max_surge_percent,
        # A replica that cannot hold the largest allowed request fails the same way every
        # time: give up after a few tries instead of Ray's default 20 restarts.
        max_constructor_retry_count=MODEL_CONSTRUCTOR_RETRIES,
        # A replica being removed gets no new requests from Ray; what it holds (running and
        # queued) finishes or times out within this, so nothing is cut off mid-inference.
        graceful_shutdown_timeout_s=(cfg.admission.max_queue_wait_s
                                     + cfg.admission.inference_timeout_s + 5))


def _plan_on_cluster(cfg: AppArgs) -> tuple[AppArgs, DeploymentPlan]:
    """The deployment plan, measured on the cluster where it can be
    (:func:`deployments.cluster.build_measurement.measure_before_deploy`), and the args the replicas
    get: with the measurement's profile as ``memory.profile_path``, so that a replica on a
    node that can read it checks it against its own device instead of profiling again.

    Raises:
        the refusals of :data:`deployments.cluster.fail_fast.REFUSALS`, from the measurement.
    """
    measurement = measure_before_deploy(cfg) if ray.is_initialized() else None
    plan = plan_deployment(cfg, engine := engine_class(cfg), measurement)
    for problem in context_problems(cfg.limits, engine.kinds, engine.planned_context(cfg)):
        logger.warning("model %r: %s; requests are planned within it", cfg.model.name, problem)
    if measurement is not None and measurement.profile_path:
        memory = cfg.memory.model_copy(update={"profile_path": measurement.profile_path})
        cfg = cfg.model_copy(update={"memory": memory})
    return cfg, replace(plan, measurement=measurement.summary() if measurement else None)


def _scaling_options(cfg: AppArgs) -> dict[str, Any]:
    """How many model replicas and how requests reach them: a fixed ``num_replicas``, or
    autoscaling on the admission queue (:mod:`deployments.cluster.autoscaling`: Ray's own delays are
    0 because the policy applies ``upscale_delay_s`` / ``downscale_delay_s`` itself); and the
    budget-aware request router (:mod:`deployments.cluster.router`) unless ``request_router: pow2``.
    """
    dep = cfg.deployment
    options: dict[str, Any] = {}
    if (router := REQUEST_ROUTERS[dep.request_router]) is not None:
        options["request_router_config"] = {
            "request_router_class": router,
            "request_routing_stats_period_s": dep.routing_stats_period_s,
            "request_routing_stats_timeout_s": max(5.0, 2 * dep.routing_stats_period_s)}
    if not dep.autoscaling:
        return {**options, "num_replicas": dep.num_replicas}
    options["autoscaling_config"] = {
        "min_replicas": dep.min_replicas or 1, "max_replicas": dep.max_replicas,
        "initial_replicas": dep.num_replicas,
        "upscale_delay_s": 0, "downscale_delay_s": 0,
        "metrics_interval_s": dep.autoscaling_metrics_interval_s,
        "look_back_period_s": dep.autoscaling_look_back_s,
        "policy": {"policy_function": QUEUE_POLICY_CLASS_PATH, "policy_kwargs": {
            "max_queue_len": cfg.admission.max_queue_len,
            "upscale_delay_s": dep.upscale_delay_s,
            "downscale_delay_s": dep.downscale_delay_s}}}
    return options
