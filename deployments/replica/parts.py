"""One model replica's parts, assembled: what :class:`deployments.replica.model_server.ModelServer`
holds behind Ray Serve's hooks, and what tests run without Ray.

Parts, each handed to the next through its constructor: the admission policy
(:func:`serve_app.admission.policy.make_policy`) and gate
(:class:`~serve_app.admission.controller.AdmissionController`); the prices
(:class:`~serve_app.pricing.Pricer` over the OOM-corrected cost model); the device health
(:class:`~deployments.replica.device_health.DeviceHealth`); the inference thread
(:class:`~deployments.replica.inference.InferenceThread`); the batcher
(:class:`~deployments.replica.batching.RequestBatcher`); and the request lifecycle
(:class:`~deployments.replica.lifecycle.RequestLifecycle`) that drives them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deployments.engines.base import AsyncScheduler, Engine
from deployments.engines.stepping import DecodeStepper
from deployments.replica.batching import RequestBatcher
from deployments.replica.decode_loop import DecodeLoop
from deployments.replica.device_health import DeviceHealth
from deployments.replica.inference import InferenceThread
from deployments.replica.lifecycle import RequestLifecycle
from deployments.replica.request_log import RequestLog
from deployments.replica.scheduled import ScheduledRuns
from serve_app.admission.controller import AdmissionController
from serve_app.admission.policy import make_policy
from serve_app.config import AppArgs
from serve_app.errors import ServeAppError
from serve_app.memory.cost_model import CorrectedCostModel, CostModel
from serve_app.memory.expected_output import ExpectedOutputCostModel
from serve_app.memory.probes import DeviceProbe
from serve_app.metrics import ProcessMetrics
from serve_app.pricing import Pricer, shape_bytes
from serve_app.replica_state import GateFigures, ReplicaState
from serve_app.request import InferenceRequest
from serve_app.schemas import InferenceResult
from serve_app.stream_events import StreamError, StreamEvent


@dataclass(frozen=True)
class ReplicaIdentity:
    """What a replica's state says of where it runs and what it measured at start-up."""

    replica_id: str = "local"
    node_id: str = ""
    gpu_ids: tuple[str, ...] = ()
    memory: Mapping[str, Any] | None = None


class Replica:
    """A model replica without Ray (see module docstring).

    Args:
        engine: the loaded engine.
        probe: its device probe.
        cost_model: the profile's fitted cost model.
        budget_bytes: the measured budget.
        args: the config.
        executor: the single-thread executor inference runs on.
        metrics: the replica's metrics.
        identity: where it runs (for its state).
        request_id: the current request's id, for logs.
        prior_drain_bytes_per_s: the drain rate its profile measured
            (:attr:`serve_app.memory.profiler.MemoryProfile.drain_bytes_per_s`), what its
            predicted waits use until it has measured one (byte-priced policies only).

    Build it on the replica's event loop (the batcher starts its task there).
    """

    def __init__(self, engine: Engine, probe: DeviceProbe, cost_model: CostModel,
                 budget_bytes: int, args: AppArgs, executor: ThreadPoolExecutor,
                 metrics: ProcessMetrics, identity: ReplicaIdentity = ReplicaIdentity(),
                 request_id: Callable[[], str] = lambda: "",
                 prior_drain_bytes_per_s: float | None = None) -> None:
        adm = args.admission
        self.args, self.engine, self.probe, self.identity = args, engine, probe, identity
        self._jobs_queued = 0
        self.metrics = metrics
        self.cost_model = CorrectedCostModel(cost_model)
        self.policy = make_policy(adm, budget_bytes)
        bytes_priced = self.policy.gate_units == "bytes"
        self.gate = AdmissionController(
            self.policy.capacity_units, adm.max_queue_len, adm.max_queue_wait_s,
            thread_wait_s=self.thread_wait_s, refuse_predicted=adm.refuse_predicted_waits,
            prior_drain_bytes_per_s=prior_drain_bytes_per_s if bytes_priced else None,
            weights=args.auth.weights(), fair_queue=adm.queue == "fair",
            quotas=args.auth.quotas())
        self.health = DeviceHealth(engine, probe, self.gate, self.policy, self.cost_model,
                                   adm, metrics)
        self.log = RequestLog(identity.replica_id, probe)
        self.thread = InferenceThread(executor, probe, self.health, self.gate, adm, metrics,
                                      self.log)
        pricer = Pricer(self.cost_model, self.policy)
        expected = cost_model.expected if isinstance(cost_model, ExpectedOutputCostModel) \
            else None
        self.scheduled = ScheduledRuns(engine, self.thread, self.health,
                                       adm.inference_timeout_s, expected) \
            if isinstance(engine, AsyncScheduler) else None
        self.batcher = RequestBatcher(self.thread, engine, pricer, args.batching) \
            if args.batching.enabled and self.scheduled is None else None
        self.decode = DecodeLoop(self.thread, engine, args, metrics,
                                 lambda: self.policy.budget_bytes) \
            if args.batching.continuous and isinstance(engine, DecodeStepper) \
            and engine.decode_steps else None
        self.lifecycle = RequestLifecycle(engine, self.gate, pricer, self.thread,
                                          self.batcher, self.health, args, metrics, self.log,
                                          identity.replica_id, request_id, self.decode,
                                          self.scheduled)

    async def answer(self, request: InferenceRequest) -> InferenceResult | ServeAppError:
        """:meth:`RequestLifecycle.infer`'s result, or its typed error (:meth:`refused`)
        returned, not raised: an exception that leaves a Ray Serve method is logged ``ERROR
        ... Request failed.`` with its traceback, and a refusal is the product working.
        :class:`deployments.http.model_client.ModelClient` raises it again at the ingress."""
        try:
            return await self.lifecycle.infer(request)
        except ServeAppError as err:
            return self.refused(request, err)

    async def answer_stream(self, request: InferenceRequest,
                            ) -> AsyncIterator[StreamEvent]:
        """:meth:`RequestLifecycle.infer_stream`'s items; its typed error, before or after
        the first item, as a last :class:`StreamError` item (as :meth:`answer`)."""
        try:
            async with contextlib.aclosing(self.lifecycle.infer_stream(request)) as items:
                async for item in items:  # closed with this one (its consumer gone)
                    yield item
        except ServeAppError as err:
            yield StreamError(self.refused(request, err))

    def refused(self, request: InferenceRequest, err: ServeAppError) -> ServeAppError:
        """``err``, logged as one line of the request log with its ``status``, ``code`` and
        ``tenant``: ``refused`` at INFO (4xx, 503), ``failed`` at WARNING (504
        ``inference_timeout``)."""
        failed = err.status_code >= 500 and err.status_code != 503
        self.log.event("failed" if failed else "refused",
                       shape_bytes(self.cost_model, request.shape),
                       level=logging.WARNING if failed else logging.INFO,
                       status=err.status_code, code=err.code, tenant=request.tenant)
        return err

    @property
    def jobs_queued(self) -> int:
        """The model's durable jobs waiting, as last read (:meth:`record_jobs_queued`)."""
        return self._jobs_queued

    def record_jobs_queued(self, count: int) -> None:
        """Record the length of the model's durable job queue (the job worker reads it),
        which the replica's state reports to the autoscaler."""
        self._jobs_queued = count

    def thread_wait_s(self) -> float:
        """Seconds a request admitted now would wait for the inference thread (for the
        gate's predictions): the passes running or queued on it, and those the batcher's
        waiting requests will form."""
        pending = self.batcher.pending_passes if self.batcher is not None else 0
        return self.thread.backlog_wait_s(pending)

    def state(self) -> ReplicaState:
        """This replica's state now (``GET /v1/status``, routing and autoscaling stats)."""
        budget, queue, policy = self.gate.budget, self.gate.queue, self.policy
        gate = GateFigures(
            capacity=budget.budget_bytes, reserved_bytes=budget.reserved_bytes,
            peak_reserved_bytes=budget.peak_reserved_bytes, free_bytes=budget.free_bytes,
            active_leases=budget.active_leases, queue_depth=queue.queue_depth,
            queued_bytes=queue.queued_bytes, charged_bytes_total=budget.charged_bytes_total,
            released_bytes_total=budget.released_bytes_total,
            drain_bytes_per_s=queue.drain.bytes_per_s(), thread_wait_s=self.thread_wait_s(),
            busy_drain_bytes_per_s=queue.drain.busy_bytes_per_s(),
            wait_margin_s=queue.calibration.shared.margin_s(), tenants=self.gate.tenant_figures())
        identity, args = self.identity, self.args
        return ReplicaState(
            replica_id=identity.replica_id, node_id=identity.node_id, gpu_ids=identity.gpu_ids,
            num_gpus=args.deployment.num_gpus, model=args.model.name,
            task=args.model.engine_name, kinds=tuple(self.engine.kinds), policy=policy.name,
            gate_units=policy.gate_units, memory=identity.memory or {},
            cost_model=self.cost_model.published(), gate=gate,
            device=self.health.figures(self.thread.running, self.thread.total),
            budget_bytes=policy.budget_bytes,
            measured_budget_bytes=policy.measured_budget_bytes,
            budget_shrink_count=policy.shrink_count, budget_regrow_count=policy.regrow_count,
            updated_at=time.time(),
            kv_cache=self._kv_cache_figures(),
            jobs_queued=self.jobs_queued,
            refused_by_prediction=queue.refused_by_prediction(
                args.deployment.autoscaling_look_back_s))

    def _kv_cache_figures(self) -> dict[str, Any] | None:
        """``/v1/status``'s ``kv_cache``: the decode loop's figures, or an engine's own (its
        pool's blocks leased are the gate's leases, in blocks), or ``None``."""
        if self.decode is not None:
            return self.decode.figures()
        if (figures := self.engine.kv_cache_status()) is None:
            return None
        block_bytes = figures["block_bytes"]
        leased = -(-self.gate.budget.reserved_bytes // block_bytes) if block_bytes else 0
        return {**figures, "blocks_leased": leased, "kv_lease": self.args.admission.kv_lease}

    def check_health(self) -> None:
        """Ray Serve's health check. Raises RuntimeError after a device fault, while an
        inference is stuck (:meth:`InferenceThread.check_health`), or once the engine says it
        is dead (:meth:`AsyncScheduler.dead_reason`: recorded as a device fault, so the
        replica refuses with 503 ``draining`` until Ray Serve replaces it)."""
        if (reason := self.engine.dead_reason()) is not None:
            self.health.mark_device_fault(reason)
        self.thread.check_health()

    def close(self) -> None:
        """Stop batching and the thread (replica shutdown)."""
        if self.batcher is not None:
            self.batcher.close()
        if self.decode is not None:
            self.decode.close()
        self.thread.shutdown()
