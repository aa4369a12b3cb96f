"""The model replica: measures its memory, prices requests, admits them against its budget.

One replica owns one model on one device (or its ``num_gpus`` share of it). Inference runs on
one dedicated worker thread, never on the event loop, so the replica keeps answering (health
checks, status, admission) while the model is busy. A lease is released only when the worker
thread has really finished with the request, also after a timeout or a client disconnect.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.engines.base import GenerationParams
from deployments.profiling import measure_replica
from deployments.registry import PUBLISH_PERIOD_S
from serve_app.admission.aimd import AimdBudget
from serve_app.admission.controller import Admission, AdmissionController
from serve_app.admission.policy import AdmissionPolicy
from serve_app.config import parse_args
from serve_app.errors import (
    InferenceTimeoutError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
)
from serve_app.schemas import Admitted, CompletionResult, EmbeddingResult

logger = logging.getLogger("ray.serve")

# Substrings of the CUDA errors after which a process's CUDA context is unusable. PyTorch raises
# them as RuntimeError carrying CUDA's own message, e.g. "CUDA error: an illegal memory access
# was encountered" or "CUDA error: device-side assert triggered".
DEVICE_FAULT_MARKS = ("CUDA error", "illegal memory access", "device-side assert")


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
        adm = args.admission
        self._aimd = AimdBudget(measured.budget_bytes, adm.oom_decrease_factor,
                                adm.oom_regrow_fraction, adm.oom_quiet_s,
                                adm.oom_floor_fraction) if self._policy.name == "budget" else None
        self._oom_count = 0
        self._running_since: float | None = None  # monotonic start of the running inference
        self._device_fault: str | None = None  # a non-OOM CUDA error: the replica is done
        context = serve.get_replica_context()
        self._replica_id = context.replica_id.unique_id if context else "local"
        self._memory = measured.status(args)
        runtime = ray.get_runtime_context()
        self._node_id = runtime.get_node_id()
        self._gpu_ids = [str(i) for i in runtime.get_accelerator_ids().get("GPU", [])]
        self._inferences_running = 0
        self._inferences_total = 0  # inferences the thread ran (abandoned work not counted)
        self._registry = registry
        self._publisher = loop.create_task(self._publish_forever()) if registry else None
        logger.info("model replica ready: %s", self._memory)

    async def embed(self, texts: list[str]) -> EmbeddingResult:
        """Embed ``texts`` (1..limits.max_inputs strings) once admitted.

        Raises:
            ModelNotFoundError: this replica serves another task (404).
            InvalidRequestError: an input has more than ``limits.max_input_tokens`` tokens.
            RequestTooLargeError, OverloadedError: from admission (400, 503).
            InferenceTimeoutError: inference ran past ``admission.inference_timeout_s`` (504).
        """
        self._require_task("embed")
        token_counts = await asyncio.to_thread(self._engine.count_tokens, texts)
        for i, n in enumerate(token_counts):
            self._check_tokens(n, self._max_input_tokens, f"input[{i}]", "input")
        admitted = await self._admit(len(token_counts), max(token_counts), 0)
        embeddings, thread_wait_s = await self._run_leased(
            admitted, lambda: self._engine.embed(texts))
        return EmbeddingResult(embeddings, sum(token_counts),
                               _admitted(admitted, thread_wait_s), self._replica_id)

    async def complete(self, prompt: str, params: GenerationParams) -> CompletionResult:
        """Complete ``prompt`` once admitted; priced by prompt tokens + ``max_tokens``.

        Raises: as :meth:`embed`, with ``prompt`` / ``max_tokens`` as the offending fields.
        """
        admitted, prompt_tokens = await self._admit_prompt(prompt, params)
        output, thread_wait_s = await self._run_leased(
            admitted, lambda: self._engine.generate(prompt, params))
        return CompletionResult(output.text, output.finish_reason, prompt_tokens,
                                output.completion_tokens, _admitted(admitted, thread_wait_s))

    async def complete_stream(self, prompt: str,
                              params: GenerationParams) -> AsyncIterator[dict[str, Any]]:
        """Stream a completion: first ``{"admitted": Admitted}`` once the lease is held, then
        ``{"text": piece}`` items, then ``{"finish_reason", "prompt_tokens",
        "completion_tokens"}``. Errors before the first item are the same as :meth:`complete`;
        an error after it (e.g. ``InferenceTimeoutError``) ends the stream by raising.

        When the consumer goes away, generation stops at the next token and the lease is
        released once the inference thread has returned.
        """
        admitted, prompt_tokens = await self._admit_prompt(prompt, params)
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
            raise
        future, job = self._start_leased(
            admitted, lambda: self._engine.generate(prompt, params, on_text))
        try:
            await self._wait_started(future, job, admitted)
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
                    raise self._timeout_error()
            while not pieces.empty():  # pieces put before the thread returned
                yield {"text": pieces.get_nowait()}
            try:
                output = future.result()
            except torch.OutOfMemoryError:
                raise self._after_oom(admitted.lease.nbytes) from None
            except RuntimeError as exc:
                raise self._after_device_error(exc) from None
            yield {"finish_reason": output.finish_reason, "prompt_tokens": prompt_tokens,
                   "completion_tokens": output.completion_tokens}
        finally:
            consumer_gone.set()

    async def _admit_prompt(self, prompt: str, params: GenerationParams,
                            ) -> tuple[Admission, int]:
        self._require_task("generate")
        [prompt_tokens] = await asyncio.to_thread(self._engine.count_tokens, [prompt])
        self._check_tokens(prompt_tokens, self._max_input_tokens, "prompt", "prompt")
        self._check_tokens(prompt_tokens + params.max_tokens, self._engine.max_seq_tokens,
                           "prompt + max_tokens", "max_tokens")
        return await self._admit(1, prompt_tokens, params.max_tokens), prompt_tokens

    async def _admit(self, batch: int, prompt_tokens: int, new_tokens: int) -> Admission:
        if self._device_fault is not None:
            raise OverloadedError("the model replica hit a device fault and is being replaced",
                                  code="draining", retry_after_s=1)
        request_bytes = self._cost_model.request_bytes(batch, prompt_tokens, new_tokens)
        return await self._gate.acquire(self._policy.units(request_bytes))

    def _require_task(self, task: str) -> None:
        if self._engine.task not in (task, "fake"):  # the fake engine serves both
            raise ModelNotFoundError(f"model {self._args.model.name!r} does not serve {task}")

    @staticmethod
    def _check_tokens(tokens: int, limit: int, what: str, code: str) -> None:
        if tokens > limit:
            raise InvalidRequestError(f"{what} has {tokens} tokens; the limit is {limit}",
                                      code=code)

    def _start_leased(self, admission: Admission,
                      work: Callable[[], Any]) -> tuple[asyncio.Future, _Job]:
        """Queue ``work`` for the inference thread. The lease is released when the thread is
        done with it, whatever happens to the caller meanwhile (timeout, cancellation); work
        whose caller left before the thread reached it is skipped."""
        loop = asyncio.get_running_loop()
        job = _Job(work, loop, self)
        try:
            future = loop.run_in_executor(self._executor, job)
        except BaseException:
            self._gate.release(admission.lease, ran=False)
            raise
        self._inferences_running += 1

        def finished(done: asyncio.Future) -> None:
            self._inferences_running -= 1
            self._running_since = None
            self._gate.release(admission.lease, ran=job.started_at is not None)
            self._inferences_total += job.started_at is not None
            if not done.cancelled():
                done.exception()  # retrieved here so an abandoned failure is not logged twice

        future.add_done_callback(finished)
        return future, job

    async def _wait_started(self, future: asyncio.Future, job: _Job,
                            admission: Admission) -> float:
        """Wait until the inference thread takes up ``job`` (it runs one job at a time);
        return the seconds waited. This is queue wait too: with the wait for the lease it is
        bounded by ``admission.max_queue_wait_s``.

        Raises:
            OverloadedError: ``queue_timeout`` (the job is abandoned, never run).
            asyncio.CancelledError: the caller left (the job is abandoned, never run).
        """
        started = asyncio.ensure_future(job.started.wait())
        waited_from = time.monotonic()
        limit_s = max(0.0, self._args.admission.max_queue_wait_s - admission.queue_wait_s)
        try:
            done, _ = await asyncio.wait({future, started}, timeout=limit_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.abandoned = True
            raise
        finally:
            started.cancel()
        if not done:
            job.abandoned = True
            raise OverloadedError(
                f"waited {self._args.admission.max_queue_wait_s:g} s for the inference thread "
                "without starting", code="queue_timeout",
                retry_after_s=self._gate.retry_after_s(admission.lease.nbytes))
        return time.monotonic() - waited_from

    async def _run_leased(self, admission: Admission,
                          work: Callable[[], Any]) -> tuple[Any, float]:
        """:meth:`_start_leased`; once the thread runs it, wait up to
        ``admission.inference_timeout_s``. Returns the result and the seconds spent waiting
        for the thread (part of the request's queue wait).

        Raises:
            InferenceTimeoutError: the thread is still running at the deadline (its lease
                stays held until it returns).
        """
        future, job = self._start_leased(admission, work)
        thread_wait_s = await self._wait_started(future, job, admission)
        try:
            async with asyncio.timeout(self._args.admission.inference_timeout_s):
                return await asyncio.shield(future), thread_wait_s
        except TimeoutError:
            raise self._timeout_error() from None
        except torch.OutOfMemoryError:
            raise self._after_oom(admission.lease.nbytes) from None
        except RuntimeError as exc:
            raise self._after_device_error(exc) from None

    def _after_device_error(self, exc: RuntimeError) -> Exception:
        """A CUDA error that is not an OOM ("device-side assert", "illegal memory access")
        leaves the CUDA context unusable: the replica stops admitting and fails its health
        check so Ray Serve replaces it; the budget is not shrunk. Other errors are bugs."""
        if not any(mark in str(exc) for mark in DEVICE_FAULT_MARKS):
            return exc
        self._device_fault = str(exc)
        logger.error("device fault, the replica will be replaced: %s", exc)
        return OverloadedError("the model replica hit a device fault and is being replaced",
                               code="draining", retry_after_s=1)

    async def check_health(self) -> None:
        """Ray Serve's health check (every ``deployment.health_check_period_s``).

        Raises:
            RuntimeError: after a device fault, or while an inference has run longer than
                ``admission.stuck_after_timeouts`` x ``inference_timeout_s``.
        """
        if self._device_fault is not None:
            raise RuntimeError(f"device fault: {self._device_fault}")
        adm = self._args.admission
        stuck_after_s = adm.stuck_after_timeouts * adm.inference_timeout_s
        if self._running_since is not None:
            running_s = time.monotonic() - self._running_since
            if running_s > stuck_after_s:
                raise RuntimeError(f"an inference has run for {running_s:.0f} s "
                                   f"(stuck after {stuck_after_s:g} s)")

    def _after_oom(self, request_units: int) -> OverloadedError:
        """A caught out-of-memory error: the request gets 503 ``oom``; under the budget policy
        the budget shrinks (AIMD, :mod:`serve_app.admission.aimd`) and regrows later."""
        self._oom_count += 1
        retry_after_s = self._gate.retry_after_s(request_units)
        if self._aimd is not None:
            budget = self._aimd.on_oom()
            self._gate.set_budget_bytes(budget, retry_after_s)
            logger.warning("out of memory: budget shrunk to %d bytes (%d OOMs so far)",
                           budget, self._oom_count)
        return OverloadedError("the device ran out of memory; retry later", code="oom",
                               retry_after_s=retry_after_s)

    def _regrow_budget(self) -> None:
        if self._aimd is not None and (budget := self._aimd.regrow()) is not None:
            self._gate.set_budget_bytes(budget, retry_after_s=1)
            logger.info("budget regrown to %d bytes", budget)

    def _timeout_error(self) -> InferenceTimeoutError:
        return InferenceTimeoutError(
            f"inference ran longer than {self._args.admission.inference_timeout_s:g} s")

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
            "inferences_running": self._inferences_running,
            "inferences_total": self._inferences_total,
            "drain_bytes_per_s": queue.drain.bytes_per_s(),
            "budget_bytes": budget.budget_bytes if self._aimd else self._memory["budget_bytes"],
            "measured_budget_bytes": self._memory["budget_bytes"],
            "oom_count": self._oom_count,
            "budget_shrink_count": self._aimd.shrink_count if self._aimd else 0,
            "budget_regrow_count": self._aimd.regrow_count if self._aimd else 0,
            "updated_at": time.time(),
        }

    async def _publish_forever(self) -> None:
        while True:
            self._regrow_budget()
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


class _Job:
    """One request's work for the inference thread: says when the thread took it up, is
    skipped if its caller left before that, and after an out-of-memory error returns PyTorch's
    cached blocks to the device (``torch.cuda.empty_cache``) before the error propagates."""

    def __init__(self, work: Callable[[], Any], loop: asyncio.AbstractEventLoop,
                 server: ModelServer) -> None:
        self._work, self._loop, self._server = work, loop, server
        self.started = asyncio.Event()
        self.started_at: float | None = None
        self.abandoned = False

    def __call__(self) -> Any:  # on the inference thread
        if self.abandoned:
            return None
        self.started_at = self._server._running_since = time.monotonic()
        self._loop.call_soon_threadsafe(self.started.set)
        try:
            return self._work()
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise


def _admitted(admission: Admission, thread_wait_s: float = 0.0) -> Admitted:
    """Queue wait = waiting for the lease + waiting for the inference thread."""
    return Admitted(admission.queue_wait_s + thread_wait_s, admission.queue_position)
