"""How many torch threads a model replica on CPU computes with: chosen at start-up, on the
node it runs on, from the cores it may use and a measurement.

The rule: with ``model.num_threads`` unset, the replica times one representative run
(:func:`probe_shape`: an embedder's P95 request, ``deployment.p95_inputs`` inputs of
``deployment.p95_input_tokens`` tokens, the request the deployment is planned for; a causal
LM's prompt of that length and 8 new tokens; each capped by the limits) at 1, 2, 4, ...
threads up to the cores this process may use (its CPU affinity, :func:`usable_cores`), and
keeps the **fewest threads whose throughput is within** :data:`TOLERANCE` **(5 %) of the
best**. More threads than that buy almost nothing and take cores from what shares the node
(the ingress, Ray's proxy, other replicas). Why 5 %: a candidate's time is its fastest run,
and load from elsewhere only slows runs, so a real gain shows; 5 % is above what the fastest
of two runs still varies by on a quiet host (1 % at 1 thread, a few % at 2 threads on this
2-core one), so a pass's worth of noise does not buy a core, and far below what a real core
brings (1.6-1.8x at 2 threads for MiniLM here), so none is given up. An explicit
``model.num_threads`` is used as given, unmeasured.

Where the figures come from (:func:`time_candidates`): each candidate is warmed up once (its
thread pool starts, first calls allocate), then timed in rounds that visit every candidate in
turn, so that load which comes and goes on the node falls on all of them alike: at least
:data:`MIN_ROUNDS`, more while under :data:`BUDGET_S` seconds, at most :data:`MAX_ROUNDS`; a
candidate's time is its fastest run. The choice and every candidate's items/s are shown in
the replica's ``/v1/status`` (``cpu_threads``) and logged.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from serve_app.config import AppArgs
from serve_app.memory.cost_model import Shape

logger = logging.getLogger("ray.serve")

TOLERANCE = 0.05
"""Throughput a choice may leave below the best candidate's, as a fraction of it."""
PROBE_NEW_TOKENS = 8
"""New tokens of a causal LM's probe run: a short prefill and decode."""
MIN_ROUNDS, MAX_ROUNDS = 2, 5
BUDGET_S = 1.5
"""Rounds go on past :data:`MIN_ROUNDS` while the measurement has taken less than this."""


@dataclass(frozen=True)
class ThreadChoice:
    """The threads a CPU replica computes with, and why.

    Attributes:
        threads: torch intra-op threads set.
        chosen_by: ``measured``, ``model.num_threads`` or ``one core`` (nothing to choose).
        cores: cores this process may use.
        shape: the probe run timed (``None`` when not measured).
        seconds: each candidate's fastest probe run, by thread count.
        measure_s: what measuring took, warm-ups included.
    """

    threads: int
    chosen_by: str
    cores: int
    shape: Shape | None = None
    seconds: Mapping[int, float] = field(default_factory=dict)
    measure_s: float = 0.0

    def items_per_s(self) -> dict[int, float]:
        """Each candidate's throughput: the probe's inputs (an embedder's texts, a causal
        LM's prompts) over its fastest run."""
        inputs = self.shape.inputs if self.shape else 1
        return {n: inputs / s for n, s in self.seconds.items()}

    def describe(self) -> dict[str, Any]:
        """What ``/v1/status`` shows (``cpu_threads``)."""
        shape = self.shape
        return {
            "threads": self.threads, "chosen_by": self.chosen_by, "cores": self.cores,
            "tolerance": TOLERANCE, "measure_s": round(self.measure_s, 3),
            "probe": dict(shape._asdict()) if shape else None,
            "candidates": [{"threads": n, "ms_per_run": round(1000 * self.seconds[n], 2),
                            "items_per_s": round(rate, 1)}
                           for n, rate in self.items_per_s().items()],
        }

    def summary(self) -> str:
        """One line for the log."""
        line = f"CPU threads: {self.threads} of {self.cores} core(s) ({self.chosen_by}"
        if not self.seconds:
            return line + ")"
        shape = self.shape
        rates = ", ".join(f"{n}: {r:.1f}" for n, r in self.items_per_s().items())
        return (f"{line}: fewest within {TOLERANCE:.0%} of the best; items/s by threads "
                f"{{{rates}}} over {shape.inputs} x {shape.prompt_tokens}+{shape.new_tokens} "
                f"tokens, {self.measure_s:.1f} s)")


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (what a container or ``taskset``
    leaves it), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def candidate_threads(cores: int) -> list[int]:
    """1, 2, 4, ... below ``cores``, then ``cores`` itself."""
    candidates, n = [], 1
    while n < cores:
        candidates.append(n)
        n *= 2
    return [*candidates, max(1, cores)]


def probe_shape(args: AppArgs, max_seq_tokens: int, is_decoder: bool) -> Shape:
    """The run timed per candidate (see module docstring), within the limits and context."""
    limits = args.limits
    new_tokens = min(PROBE_NEW_TOKENS, limits.max_tokens) if is_decoder else 0
    tokens = min(args.deployment.p95_input_tokens, limits.max_input_tokens,
                 max_seq_tokens - new_tokens)
    inputs = 1 if is_decoder else min(args.deployment.p95_inputs, limits.max_inputs)
    return Shape(inputs, max(1, tokens), new_tokens)


def time_candidates(run: Callable[[], object], candidates: Sequence[int],
                    set_threads: Callable[[int], None] = torch.set_num_threads,
                    clock: Callable[[], float] = time.perf_counter,
                    budget_s: float = BUDGET_S) -> dict[int, float]:
    """Each candidate's fastest ``run()``, seconds (see module docstring)."""
    started = clock()
    for n in candidates:  # warm-up
        set_threads(n)
        run()
    fastest = dict.fromkeys(candidates, math.inf)
    for done in range(MAX_ROUNDS):
        if done >= MIN_ROUNDS and clock() - started >= budget_s:
            break
        for n in candidates:
            set_threads(n)
            before = clock()
            run()
            fastest[n] = min(fastest[n], clock() - before)
    return fastest


def pick_threads(seconds: Mapping[int, float], tolerance: float = TOLERANCE) -> int:
    """The fewest threads whose throughput (1 / seconds) is within ``tolerance`` of the
    best's."""
    best = min(seconds.values())
    return min(n for n, s in seconds.items() if best / s >= 1 - tolerance)


def choose_threads(args: AppArgs, run: Callable[[Shape], object], shape: Shape,
                   set_threads: Callable[[int], None] = torch.set_num_threads,
                   cores: int | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> ThreadChoice:
    """Set and return a CPU replica's thread count: ``model.num_threads`` when set, else
    measured by running ``run(shape)`` at each candidate on ``cores`` (default:
    :func:`usable_cores`) as :func:`time_candidates` does with ``clock``."""
    cores = usable_cores() if cores is None else cores
    if args.model.num_threads is not None:
        choice = ThreadChoice(args.model.num_threads, "model.num_threads", cores)
    elif cores <= 1:
        choice = ThreadChoice(1, "one core", cores)
    else:
        started = clock()
        seconds = time_candidates(lambda: run(shape), candidate_threads(cores), set_threads,
                                  clock)
        choice = ThreadChoice(pick_threads(seconds), "measured", cores, shape, seconds,
                              clock() - started)
    set_threads(choice.threads)
    logger.info(choice.summary())
    return choice
