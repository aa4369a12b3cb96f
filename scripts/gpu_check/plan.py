"""What the check runs on each device: the engines, their limits, burst sizes and bounds.

Bounds and where they come from:

- :data:`GPU_FIT_ERROR_BOUND` (10 %): the held-out error a profile on a GPU must stay within
  (the GPU-check issue's bound; also ``tests/gpu/test_gpu_memory.py``'s). Peaks are
  ``max_memory_allocated``, exact byte counts of live tensors
  (:class:`serve_app.memory.probes.CudaMemoryProbe`), so what is left is the fit itself.
  Against reserved peaks (the allocator's segments) the first H200 run read 8.7-61.0 %.
- :data:`EXACT_ERROR_BOUND`: on the simulated device every allocation is counted exactly
  (:mod:`serve_app.memory.simulated`) and the fake engine's costs are linear in tokens, so a
  fitted price is off by its rounding to a whole byte at most (relative errors are taken over
  at least 1 MiB, :data:`serve_app.memory.cost_model.ERROR_FLOOR_BYTES`).
- Host RSS peaks (the real engines on CPU) are noisy (see
  :data:`serve_app.memory.profiler.CPU_FIT_ERROR_BOUND` and its measurements): shown, not
  checked here; ``tests/unit/test_profiler_models.py`` checks them in fresh processes.
- Burst budgets are :data:`BURST_BUDGET_REQUESTS` x the largest allowed request's price, so
  that the gate binds (requests queue) whatever the card's size; the live tensors' growth
  over the idle replica must stay within that budget (allocated bytes), and the card is
  made as small as a replica with that budget would have (the allocator capped at idle +
  budget / ``memory.safety_factor``, as a replica's is at its capacity), so that cached
  blocks beyond the budget are given back rather than grown past it: no OOM, and the
  reserved pool's growth within that room. The first H200 run, uncapped, grew the reserved
  pool 1.36 to 1.51 x the live tensors over a budget of 2 requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.memory.cost_model import Shape

GPU_FIT_ERROR_BOUND = 0.10
EXACT_ERROR_BOUND = 1e-5
BURST_BUDGET_REQUESTS = 4
MiB, GiB = 1 << 20, 1 << 30

ADMISSION = {"max_queue_len": 512, "max_queue_wait_s": 300, "inference_timeout_s": 300}


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """One engine the check loads and drives.

    Attributes:
        name: the row prefix (``fake``, ``generate``, ``embed``).
        raw_args: the replica's ``args:``; a model path of ``"{model}"`` is filled in with
            the directory built for ``model``.
        model: which model directory (:mod:`.models`) it serves, ``None`` for the fake one.
        meter: ``simulated`` or ``cuda`` (device figures checked), ``host`` (host RSS:
            shown only).
        fit_bound: the largest held-out error allowed, ``None``: shown only.
        burst: requests in the concurrent burst.
        held_out: extra shapes measured directly against the device's own counters.
        oom: whether the forced out-of-memory scenario runs on it.
        throughput: ``(kind, requests, shape)`` timed bare and through the replica
            (:mod:`.throughput`), ``None``: not timed.
    """

    name: str
    raw_args: dict
    model: tuple[str, str] | None
    meter: str
    fit_bound: float | None
    burst: int
    held_out: int = 0
    oom: bool = False
    kinds: tuple[str, ...] = field(default=("generate",))
    throughput: tuple[str, int, Shape] | None = None


def _args(model: dict, limits: dict, **sections: dict) -> dict:
    return {"model": model, "limits": limits, "admission": ADMISSION, **sections}


def cpu_plan(quick: bool) -> list[EngineSpec]:
    """The simulated device (the fake engine: every device figure exact, the forced OOM)
    and the real engines on tiny random-weight models (host RSS: shown only)."""
    fake = _args({"task": "fake"}, {"max_inputs": 8, "max_input_tokens": 128, "max_tokens": 64},
                 fake={"device_capacity_bytes": GiB, "weights_bytes": 128 * MiB,
                       "bytes_per_token": 64 * 1024, "bytes_per_request": MiB // 4,
                       "latency_per_token_s": 1e-5, "latency_per_pass_s": 0.001,
                       "max_seq_tokens": 512},
                 batching={"max_batch_size": 16})
    plan = [EngineSpec(name="fake", raw_args=fake, model=None, meter="simulated",
                       fit_bound=EXACT_ERROR_BOUND, burst=32 if quick else 64,
                       held_out=3 if quick else 6, oom=True, kinds=("embed", "generate"),
                       throughput=("embed", 64 if quick else 256, Shape(1, 32, 0))),
            EngineSpec(name="generate",
                       raw_args=_args({"task": "generate", "path": "{model}", "device": "cpu"},
                                      {"max_input_tokens": 64, "max_tokens": 16}),
                       model=("causal", "tiny"), meter="host", fit_bound=None,
                       burst=6 if quick else 12,
                       throughput=("generate", 8 if quick else 16, Shape(1, 16, 8)))]
    if not quick:  # sentence-transformers alone takes ~10 s to import on 2 cores
        plan.append(EngineSpec(name="embed",
                               raw_args=_args({"task": "embed", "path": "{model}",
                                               "device": "cpu"},
                                              {"max_inputs": 8, "max_input_tokens": 64}),
                               model=("bert", "tiny"), meter="host", fit_bound=None, burst=12,
                               kinds=("embed",)))
    return plan


def cuda_plan(quick: bool) -> list[EngineSpec]:
    """A ~1.1B-parameter fp16 Llama (quick: ~0.2B) serving completions, with the forced OOM,
    and a ~0.3B fp16 BERT (quick: ~0.1B) serving embeddings through the batcher, each on half
    the card as two replicas per GPU would be."""
    gpu = {"device": "cuda", "dtype": "float16"}
    half = {"num_gpus": 0.5}
    return [
        EngineSpec(name="generate",
                   raw_args=_args({"task": "generate", "path": "{model}", **gpu},
                                  {"max_input_tokens": 512 if quick else 1024,
                                   "max_tokens": 64 if quick else 128},
                                  deployment=half),
                   model=("causal", "small" if quick else "1b"), meter="cuda",
                   fit_bound=GPU_FIT_ERROR_BOUND,
                   burst=24 if quick else 48, held_out=2 if quick else 4, oom=True,
                   throughput=("generate", 32 if quick else 64,
                               Shape(1, 64, 32) if quick else Shape(1, 128, 64))),
        EngineSpec(name="embed",
                   raw_args=_args({"task": "embed", "path": "{model}", **gpu},
                                  {"max_inputs": 32, "max_input_tokens": 512},
                                  deployment=half, batching={"max_batch_size": 64}),
                   model=("bert", "base" if quick else "large"), meter="cuda",
                   fit_bound=GPU_FIT_ERROR_BOUND,
                   burst=24 if quick else 48, held_out=2 if quick else 4, kinds=("embed",),
                   throughput=("embed", 256 if quick else 512,
                               Shape(1, 128, 0) if quick else Shape(1, 256, 0))),
    ]
