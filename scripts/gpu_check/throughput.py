"""Throughput through the replica's parts against the bare model's batched calls.

The same requests (all of one shape, so that batching them wastes nothing on padding) run
twice per round: **bare**, the engine's own batched call on chunks of
``batching.max_batch_size`` (``run_embed`` for embeddings: one padded forward pass;
``generate_batch_ids`` for completions: one padded ``model.generate``), back to back on this
thread; and **served**, every request at once through the replica's admission gate, batcher
or continuous-batching decode loop and inference thread (:class:`deployments.replica.parts.Replica`
on the measured budget), both on the thread the engine was profiled on. Each path's best
round over :data:`ROUNDS` is kept (the first round also warms the kernels for the batch
sizes used), and the figure is
``served / bare`` in tokens per second: input tokens for embeddings, generated tokens for
completions (counted from each path's own outputs).

The bound, :data:`RATIO_BOUND` (0.9), is the one the GPU-check issue set: the gate, the
batcher and the thread may cost at most a tenth of what the model alone does. On CPU the
figure is shown, not checked (the fake engine's passes are sleeps, and two cores are shared
by the event loop and the inference thread).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from serve_app.config import AppArgs
from serve_app.memory.cost_model import Shape
from serve_app.request import InferenceRequest

from .report import Row, check, info
from .requests import make_request

ROUNDS = 2
RATIO_BOUND = 0.9


def output_tokens(output: Any, request: InferenceRequest) -> int:
    """Tokens a path produced for ``request``: a completion's generated tokens, else the
    input tokens it embedded."""
    generated = getattr(output, "completion_tokens", None)
    return generated if generated is not None else request.shape.inputs * \
        request.shape.prompt_tokens


def bare_pass(engine: Any, chunk: Sequence[InferenceRequest]) -> list[Any]:
    """The model's own batched call over ``chunk`` (one kind, one shape)."""
    if chunk[0].kind == "generate":
        return engine.generate_batch_ids([r.input_ids[0] for r in chunk],
                                         [r.params for r in chunk])
    return engine.run_batch(chunk)


def run_bare(engine: Any, requests: Sequence[InferenceRequest], batch: int,
             settle: Callable[[], None]) -> tuple[int, float]:
    """``(tokens, seconds)`` for ``requests`` in chunks of ``batch`` requests' inputs."""
    per_pass = max(1, batch // max(1, requests[0].shape.inputs))
    settle()
    started, tokens = time.perf_counter(), 0
    for start in range(0, len(requests), per_pass):
        chunk = requests[start:start + per_pass]
        tokens += sum(output_tokens(o, r) for o, r in zip(bare_pass(engine, chunk), chunk,
                                                          strict=True))
    settle()
    return tokens, time.perf_counter() - started


async def run_served(infer: Callable[[InferenceRequest], Awaitable[Any]],
                     requests: Sequence[InferenceRequest],
                     settle: Callable[[], None]) -> tuple[int, float]:
    """``(tokens, seconds)`` for ``requests`` sent all at once through ``infer`` (the
    replica's ``lifecycle.infer``)."""
    settle()
    started = time.perf_counter()
    results = await asyncio.gather(*(infer(r) for r in requests))
    settle()
    seconds = time.perf_counter() - started
    return sum(output_tokens(res.output, r) for res, r in zip(results, requests,
                                                              strict=True)), seconds


def workload(kind: str, count: int, shape: Shape, engine: Any, args: AppArgs,
             rng: random.Random) -> list[InferenceRequest]:
    """``count`` requests of ``kind``, all of ``shape`` (greedy completions)."""
    return [make_request(kind, shape, engine, args, rng) for _ in range(count)]


async def throughput_rows(tag: str, loaded: Any, meter: Any, spec: Any,
                          rng: random.Random) -> list[Row]:
    """The served/bare ratio for ``spec.throughput`` (``(kind, count, shape)``), checked
    against :data:`RATIO_BOUND` where ``spec.meter`` is ``cuda``. Both paths run on the
    engine's inference thread (``loaded``: :class:`.scenarios.Loaded`)."""
    from .scenarios import serving

    scenario, measured, args = f"{tag}: throughput", loaded.measured, loaded.args
    kind, count, shape = spec.throughput
    engine = measured.engine
    requests = workload(kind, count, shape, engine, args, rng)
    settle = meter.synchronize if meter is not None else (lambda: None)
    batch = args.batching.max_batch_size
    bare, served = (0, float("inf")), (0, float("inf"))
    loop = asyncio.get_running_loop()
    async with serving(loaded, measured.budget_bytes, meter) as replica:
        for _ in range(ROUNDS):
            done = await loop.run_in_executor(loaded.executor, run_bare, engine, requests,
                                              batch, settle)
            bare = min(bare, done, key=lambda tokens_s: tokens_s[1])
            done = await run_served(replica.lifecycle.infer, requests, settle)
            served = min(served, done, key=lambda tokens_s: tokens_s[1])
    return _rows(scenario, spec, kind, f"{count} x {tuple(shape)}, passes of {batch}",
                 bare, served)


def _rows(scenario: str, spec: Any, kind: str, workload_text: str, bare: tuple[int, float],
          served: tuple[int, float]) -> list[Row]:
    bare_rate, served_rate = bare[0] / bare[1], served[0] / served[1]
    ratio = served_rate / bare_rate
    unit = "generated tokens/s" if kind == "generate" else "input tokens/s"
    same = f"{bare[0]}, {served[0]}"
    rows = [info(scenario, "workload (requests x shape)", workload_text),
            # Embeddings count input tokens: equal unless a request was lost. A completion
            # may end at a different EOS when batched differently (fp16 rounding): shown.
            check(scenario, "tokens (bare, replica)", same, bare[0] == served[0])
            if kind != "generate" else info(scenario, "tokens (bare, replica)", same),
            info(scenario, f"bare model ({unit})", f"{bare_rate:,.0f} ({bare[1]:.2f} s)"),
            info(scenario, f"through the replica ({unit})",
                 f"{served_rate:,.0f} ({served[1]:.2f} s)")]
    figure = "replica / bare"
    if spec.meter != "cuda":
        return rows + [info(scenario, figure, f"{ratio:.2f}")]
    return rows + [check(scenario, figure, f"{ratio:.2f} (bound >= {RATIO_BOUND})",
                         ratio >= RATIO_BOUND)]
