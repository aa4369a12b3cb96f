"""The model replica: measures its memory, prices requests, admits them against its budget.

One replica owns one model on one device (or its ``num_gpus`` share of it). Inference runs on
one dedicated worker thread, never on the event loop, so the replica keeps answering (health
checks, status, admission) while the model is busy. A lease is released only when the worker
thread has really finished with the request, also after a timeout or a client disconnect.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.profiling import measure_replica
from deployments.registry import PUBLISH_PERIOD_S
from serve_app.admission.controller import Admission, AdmissionController
from serve_app.admission.policy import AdmissionPolicy
from serve_app.config import parse_args
from serve_app.errors import InferenceTimeoutError, InvalidRequestError
from serve_app.schemas import EmbeddingResult

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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        loop = asyncio.get_running_loop()
        measured = await loop.run_in_executor(self._executor, measure_replica, args)
        self._engine = measured.engine
        self._cost_model = measured.cost_model
        self._max_input_tokens = min(args.limits.max_input_tokens, self._engine.max_seq_tokens)
        self._policy = AdmissionPolicy.create(args.admission.policy, measured.budget_bytes,
                                              args.admission.semaphore_permits)
        self._gate = AdmissionController(self._policy.capacity_units,
                                         args.admission.max_queue_len,
                                         args.admission.max_queue_wait_s)
        context = serve.get_replica_context()
        self._replica_id = context.replica_id.unique_id if context else "local"
        self._memory = measured.status(args)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._inferences_running = 0
        self._registry = registry
        self._publisher = loop.create_task(self._publish_forever()) if registry else None
        logger.info("model replica ready: %s", self._memory)

    async def embed(self, texts: list[str]) -> EmbeddingResult:
        """Embed ``texts`` (1..limits.max_inputs strings) once admitted.

        Raises:
            InvalidRequestError: an input has more than ``limits.max_input_tokens`` tokens.
            RequestTooLargeError, OverloadedError: from admission (400, 503).
            InferenceTimeoutError: inference ran past ``admission.inference_timeout_s`` (504).
        """
        token_counts = await asyncio.to_thread(self._engine.count_tokens, texts)
        too_long = [i for i, n in enumerate(token_counts) if n > self._max_input_tokens]
        if too_long:
            raise InvalidRequestError(
                f"input[{too_long[0]}] has {token_counts[too_long[0]]} tokens; the limit is "
                f"{self._max_input_tokens}", code="input")
        request_bytes = self._cost_model.request_bytes(len(token_counts), max(token_counts))
        admission = await self._gate.acquire(self._policy.units(request_bytes))
        embeddings = await self._run_leased(admission, lambda: self._engine.embed(texts))
        return EmbeddingResult(embeddings, sum(token_counts), admission.queue_wait_s,
                               admission.queue_position, self._replica_id)

    async def _run_leased(self, admission: Admission, work: Any) -> Any:
        """Run ``work`` on the inference thread; release the lease when the thread returns,
        whatever happens to the caller meanwhile (timeout, cancellation)."""
        loop = asyncio.get_running_loop()
        self._inferences_running += 1
        try:
            future = loop.run_in_executor(self._executor, work)
        except BaseException:
            self._inferences_running -= 1
            self._gate.release(admission.lease, ran=False)
            raise

        def finished(done: asyncio.Future) -> None:
            self._inferences_running -= 1
            self._gate.release(admission.lease)
            if not done.cancelled():
                done.exception()  # retrieved here so an abandoned failure is not logged twice

        future.add_done_callback(finished)
        timeout_s = self._args.admission.inference_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(future)
        except TimeoutError:
            raise InferenceTimeoutError(
                f"inference ran longer than {timeout_s:g} s") from None

    async def status(self) -> dict[str, Any]:
        """This replica's admission state (JSON-ready; see ``GET /v1/status``).

        The gate's figures (``reserved_bytes``, ``queued_bytes``, ...) are in the policy's
        units, named by ``gate_units``: bytes under ``budget``, requests under ``semaphore``.
        """
        budget, queue = self._gate.budget, self._gate.queue
        return {
            "replica_id": self._replica_id,
            "node_id": self._node_id,
            "model": self._args.model.name,
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
            "inferences_running": self._inferences_running,
            "drain_bytes_per_s": queue.drain.bytes_per_s(),
            "oom_count": 0,
            "budget_shrink_count": 0,
            "updated_at": time.time(),
        }

    async def _publish_forever(self) -> None:
        while True:
            try:
                await self._registry.publish.remote(self._replica_id, await self.status())
            except Exception:  # the registry restarting must not take the replica down
                logger.warning("could not publish status to the registry", exc_info=True)
            await asyncio.sleep(PUBLISH_PERIOD_S)

    def __del__(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.cancel()
        if getattr(self, "_executor", None) is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
