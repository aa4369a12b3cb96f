"""Start-up memory profiling: run real inferences over a ladder of sizes, fit the cost model.

Engine- and device-agnostic: the caller passes a ``run(batch, prompt_tokens, new_tokens)``
that performs one real inference of that shape, and a probe
(:class:`serve_app.memory.probes.DeviceProbe`) that measures its peak. No torch import here.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, asdict, dataclass, field
from pathlib import Path
from typing import Any

from serve_app.memory.cost_model import (
    TOKEN_AXES,
    CostModel,
    FittedCostModel,
    Shape,
    fit_cost_model,
    relative_error,
)
from serve_app.memory.probes import DeviceProbe

logger = logging.getLogger(__name__)
PROFILE_VERSION = 1

# Documented accuracy on CPU (host RSS high-water marks, median of 3 runs per shape), checked
# by tests/unit/test_profiler_models.py. Measured on the 2-core dev machine, one fresh process
# per run: all-MiniLM-L6-v2 (16 inputs x 128 tokens max) held-out errors 3.6-8.4 % over 6 runs;
# a 4-layer, 256-wide Llama (256-token prompts, 128 new tokens) 1.1-41.3 % over 7 runs, its
# smallest held-out peak (1 x (64 + 32) tokens) being 1.1 MiB, near the RSS noise; 1024 wide
# (smallest held-out peak 4.6-4.9 MiB) 5.6-25.5 % over 4 runs, on a machine busy with other
# work. With one run per shape they were 4-46 % (a CI run read 1.5 MiB for a 2 x 32 point
# that repeats put at 1.7-3.6 MiB), hence the repeats and the margin. MiniLM at 16 x 128 once
# read 43 % under the full test suite's load (its 2 x 32 held-out peak, 1.8 MiB fitted, read
# 3.3 MiB), so its test profiles 64 x 256 (smallest held-out peak ~15 MiB): 2.2-15.8 % over 4
# runs, 2 of them with both cores busy with other work.
CPU_FIT_ERROR_BOUND = 0.35
# The analytic estimate (config.json only) stays within this factor of the measured peaks
# (1 MiB floor): measured 0.60-1.91 x on the same runs.
ANALYTIC_FACTOR_BOUND = 3.0


def profile_ladder(max_batch: int, max_prompt_tokens: int,
                   max_new_tokens: int = 0) -> tuple[list[Shape], list[Shape]]:
    """Shapes to measure: a grid for fitting, and off-grid shapes held out to test the fit.

    The grid spans 1..``max_batch`` x a few prompt lengths up to ``max_prompt_tokens`` (x new
    tokens up to ``max_new_tokens`` for generation), so the largest request the limits allow is
    always measured. Returns ``(train, held_out)`` as :class:`Shape` s, smallest first.
    """
    batches = sorted({1, max(1, max_batch // 4), max_batch})
    prompts = sorted({min(8, max_prompt_tokens), max(1, max_prompt_tokens // 2),
                      max_prompt_tokens})
    news = sorted({1, max(1, max_new_tokens // 2), max_new_tokens}) if max_new_tokens else [0]
    train = [Shape(b, p, n) for b in batches for p in prompts for n in news]
    candidates = [Shape(max(1, max_batch // 2), max(1, 3 * max_prompt_tokens // 4),
                        3 * max_new_tokens // 4),
                  Shape(max(1, max_batch // 8), max(1, max_prompt_tokens // 4),
                        max_new_tokens // 4)]
    held_out = sorted({s for s in candidates if s not in train})
    return sorted(train, key=_volume), held_out


def _volume(shape: Shape) -> int:
    return shape[0] * (shape[1] + shape[2])


@dataclass(frozen=True)
class ProfilePoint:
    """One measured shape: its peak (median over the probe's repeats, bytes above the
    baseline), how far the repeats spread (max - min, bytes), what the models predict, and
    how long one inference of it took (median over the repeats, seconds; 0 in profiles saved
    before it was recorded)."""

    batch: int
    prompt_tokens: int
    new_tokens: int
    _: KW_ONLY
    measured_bytes: int
    predicted_bytes: int
    analytic_bytes: int
    held_out: bool
    spread_bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class MemoryProfile:
    """What a replica measured at start-up, and the budget derived from it.

    Attributes:
        device, method: the probe's device and how it measured (e.g. host RSS high-water mark).
        task, model_path: what was profiled.
        capacity_bytes: the replica's share of the device.
        held_bytes: what the loaded model holds (use after load - use before).
        cost_model: the fitted model (coefficients, held-out error).
        points: every measurement, with predictions of the fitted and analytic models.
        duration_s: how long profiling took.
        shape_axes: what the three shape slots of ``points`` mean for the engine
            (``Engine.shape_axes``; the token kinds': batch, prompt tokens, new tokens).
    """

    device: str
    method: str
    task: str
    model_path: str
    capacity_bytes: int
    held_bytes: int
    cost_model: FittedCostModel
    points: tuple[ProfilePoint, ...]
    duration_s: float
    created_at: float = field(default_factory=time.time)
    shape_axes: tuple[str, ...] = TOKEN_AXES

    @property
    def held_out_error(self) -> float:
        """The fit's largest relative error on the held-out shapes
        (:attr:`~serve_app.memory.cost_model.FittedCostModel.held_out_error`)."""
        return self.cost_model.held_out_error

    @property
    def drain_bytes_per_s(self) -> float | None:
        """The largest profiled shape's price over the seconds it ran alone: how fast a
        replica busy with the largest requests the limits allow (those that make long waits)
        gives leased bytes back, for predicted waits before it has measured its own drain
        rate (``None`` in a profile without times). Not the fastest shape's: on the 2-core
        dev machine MiniLM's rates ranged 30-176 MiB/s over the ladder, the largest shape's
        94 MiB/s, and predicting a burst of largest requests at 176 let one of six wait its
        whole limit (``python -m benchmarks.refusals --workload cold``)."""
        timed = [p for p in self.points if p.seconds > 0 and p.predicted_bytes > 0]
        if not timed:
            return None
        top = max(timed, key=lambda p: (p.predicted_bytes, p.seconds))
        return top.predicted_bytes / top.seconds

    @property
    def analytic_ratio_range(self) -> tuple[float, float]:
        """Smallest and largest ``analytic / measured`` over the points (floor 1 MiB); NaN
        without points (an engine that pages its own KV cache is not profiled)."""
        if not self.points:
            return math.nan, math.nan
        ratios = [p.analytic_bytes / max(p.measured_bytes, 1 << 20) for p in self.points]
        return min(ratios), max(ratios)

    def to_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["cost_model"] = self.cost_model.to_dict()
        raw["version"] = PROFILE_VERSION
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MemoryProfile:
        """Raises ValueError for a file of another version or shape."""
        if raw.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {raw.get('version')!r}, expected "
                             f"{PROFILE_VERSION}; profile again")
        fields = {k: v for k, v in raw.items() if k != "version"}
        fields["cost_model"] = FittedCostModel.from_dict(raw["cost_model"])
        fields["points"] = tuple(ProfilePoint(**p) for p in raw["points"])
        fields["shape_axes"] = tuple(raw.get("shape_axes", TOKEN_AXES))
        return cls(**fields)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> MemoryProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def summary(self) -> dict[str, Any]:
        """The JSON-ready digest shown in ``/v1/status``."""
        low, high = self.analytic_ratio_range
        return {"method": self.method, "shape_axes": list(self.shape_axes),
                "cost_model": self.cost_model.to_dict(),
                "points": len(self.points), "duration_s": round(self.duration_s, 2),
                "analytic_over_measured": [round(low, 2), round(high, 2)]
                if self.points else None}

    def table(self) -> str:
        """A plain-text table of the measurements, for the CLI and the logs: per point its
        shape (over :attr:`shape_axes`), the measured peak, the fitted and the analytic
        prices and the spread of the repeats (MiB, as the column titles say), the fit's
        relative error, the seconds one run took, and whether the point was fitted or held
        out."""
        titles = (*self.shape_axes, "measured MiB", "fitted MiB", "error", "analytic MiB",
                  "spread MiB", "seconds")
        widths = [max(6, len(title)) for title in titles]  # 6: "100.0%"
        rows = [" ".join(f"{t:>{w}}" for t, w in zip(titles, widths, strict=True)) + "  set"]
        for p in self.points:
            values = (p.batch, p.prompt_tokens, p.new_tokens,
                      f"{p.measured_bytes / 2**20:.1f}", f"{p.predicted_bytes / 2**20:.1f}",
                      f"{relative_error(p.predicted_bytes, p.measured_bytes):.1%}",
                      f"{p.analytic_bytes / 2**20:.1f}", f"{p.spread_bytes / 2**20:.1f}",
                      f"{p.seconds:.3f}")
            rows.append(" ".join(f"{v:>{w}}" for v, w in zip(values, widths, strict=True))
                        + f"  {'held-out' if p.held_out else 'fit'}")
        return "\n".join(rows)


def load_profile(path: str | Path) -> MemoryProfile | None:
    """The profile saved at ``path``, or ``None`` when ``path`` is empty or (with a warning
    saying why) cannot be read: callers then measure again or use the analytic estimate."""
    if not str(path):
        return None
    try:
        return MemoryProfile.load(Path(path).expanduser())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("cannot use the profile %s: %s", path, exc)
        return None


def measure_peaks(run: Callable[[int, int, int], Any], probe: DeviceProbe,
                  shapes: list[Shape], on_progress: Callable[[str], None] = logger.info,
                  shape_axes: tuple[str, ...] = TOKEN_AXES,
                  clock: Callable[[], float] = time.monotonic,
                  ) -> list[tuple[int, int, float]]:
    """Run each shape ``probe.repeats`` times; return ``(median, max - min)`` of its peak
    bytes above the pre-run baseline and the median seconds of a run, per shape. The median,
    because a noisy probe's single readings stray both ways (see
    :class:`~serve_app.memory.probes.HostMemoryProbe`)."""
    results = []
    for i, shape in enumerate(shapes, 1):
        started = time.monotonic()
        readings, durations = [], []
        for _ in range(max(1, probe.repeats)):
            baseline = probe.start_peak()
            ran_at = clock()
            run(*shape)
            durations.append(clock() - ran_at)
            readings.append(max(0, probe.peak_bytes() - baseline))
        median = int(statistics.median_low(readings))
        results.append((median, max(readings) - min(readings), statistics.median(durations)))
        spread = (f" (spread {results[-1][1] / 2**20:.1f} MiB over {len(readings)} runs)"
                  if len(readings) > 1 else "")
        size = " ".join(f"{axis}={value}" for axis, value in zip(shape_axes, shape,
                                                                    strict=True))
        on_progress(f"profiled {i}/{len(shapes)}: {size} peak={median / 2**20:.1f} MiB{spread} "
                    f"({time.monotonic() - started:.2f} s)")
    return results


def profile_memory(run: Callable[[int, int, int], Any], probe: DeviceProbe,
                   analytic: CostModel | None, *, features: tuple[str, ...],
                   ladder: tuple[list[Shape], list[Shape]], task: str, model_path: str,
                   held_bytes: int, shape_axes: tuple[str, ...] = TOKEN_AXES,
                   on_progress: Callable[[str], None] = logger.info) -> MemoryProfile:
    """Measure the shapes of ``ladder`` (``(fitted, held out)``, from the engine's
    :func:`profile_ladder`), fit the cost model over ``features``, check it on the held-out
    shapes. One warm-up run of the smallest shape first: first calls allocate lazily (thread
    pools, kernels) and would read as request memory. ``analytic``: the cross-check shown
    beside each point (``None``: shown as 0). ``shape_axes``: what the engine's three shape
    slots mean (``Engine.shape_axes``), recorded in the profile and shown in its table.

    Raises:
        ValueError: the measurements are all zero (the probe sees nothing; fix the probe).
    """
    started = time.monotonic()
    train, held_out = ladder
    run(*train[0])
    measured = measure_peaks(run, probe, train + held_out, on_progress, shape_axes)
    peaks = [median for median, _, _ in measured]
    train_peaks, held_peaks = peaks[:len(train)], peaks[len(train):]
    if not any(peaks):
        raise ValueError(f"every measured peak was 0 bytes with {probe.method}")
    if not any(shape[2] for shape in train):
        features = tuple(f for f in features if f != "batch_prompt")
    features = features[:len(train)]  # tiny limits give few shapes: fit fewer terms
    fitted = fit_cost_model(train, train_peaks, features)
    errors = [relative_error(fitted.request_bytes(*shape), measured)
              for shape, measured in zip(held_out, held_peaks, strict=True)]
    fitted = FittedCostModel(fitted.features, fitted.coefficients,
                             max(errors) if errors else float("nan"))
    points = tuple(
        ProfilePoint(*shape, measured_bytes=median, predicted_bytes=fitted.request_bytes(*shape),
                     analytic_bytes=analytic.request_bytes(*shape) if analytic else 0,
                     held_out=i >= len(train), spread_bytes=spread, seconds=seconds)
        for i, (shape, (median, spread, seconds)) in enumerate(zip(train + held_out, measured,
                                                                   strict=True)))
    return MemoryProfile(device=probe.device, method=probe.method, task=task,
                         model_path=model_path, capacity_bytes=probe.capacity_bytes(),
                         held_bytes=held_bytes, cost_model=fitted, points=points,
                         duration_s=time.monotonic() - started, shape_axes=tuple(shape_axes))
