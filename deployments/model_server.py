"""The model replica: measures its memory, prices requests, admits them against its budget.

One replica owns one model on one device (or its ``num_gpus`` share of it). Inference runs on
one dedicated worker thread (:mod:`deployments.inference`), never on the event loop, so the
replica keeps answering (health checks, status, admission) while the model is busy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.autoscaling import replica_autoscaling_stats
from deployments.batching import RequestBatcher
from deployments.engines.base import GenerationParams
from deployments.inference import InferenceThread
from deployments.profiling import measure_replica
from deployments.registry import PUBLISH_PERIOD_S
from serve_app.admission.aimd import AimdBudget
from serve_app.admission.batching import priced_shape
from serve_app.admission.controller import Admission, AdmissionController
from serve_app.admission.policy import AdmissionPolicy
from serve_app.config import parse_args
from serve_app.errors import InvalidRequestError, ModelNotFoundError, ServeAppError
from serve_app.memory.cost_model import CorrectedCostModel
from serve_app.metrics import REPLICA_EVENT_COUNTERS, ProcessMetrics
from serve_app.schemas import Admitted, CompletionResult, EmbeddingResult

logger = logging.getLogger("ray.serve")


@serve.deployment
class ModelServer:
    """A model replica behind a byte-budget gate. See module docstring.

    Args:
        raw_args: the validated ``args:`` of the config (as a dict).
        registry: handle to :class:`deployments.registry.ReplicaRegistry`, or ``None``.

    Raises (at start-up):
        InsufficientMemoryError: the budget cannot hold the largest allowed request.
    """

    async def __init__(self, raw_args: dict[str, Any], registry: DeploymentHandle | None = None):
        self._args = args = parse_args(raw_args)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        loop = asyncio.get_running_loop()
        try:
            measured = await loop.run_in_executor(executor, measure_replica, args)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        self._engine = measured.engine
        self._cost_model = CorrectedCostModel(measured.cost_model)
        self._max_input_tokens = min(args.limits.max_input_tokens, self._engine.max_seq_tokens)
        self._policy = AdmissionPolicy.create(args.admission.policy, measured.budget_bytes,
                                              args.admission.semaphore_permits)
        self._gate = AdmissionController(self._policy.capacity_units,
                                         args.admission.max_queue_len,
                                         args.admission.max_queue_wait_s)
        adm = args.admission
        self._aimd = AimdBudget(measured.budget_bytes, adm.oom_decrease_factor,
                                adm.oom_regrow_fraction, adm.oom_quiet_s,
                                adm.oom_floor_fraction) if self._policy.name == "budget" else None
        context = serve.get_replica_context()
        self._replica_id = context.replica_id.unique_id if context else "local"
        self._metrics = ProcessMetrics(context.deployment if context else "ModelServer",
                                       self._replica_id, zeroed=REPLICA_EVENT_COUNTERS)
        self._probe = measured.probe
        self._inference = InferenceThread(executor, self._engine, measured.probe, self._gate,
                                          self._cost_model, self._aimd, adm, self._metrics)
        self._batcher = RequestBatcher(
            self._inference, self._engine, self._cost_model, self._policy, self._gate,
            args.batching) if args.batching.enabled else None
        self._memory = measured.status(args)
        runtime = ray.get_runtime_context()
        self._node_id = runtime.get_node_id()
        self._gpu_ids = [str(i) for i in runtime.get_accelerator_ids().get("GPU", [])]
        self._registry = registry
        self._publisher = loop.create_task(self._publish_forever()) if registry else None
        logger.info("model replica ready: %s", self._memory)

    async def embed(self, texts: list[str], estimated_bytes: int | None = None,
                    sent_at_s: float | None = None) -> EmbeddingResult:
        """Embed ``texts`` (1..limits.max_inputs strings) once admitted.

        ``estimated_bytes`` is the caller's price, read only by the request router
        (:mod:`deployments.router`); the replica prices the request itself. ``sent_at_s``:
        when the ingress sent it (``time.time()``); the time it spent reaching this replica
        (in Ray Serve's handle queue) counts as queue wait, within
        ``admission.max_queue_wait_s``.

        Raises:
            ModelNotFoundError: this replica serves another task (404).
            InvalidRequestError: an input has more than ``limits.max_input_tokens`` tokens.
            RequestTooLargeError, OverloadedError: from admission (400, 503).
            InferenceTimeoutError: inference ran past ``admission.inference_timeout_s`` (504).
            OverloadedError: ``oom``, or ``draining`` after a device fault, including output
                with NaN/Inf (503).
        """
        self._require_task("embed")
        token_counts = await asyncio.to_thread(self._engine.count_tokens, texts)
        for i, n in enumerate(token_counts):
            self._check_tokens(n, self._max_input_tokens, f"input[{i}]", "input")
        admitted = await self._admit(
            len(token_counts), *self._priced_shape(token_counts, 0, self._batchable(len(texts))),
            sent_at_s)
        if self._batcher is not None:
            embeddings, thread_wait_s = await self._batcher.embed(texts, token_counts, admitted)
        else:
            embeddings, thread_wait_s = await self._inference.run(
                admitted, lambda: self._engine.embed(texts))
        if not np.isfinite(embeddings).all():
            self._inference.mark_device_fault("an embedding came out NaN/Inf")
            raise self._inference.draining_error()
        return EmbeddingResult(embeddings, sum(token_counts),
                               _admitted(admitted, thread_wait_s), self._replica_id)

    async def complete(self, prompt: str, params: GenerationParams,
                       estimated_bytes: int | None = None,
                       sent_at_s: float | None = None) -> CompletionResult:
        """Complete ``prompt`` once admitted; priced by prompt tokens + ``max_tokens``.

        Raises: as :meth:`embed`, with ``prompt`` / ``max_tokens`` as the offending fields.
        """
        admitted, prompt_tokens = await self._admit_prompt(prompt, params,
                                                           sent_at_s=sent_at_s)
        if self._batchable(1, params):
            output, thread_wait_s = await self._batcher.complete(prompt, prompt_tokens, params,
                                                                 admitted)
        else:
            output, thread_wait_s = await self._inference.run(
                admitted, lambda: self._engine.generate(prompt, params))
        return CompletionResult(output.text, output.finish_reason, prompt_tokens,
                                output.completion_tokens, _admitted(admitted, thread_wait_s))

    async def complete_stream(self, prompt: str, params: GenerationParams,
                              estimated_bytes: int | None = None,
                              sent_at_s: float | None = None,
                              ) -> AsyncIterator[dict[str, Any]]:
        """Stream a completion: first ``{"admitted": Admitted}`` once the lease is held, then
        ``{"text": piece}`` items, then ``{"finish_reason", "prompt_tokens",
        "completion_tokens"}``. Errors before the first item are the same as :meth:`complete`;
        an error after it (e.g. ``InferenceTimeoutError``) ends the stream by raising.

        When the consumer goes away, generation stops at the next token and the lease is
        released once the inference thread has returned.
        """
        admitted, prompt_tokens = await self._admit_prompt(prompt, params, stream=True,
                                                           sent_at_s=sent_at_s)
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str] = asyncio.Queue()
        consumer_gone = threading.Event()

        def on_text(piece: str) -> bool:  # runs on the inference thread
            if consumer_gone.is_set():
                return False
            loop.call_soon_threadsafe(pieces.put_nowait, piece)
            return True

        try:
            yield {"admitted": _admitted(admitted)}
        except BaseException:
            self._gate.release(admitted.lease, ran=False)
            self._metrics.inc("admission_decisions", outcome="cancelled", reason="client_gone")
            raise
        future, job = self._inference.start(
            admitted, lambda: self._engine.generate(prompt, params, on_text))
        try:
            await self._inference.wait_started(future, job, admitted)
            deadline = loop.time() + self._args.admission.inference_timeout_s
            while not future.done():
                getter = asyncio.ensure_future(pieces.get())
                done, _ = await asyncio.wait({getter, future}, timeout=deadline - loop.time(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield {"text": getter.result()}
                    continue
                getter.cancel()
                if not done:
                    raise self._inference.timeout_error()
            while not pieces.empty():  # pieces put before the thread returned
                yield {"text": pieces.get_nowait()}
            try:
                output = future.result()
            except RuntimeError as exc:
                raise self._inference.failure(exc, admitted) from None
            yield {"finish_reason": output.finish_reason, "prompt_tokens": prompt_tokens,
                   "completion_tokens": output.completion_tokens}
        finally:
            consumer_gone.set()

    async def _admit_prompt(self, prompt: str, params: GenerationParams, stream: bool = False,
                            sent_at_s: float | None = None) -> tuple[Admission, int]:
        self._require_task("generate")
        [prompt_tokens] = await asyncio.to_thread(self._engine.count_tokens, [prompt])
        self._check_tokens(prompt_tokens, self._max_input_tokens, "prompt", "prompt")
        self._check_tokens(prompt_tokens + params.max_tokens, self._engine.max_seq_tokens,
                           "prompt + max_tokens", "max_tokens")
        shape = self._priced_shape([prompt_tokens], params.max_tokens,
                                   self._batchable(1, params, stream))
        return await self._admit(1, *shape, sent_at_s), prompt_tokens

    async def _admit(self, batch: int, prompt_tokens: int, new_tokens: int,
                     sent_at_s: float | None = None) -> Admission:
        """A lease for a request of this shape. Refusals are counted here (the admission
        counted once the inference thread takes the request up: :mod:`deployments.inference`).
        The time since ``sent_at_s`` (wall clock, the ingress's; clamped at 0) counts as queue
        wait already spent.

        Raises: as :meth:`AdmissionController.acquire`; ``draining`` after a device fault.
        """
        try:
            if self._inference.device_fault is not None:
                raise self._inference.draining_error()
            request_bytes = self._cost_model.request_bytes(batch, prompt_tokens, new_tokens)
            self._inference.log_event("arrived", request_bytes, batch=batch,
                                      prompt_tokens=prompt_tokens, new_tokens=new_tokens)
            waited_s = 0.0 if sent_at_s is None else max(0.0, time.time() - sent_at_s)
            admission = await self._gate.acquire(self._policy.units(request_bytes), waited_s)
            # Kept with the lease: a batch runs outside this request's logging context.
            request_id = serve.context._get_serve_request_context().request_id
            return dataclasses.replace(admission, request_id=request_id or "")
        except ServeAppError as exc:
            self._metrics.inc("admission_decisions", outcome="rejected", reason=exc.code)
            raise
        except asyncio.CancelledError:
            self._metrics.inc("admission_decisions", outcome="cancelled", reason="client_gone")
            raise

    def _priced_shape(self, token_counts: list[int], new_tokens: int,
                      batchable: bool) -> tuple[int, int]:
        return priced_shape(token_counts, new_tokens, batchable,
                            self._args.batching.pad_to_multiple_of, self._max_input_tokens,
                            self._args.limits.max_tokens)

    def _batchable(self, inputs: int, params: GenerationParams | None = None,
                   stream: bool = False) -> bool:
        return self._batcher is not None and self._batcher.batchable(inputs, params, stream)

    def _require_task(self, task: str) -> None:
        if self._engine.task not in (task, "fake"):  # the fake engine serves both
            raise ModelNotFoundError(f"model {self._args.model.name!r} does not serve {task}")

    @staticmethod
    def _check_tokens(tokens: int, limit: int, what: str, code: str) -> None:
        if tokens > limit:
            raise InvalidRequestError(f"{what} has {tokens} tokens; the limit is {limit}",
                                      code=code)

    async def check_health(self) -> None:
        """Ray Serve's health check (every ``deployment.health_check_period_s``).

        Raises:
            RuntimeError: after a device fault, or while an inference has run longer than
                ``admission.stuck_after_timeouts`` x ``inference_timeout_s``.
        """
        self._inference.check_health()

    async def status(self) -> dict[str, Any]:
        """This replica's admission state (JSON-ready; see ``GET /v1/status``).

        The gate's figures (``reserved_bytes``, ``queued_bytes``, ...) are in the policy's
        units, named by ``gate_units``: bytes under ``budget``, requests under ``semaphore``.
        """
        budget, queue = self._gate.budget, self._gate.queue
        return {
            "replica_id": self._replica_id,
            "node_id": self._node_id,
            "gpu_ids": self._gpu_ids,
            "num_gpus": self._args.deployment.num_gpus,
            "model": self._args.model.name,
            "task": self._engine.task,
            "policy": self._policy.name,
            "gate_units": {"budget": "bytes", "semaphore": "requests"}.get(self._policy.name,
                                                                           "none"),
            **self._memory,
            "reserved_bytes": budget.reserved_bytes,
            "peak_reserved_bytes": budget.peak_reserved_bytes,
            "free_bytes": budget.free_bytes,
            "active_leases": budget.active_leases,
            "queue_depth": queue.queue_depth,
            "queued_bytes": queue.queued_bytes,
            "charged_bytes_total": budget.charged_bytes_total,
            "released_bytes_total": budget.released_bytes_total,
            **self._inference.status(),
            "drain_bytes_per_s": queue.drain.bytes_per_s(),
            "budget_bytes": budget.budget_bytes if self._aimd else self._memory["budget_bytes"],
            "measured_budget_bytes": self._memory["budget_bytes"],
            "budget_shrink_count": self._aimd.shrink_count if self._aimd else 0,
            "budget_regrow_count": self._aimd.regrow_count if self._aimd else 0,
            "updated_at": time.time(),
        }

    async def record_routing_stats(self) -> dict[str, float]:
        """Ray Serve polls this every ``deployment.routing_stats_period_s`` for the request
        router (:mod:`deployments.router`): the gate's figures now, and when they were taken."""
        budget, queue = self._gate.budget, self._gate.queue
        return {"budget_bytes": budget.budget_bytes, "reserved_bytes": budget.reserved_bytes,
                "free_bytes": budget.free_bytes, "queue_depth": queue.queue_depth,
                "queued_bytes": queue.queued_bytes, "measured_at_unix_s": time.time()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve samples this for the queue autoscaling policy
        (:mod:`deployments.autoscaling`) when the deployment autoscales."""
        return replica_autoscaling_stats(await self.status())

    async def _publish_forever(self) -> None:
        """Every publish period: regrow the budget if due, refresh the gauges, and send the
        status and the metrics to the registry."""
        while True:
            self._inference.regrow_budget()
            status = await self.status()
            self._record_gauges(status)
            try:
                await self._registry.publish.remote(self._replica_id, status)
                await self._registry.publish_metrics.remote(self._replica_id,
                                                            self._metrics.exposition())
            except Exception:  # the registry restarting must not take the replica down
                logger.warning("could not publish status to the registry", exc_info=True)
            await asyncio.sleep(PUBLISH_PERIOD_S)

    def _record_gauges(self, status: dict[str, Any]) -> None:
        for name in ("budget_bytes", "measured_budget_bytes", "reserved_bytes", "free_bytes",
                     "queue_depth", "queued_bytes", "cost_correction_factor"):
            self._metrics.set(name, status[name])
        for name, value in self._probe.memory_snapshot().items():
            self._metrics.set(name, value)

    def __del__(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.cancel()
        if getattr(self, "_batcher", None) is not None:
            self._batcher.close()
        if getattr(self, "_inference", None) is not None:
            self._inference.shutdown()


def _admitted(admission: Admission, thread_wait_s: float = 0.0) -> Admitted:
    """Queue wait = waiting for the lease + waiting for the inference thread."""
    return Admitted(admission.queue_wait_s + thread_wait_s, admission.queue_position)
