"""The scenarios, each returning rows of the table (:mod:`.report`).

- :func:`profile_rows`: the profile ``measure_replica`` measured at start-up (held bytes,
  budget, the profiler's own held-out error).
- :func:`held_out_rows`: shapes off the profile's ladder, run on the engine and measured with
  the device's own counters (``torch.cuda.max_memory_allocated``, the profile's unit, and
  ``max_memory_reserved``, or the simulated device's), against the fitted price.
- :func:`burst_rows`: a concurrent burst of mixed sizes through the replica's real parts
  (admission gate, batcher or continuous batching, inference thread) on a budget of
  :data:`.plan.BURST_BUDGET_REQUESTS` largest requests, on a card as small as that budget
  needs (the allocator capped at the idle replica + budget / ``memory.safety_factor``, as a
  replica's is at its capacity): every request answered, no OOM, the gate's ledger and the
  live tensors' growth within the budget, the reserved pool's within the card.
- :func:`oom_rows`: a real out-of-memory error: the budget set above the card, the cap lifted
  and the card filled but for a quarter of the request's price (as another process would
  fill it); the request must fail as 503 ``oom``, the budget shrink, the device stay healthy,
  and requests after the memory came back succeed.

Every scenario drives the engine on the thread it was profiled on (:class:`Loaded`), as a
replica does: profiling warms the thread (its cuBLAS handle, the kernels it loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deployments.replica.parts import Replica, ReplicaIdentity
from deployments.replica.profiling import MeasuredReplica
from serve_app.config import AppArgs
from serve_app.memory.cost_model import Shape, relative_error
from serve_app.metrics import ProcessMetrics

from .meters import PeakTrackingProbe
from .plan import BURST_BUDGET_REQUESTS, EngineSpec
from .report import Row, check, info, mib, share
from .requests import answer, largest, make_request, mixed_burst


class InferenceThread(Executor):
    """One thread that outlives the replica parts built on it: each scenario builds its own
    (:func:`serving`), whose shutdown would stop the thread; here the thread stops at
    :meth:`close` only, once every scenario of the engine ran."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """The parts' shutdown: the thread stays (see class docstring)."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class Loaded:
    """An engine loaded and profiled on ``executor``'s one thread, which then serves it (the
    replica's inference thread)."""

    args: AppArgs
    measured: MeasuredReplica
    executor: InferenceThread

    def on_thread(self, work: Any, *args: Any) -> Any:
        """``work(*args)`` on the inference thread, waited for."""
        return self.executor.submit(work, *args).result()


@contextlib.contextmanager
def capped(probe: Any, limit_bytes: int) -> Iterator[None]:
    """The CUDA allocator capped at ``limit_bytes`` (``CudaMemoryProbe.limit_to_capacity``),
    then at the replica's capacity again; nothing on a device without a cap."""
    cap = getattr(probe, "limit_to_capacity", None)
    if cap is None:
        yield
        return
    cap(limit_bytes)
    try:
        yield
    finally:
        cap()


def _bounded(scenario: str, figure: str, value: float, bound: float | None, text: str) -> Row:
    if bound is None:
        return info(scenario, figure, text)
    return check(scenario, figure, f"{text} (bound {share(bound)})", value <= bound)


def profile_rows(tag: str, measured: MeasuredReplica, spec: EngineSpec) -> list[Row]:
    """What the replica measured at start-up, and the profiler's own held-out error."""
    profile, scenario = measured.profile, f"{tag}: profile"
    low, high = profile.analytic_ratio_range
    return [
        info(scenario, "device", measured.probe.device),
        info(scenario, "held by the loaded model", mib(profile.held_bytes)),
        info(scenario, "capacity / budget", f"{mib(measured.probe.capacity_bytes())} / "
                                            f"{mib(measured.budget_bytes)}"),
        info(scenario, "largest request / its price",
             f"{tuple(measured.largest)} / {mib(measured.max_request_bytes)}"),
        _bounded(scenario, f"held-out error ({sum(p.held_out for p in profile.points)} of "
                 f"{len(profile.points)} points)", profile.held_out_error, spec.fit_bound,
                 share(profile.held_out_error)),
        info(scenario, "analytic / measured", f"{low:.2f} .. {high:.2f}"),
        info(scenario, "profiling time", f"{profile.duration_s:.1f} s"),
    ]


def held_out_shapes(top: Shape, count: int, rng: random.Random) -> list[Shape]:
    """``count`` shapes in the upper half of every dimension (above the allocator's noise
    floor), off the ladder's grid in general."""
    def pick(high: int) -> int:
        return rng.randint(max(1, high // 2), high) if high else 0

    return [Shape(pick(top.inputs), pick(top.prompt_tokens), pick(top.new_tokens))
            for _ in range(count)]


def held_out_rows(tag: str, loaded: Loaded, meter: Any, spec: EngineSpec,
                  rng: random.Random) -> list[Row]:
    """Off-ladder shapes run on the engine, their peaks read from the device's counters:
    the allocated peak (what tensors held: the profile's unit) within the fit bound of the
    price; the reserved peak (the allocator's segments, from an empty cache) shown beside."""
    measured, scenario = loaded.measured, f"{tag}: held-out vs device counters"
    errors, reserved = [], []
    for shape in held_out_shapes(measured.largest, spec.held_out, rng):
        base = meter.reset_peak()
        loaded.on_thread(measured.engine.profile_run, *shape)
        peak = meter.peak()
        price = measured.cost_model.request_bytes(*shape)
        errors.append(relative_error(price, peak[1] - base[1]))
        reserved.append((peak[0] - base[0]) / max(price, 1))
    bound = spec.fit_bound or 0.0
    return [
        check(scenario, f"max allocated-peak error ({len(errors)} shapes)",
              f"{share(max(errors))} (bound {share(bound)})", max(errors) <= bound),
        info(scenario, "reserved peak / price (min .. max)",
             f"{min(reserved):.2f} .. {max(reserved):.2f}"),
    ]


@contextlib.asynccontextmanager
async def serving(loaded: Loaded, budget_bytes: int, meter: Any) -> AsyncIterator[Replica]:
    """A replica's parts without Ray (:class:`deployments.replica.parts.Replica`) over the measured
    engine and profile, on ``budget_bytes``, on the thread the engine was profiled on; its
    probe folds peaks into ``meter``."""
    measured = loaded.measured
    probe = PeakTrackingProbe(measured.probe, meter) if meter is not None else measured.probe
    replica = Replica(measured.engine, probe, measured.cost_model, budget_bytes, loaded.args,
                      loaded.executor, ProcessMetrics("ModelServer", "gpu-check", use_ray=False),
                      ReplicaIdentity("gpu-check"),
                      prior_drain_bytes_per_s=measured.profile.drain_bytes_per_s)
    try:
        yield replica
    finally:
        replica.close()


async def _settled(replica: Replica, timeout_s: float = 5.0) -> None:
    """Wait until every lease went back (the thread hands them back just after the last
    answers), at most ``timeout_s``."""
    budget = replica.gate.budget
    for _ in range(int(timeout_s / 0.01)):
        if budget.reserved_bytes == 0 and budget.active_leases == 0:
            return
        await asyncio.sleep(0.01)


def _idle_rows(scenario: str, replica: Replica) -> Row:
    budget = replica.gate.budget
    return check(scenario, "gate idle after (reserved, leases)",
                 f"{budget.reserved_bytes} B, {budget.active_leases}",
                 budget.reserved_bytes == 0 and budget.active_leases == 0)


async def burst_rows(tag: str, loaded: Loaded, meter: Any, spec: EngineSpec,
                     rng: random.Random) -> list[Row]:
    """A concurrent burst of mixed sizes on a budget of a few largest requests, on a card
    just large enough for that budget (see module docstring)."""
    scenario, measured, args = f"{tag}: burst", loaded.measured, loaded.args
    budget = BURST_BUDGET_REQUESTS * measured.max_request_bytes
    room = math.ceil(budget / args.memory.safety_factor)  # what the card has beyond idle
    engine = measured.engine
    async with serving(loaded, budget, meter) as replica:
        warm = make_request(spec.kinds[0], Shape(1, 4, 2 if spec.kinds[0] == "generate" else 0),
                            engine, args, rng)
        await answer(replica.lifecycle, warm)  # the parts' first pass or step
        idle = meter.reset_peak() if meter is not None else None
        requests = mixed_burst(spec.kinds, spec.burst, engine, args, rng)
        with capped(measured.probe, (idle[0] if idle else 0) + room):
            answers = await asyncio.gather(*(answer(replica.lifecycle, r) for r in requests))
        peak = meter.peak() if meter is not None else None
        await _settled(replica)
        rows = _burst_figures(scenario, replica, answers, budget)
        if meter is not None:
            rows += _device_figures(scenario, measured, idle, peak, budget, room)
        rows.append(_idle_rows(scenario, replica))
    return rows


def _burst_figures(scenario: str, replica: Replica, answers: list[tuple[str, bool]],
                   budget: int) -> list[Row]:
    outcomes = [outcome for outcome, _ in answers]
    failed = sorted({o for o in outcomes if o != "ok"})
    gate = replica.gate.budget
    return [
        check(scenario, "answered ok", f"{outcomes.count('ok')}/{len(outcomes)}"
              + (f" (others: {', '.join(failed)})" if failed else ""), not failed),
        check(scenario, "out-of-memory errors", str(replica.health.oom_count),
              replica.health.oom_count == 0 and "503 oom" not in outcomes),
        info(scenario, "queued behind others", f"{sum(q for _, q in answers)}/{len(answers)}"),
        check(scenario, "gate peak reserved <= budget",
              f"{mib(gate.peak_reserved_bytes)} <= {mib(budget)}",
              gate.peak_reserved_bytes <= budget),
    ]


def _device_figures(scenario: str, measured: MeasuredReplica, idle: tuple[int, int],
                    peak: tuple[int, int], budget: int, room: int) -> list[Row]:
    reserved, allocated = peak[0] - idle[0], peak[1] - idle[1]
    return [
        info(scenario, "idle replica holds (profile's held)",
             f"{mib(idle[0])} ({mib(measured.profile.held_bytes)})"),
        check(scenario, "device peak - idle <= budget (allocated)",
              f"{mib(allocated)} <= {mib(budget)}", allocated <= budget),
        check(scenario, "device peak - idle <= budget / safety (reserved)",
              f"{mib(reserved)} <= {mib(room)}", reserved <= room),
        info(scenario, "reserved / allocated growth", f"{reserved / max(allocated, 1):.2f}"),
    ]


async def oom_rows(tag: str, loaded: Loaded, meter: Any, rng: random.Random) -> list[Row]:
    """A real OOM with the budget above the card, caught and recovered from."""
    scenario, measured, args = f"{tag}: forced OOM", loaded.measured, loaded.args
    engine, budget = measured.engine, 2 * meter.card_bytes
    kind = "generate" if "generate" in engine.kinds else engine.kinds[0]
    top = largest(kind, engine, args)
    async with serving(loaded, budget, meter) as replica:
        big = make_request(kind, top, engine, args, rng)
        price = replica.cost_model.request_bytes(*big.shape)
        with capped(measured.probe, meter.card_bytes):  # the card itself is the limit
            release = meter.ballast(leave_free_bytes=price // 4)
            try:
                forced, _ = await answer(replica.lifecycle, big)
            finally:
                release()
        policy, health = replica.policy, replica.health
        shrunk_to, factor = policy.budget_bytes, replica.cost_model.factor
        later = [make_request(kind, top, engine, args, rng)] + mixed_burst(
            (kind,), 3, engine, args, rng)
        after = [outcome for outcome, _ in
                 await asyncio.gather(*(answer(replica.lifecycle, r) for r in later))]
        await _settled(replica)
        return [
            info(scenario, "budget (the card)", f"{mib(budget)} ({mib(meter.card_bytes)})"),
            info(scenario, "left free (request's price)",
                 f"{mib(meter.left_free_bytes)} ({mib(price)})"),
            check(scenario, "forced request answered", forced, forced == "503 oom"),
            check(scenario, "out-of-memory errors caught", str(health.oom_count),
                  health.oom_count >= 1),
            check(scenario, "budget shrunk", f"{mib(budget)} -> {mib(shrunk_to)}",
                  shrunk_to < budget and policy.shrink_count >= 1),
            check(scenario, "device fault (canary NaN/Inf)", str(health.device_fault),
                  health.device_fault is None),
            info(scenario, "price correction factor", f"{factor:.2f}"),
            check(scenario, "answered ok after the memory came back",
                  f"{after.count('ok')}/{len(after)}", after.count("ok") == len(after)),
            _idle_rows(scenario, replica),
        ]
