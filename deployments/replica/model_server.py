"""The model replica's Ray Serve deployment: Ray's hooks over a :class:`Replica`.

One replica owns one model on one device (or its ``num_gpus`` share of it). It measures its
memory at start-up (:func:`deployments.replica.profiling.measure_replica`), then admits, batches and
runs requests (:class:`deployments.replica.lifecycle.RequestLifecycle`) on one dedicated inference
thread, never on the event loop, so the replica keeps answering (health checks, status,
admission) while the model is busy. Its state goes to the router
(``record_routing_stats``), the autoscaler (``record_autoscaling_stats``) and the registry
(``/v1/status``, ``/metrics``) as one typed value (:class:`serve_app.replica_state.ReplicaState`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.cluster.fail_fast import REFUSALS, refusal_text, stop_serve_run_with
from deployments.cluster.job_broker import open_job_store
from deployments.cluster.replica_registry import publish_forever
from deployments.replica.jobs_worker import JobWorker
from deployments.replica.parts import Replica, ReplicaIdentity
from deployments.replica.profiling import measure_replica
from serve_app.config import AppArgs, parse_args
from serve_app.errors import ServeAppError
from serve_app.measurement import allocator_setting
from serve_app.metrics import REPLICA_EVENT_COUNTERS, ProcessMetrics
from serve_app.replica_state import ReplicaState
from serve_app.request import InferenceRequest
from serve_app.schemas import InferenceResult
from serve_app.stream_batching import coalesced
from serve_app.stream_events import AdmissionEvent, StreamEvent

logger = logging.getLogger("ray.serve")

GAUGES = ("budget_bytes", "measured_budget_bytes", "reserved_bytes", "free_bytes",
          "queue_depth", "queued_bytes", "cost_correction_factor")
"""Status figures refreshed as gauges every publish period."""
KV_CACHE_GAUGES = {"running_sequences": "running_sequences",
                   "waiting_sequences": "waiting_sequences",
                   "kv_cache_budget_blocks": "blocks_total",
                   "kv_cache_leased_blocks": "blocks_leased",
                   "kv_cache_used_blocks": "blocks_in_use",
                   "kv_cache_preempted_sequences": "preempted_sequences"}
"""Gauges refreshed from ``/v1/status``'s ``kv_cache`` (continuous batching, or an engine
that pages its own KV cache)."""


@serve.deployment
class ModelServer:
    """A model replica behind a byte-budget gate. See module docstring.

    Args:
        args: the validated config.
        registry: handle to :class:`deployments.cluster.replica_registry.ReplicaRegistry`,
            or ``None``.
        plan: the deployment's plan (:meth:`serve_app.planning.DeploymentPlan.summary`),
            shown in ``/v1/status`` as ``deployment_plan``.
        jobs: handle to the embedded :class:`deployments.cluster.job_broker.JobBroker`, or ``None``;
            with ``jobs.enabled`` the replica pulls durable jobs
            (:class:`deployments.replica.jobs_worker.JobWorker`).

    Raises (at start-up):
        InsufficientMemoryError: the budget cannot hold the largest allowed request.
        OSError, DeviceUnavailableError, ConfigError: no model directory, no CUDA, an engine
            that refuses the args. These refusals also end a waiting ``serve run``
            (:func:`deployments.cluster.fail_fast.stop_serve_run`), since Ray's retries cannot help.
    """

    async def __init__(self, args: AppArgs | dict[str, Any],
                       registry: DeploymentHandle | None = None,
                       plan: dict[str, Any] | None = None,
                       jobs: DeploymentHandle | None = None) -> None:
        args = parse_args(args)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        loop = asyncio.get_running_loop()
        try:
            measured = await loop.run_in_executor(executor, measure_replica, args)
        except BaseException as exc:
            executor.shutdown(wait=False)
            if isinstance(exc, REFUSALS):  # retrying cannot help: end a waiting serve run
                stop_serve_run_with(f"model replica refused to start: {refusal_text(exc, args)}")
            raise
        context = serve.get_replica_context()
        replica_id = context.replica_id.unique_id if context else "local"
        metrics = ProcessMetrics(context.deployment if context else "ModelServer", replica_id,
                                 zeroed=REPLICA_EVENT_COUNTERS, model=args.model.name)
        runtime = ray.get_runtime_context()
        identity = ReplicaIdentity(
            replica_id, runtime.get_node_id(),
            tuple(str(i) for i in runtime.get_accelerator_ids().get("GPU", [])),
            {**measured.memory_status(args), "allocator": allocator_setting(),
             "deployment_plan": plan})
        self._replica = Replica(
            measured.engine, measured.probe, measured.cost_model, measured.budget_bytes, args,
            executor, metrics, identity,
            request_id=lambda: serve.context._get_serve_request_context().request_id,
            prior_drain_bytes_per_s=measured.profile.drain_bytes_per_s)
        self._served_byte_s: dict[str, float] = {}  # per tenant, as last counted
        self._publisher = loop.create_task(publish_forever(
            registry, replica_id, metrics, self._refresh)) if registry else None
        # In the background: the replica serves (and scales) without waiting for Redis.
        self._jobs: JobWorker | None = None
        self._puller = loop.create_task(self._pull_jobs(args, jobs, replica_id)) \
            if args.jobs.enabled else None
        logger.info("model replica ready: %s", identity.memory)

    async def _pull_jobs(self, args: AppArgs, broker: DeploymentHandle | None,
                         replica_id: str) -> None:
        """Connect to the job store, then pull jobs (:class:`JobWorker`: each runs the
        request its record carries, as the ingress built it) until cancelled."""
        try:
            self._jobs = JobWorker(await open_job_store(args, broker), self._replica,
                                   replica_id, args.jobs)
        except Exception:
            logger.exception("durable jobs: this replica cannot reach the job store; it "
                             "serves requests but pulls no jobs")
            return
        await self._jobs.run_forever()

    async def infer(self, request: InferenceRequest) -> InferenceResult | ServeAppError:
        """Run one validated request: its result, or its typed error returned, not raised,
        so that Ray Serve does not log a refusal as a failed request (:meth:`Replica.answer`).
        """
        return await self._replica.answer(request)

    async def infer_stream(self, request: InferenceRequest,
                           ) -> AsyncIterator[list[StreamEvent]]:
        """Stream one validated request (:meth:`Replica.answer_stream`; its typed error as a
        last ``StreamError`` item) in lists: the pieces of text made within
        ``batching.stream_interval_ms`` of the last sent go together
        (:func:`serve_app.stream_batching.coalesced`); the admission events and the first
        piece go at once."""
        interval_s = self._replica.args.batching.stream_interval_ms / 1000
        async with contextlib.aclosing(coalesced(
                self._replica.answer_stream(request), interval_s,
                paced=lambda item: not isinstance(item, AdmissionEvent))) as batches:
            async for batch in batches:  # closed with this one (its consumer gone)
                yield batch

    async def check_health(self) -> None:
        """Ray Serve's health check (every ``deployment.health_check_period_s``).

        Raises:
            RuntimeError: after a device fault, while an inference has run longer than
                ``admission.stuck_after_timeouts`` x ``inference_timeout_s``, or once the
                engine's own scheduler died (:meth:`Replica.check_health`).
        """
        self._replica.check_health()

    async def record_routing_stats(self) -> dict[str, float]:
        """Ray Serve polls this every ``deployment.routing_stats_period_s`` for the request
        router (:mod:`deployments.cluster.router`): the gate's figures now, and when they were
        taken."""
        return self._replica.state().to_routing_stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve samples this for the queue autoscaling policy
        (:mod:`deployments.cluster.autoscaling`) when the deployment autoscales."""
        return self._replica.state().to_autoscaling_stats()

    def _refresh(self) -> ReplicaState:
        """Every publish period: regrow the budget if due, refresh the gauges; the state
        to publish."""
        replica = self._replica
        replica.health.regrow_budget()
        state = replica.state()
        status = state.to_status()
        for name in GAUGES:
            replica.metrics.set(name, status[name])
        for name, value in replica.probe.memory_snapshot().items():
            replica.metrics.set(name, value)
        for name, key in KV_CACHE_GAUGES.items():
            if status["kv_cache"] is not None:
                replica.metrics.set(name, status["kv_cache"][key])
        self._record_tenants(state.gate.tenants)
        return state

    def _record_tenants(self, tenants: Mapping[str, Mapping[str, float]]) -> None:
        """The tenants' series (names from the config and their keys: a bounded set)."""
        metrics, served = self._replica.metrics, self._served_byte_s
        for tenant, figures in tenants.items():
            metrics.set("tenant_held_bytes", figures["held_bytes"], tenant=tenant)
            metrics.set("tenant_queue_depth", figures["waiting"], tenant=tenant)
            total = figures["served_byte_s"]
            if total > served.get(tenant, 0.0):
                metrics.inc("tenant_served_byte_seconds", total - served.get(tenant, 0.0),
                            tenant=tenant)
                served[tenant] = total

    def __del__(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.cancel()
        if getattr(self, "_puller", None) is not None:
            self._puller.cancel()
        if getattr(self, "_jobs", None) is not None:
            self._jobs.close()
        if getattr(self, "_replica", None) is not None:
            self._replica.close()
            self._replica.engine.close()  # vLLM's engine core is a process of its own
