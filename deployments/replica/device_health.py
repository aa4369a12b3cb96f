"""What a replica learns when its device fails, and what it does about it.

- An out-of-memory error frees PyTorch's cached blocks, runs a canary inference that checks
  the output for NaN/Inf, corrects the cost model from the observed point, and lets the
  admission policy adapt the budget (the budget policy's AIMD, :mod:`serve_app.admission.aimd`).
- A canary with non-finite output, or a non-OOM CUDA error ("device-side assert", "illegal
  memory access"), marks a device fault: the replica admits nothing more and fails its health
  check so Ray Serve replaces it; the budget is not shrunk.
- An inference running past ``admission.stuck_after_timeouts`` x ``inference_timeout_s``
  fails the health check too.
"""

from __future__ import annotations

import logging
import time

import torch

from deployments.engines.base import Engine
from serve_app.admission.controller import AdmissionController
from serve_app.admission.policy import AdmissionPolicy
from serve_app.config import AdmissionConfig
from serve_app.errors import OverloadedError
from serve_app.memory.cost_model import CorrectedCostModel
from serve_app.memory.probes import DeviceProbe
from serve_app.metrics import ProcessMetrics
from serve_app.outcomes import Reason
from serve_app.replica_state import DeviceFigures

logger = logging.getLogger("ray.serve")

# Substrings of the CUDA errors after which a process's CUDA context is unusable. PyTorch raises
# them as RuntimeError carrying CUDA's own message, e.g. "CUDA error: an illegal memory access
# was encountered" or "CUDA error: device-side assert triggered".
DEVICE_FAULT_MARKS = ("CUDA error", "illegal memory access", "device-side assert")


def is_device_fault(exc: BaseException) -> bool:
    """A non-OOM CUDA error that leaves the CUDA context unusable."""
    return (isinstance(exc, RuntimeError) and not isinstance(exc, torch.OutOfMemoryError)
            and any(mark in str(exc) for mark in DEVICE_FAULT_MARKS))


def draining_error() -> OverloadedError:
    """503 ``draining``: this replica is being replaced."""
    return OverloadedError("the model replica hit a device fault and is being replaced",
                           code=Reason.DRAINING.value, retry_after_s=1)


class DeviceHealth:
    """The replica's device state: OOMs, faults, the adapted budget.

    Args:
        engine: the loaded engine; its ``canary()`` runs after an OOM.
        probe: the device probe (its state in the first OOM's log).
        gate: the admission controller, whose capacity the policy adapts.
        policy: the admission policy (the budget policy shrinks and regrows).
        cost_model: the prices, corrected from observed OOM points.
        admission: the ``admission.*`` knobs (timeouts).
        metrics: the replica's metrics.

    Use from the replica's event loop, except :meth:`recover_after_oom` (the thread).
    """

    def __init__(self, engine: Engine, probe: DeviceProbe, gate: AdmissionController,
                 policy: AdmissionPolicy, cost_model: CorrectedCostModel,
                 admission: AdmissionConfig, metrics: ProcessMetrics) -> None:
        self._engine, self._probe, self._gate = engine, probe, gate
        self._policy, self._cost_model = policy, cost_model
        self._admission, self._metrics = admission, metrics
        self.oom_count = 0
        self.device_fault: str | None = None
        self._allocator_summary_logged = False

    def mark_device_fault(self, reason: str) -> None:
        """Stop admitting and fail health checks from now on (Ray Serve replaces the
        replica). The budget is left as it is."""
        if self.device_fault is None:
            logger.error("device fault, the replica will be replaced: %s", reason)
            self.device_fault = reason
            self._metrics.inc("device_faults")

    def check(self, running_since_s: float | None) -> None:
        """Raises RuntimeError after a device fault, or while a job (started at monotonic
        ``running_since_s``) has run longer than ``stuck_after_timeouts`` x
        ``inference_timeout_s``."""
        if self.device_fault is not None:
            raise RuntimeError(f"device fault: {self.device_fault}")
        adm = self._admission
        stuck_after_s = adm.stuck_after_timeouts * adm.inference_timeout_s
        if running_since_s is not None:
            running_s = time.monotonic() - running_since_s
            if running_s > stuck_after_s:
                raise RuntimeError(f"an inference has run for {running_s:.0f} s "
                                   f"(stuck after {stuck_after_s:g} s)")

    def regrow_budget(self) -> None:
        """The policy's regrowth step if one is due (called periodically)."""
        if (budget := self._policy.regrow()) is not None:
            self._gate.set_budget_bytes(budget, retry_after_s=1)
            self._metrics.inc("budget_regrowths")
            logger.info("budget regrown to %d bytes", budget)

    def after_failure(self, error: BaseException, leased_bytes: int,
                      oom_needed_bytes: int, canary_ok: bool | None) -> None:
        """A job failed with ``error``: learn from an OOM (before its leases go back) or mark
        a device fault."""
        if isinstance(error, torch.OutOfMemoryError):
            self._after_oom(leased_bytes, oom_needed_bytes, canary_ok)
        elif is_device_fault(error):
            self.mark_device_fault(str(error))

    def _after_oom(self, priced_bytes: int, needed_bytes: int, canary_ok: bool | None) -> None:
        self.oom_count += 1
        self._metrics.inc("ooms")
        if canary_ok is False:
            self.mark_device_fault("the canary inference after an out-of-memory error gave "
                                   "NaN/Inf output")
            return
        if self._cost_model.observe_oom(priced_bytes, needed_bytes):
            logger.warning("out of memory: a request priced %d bytes needed at least %d; "
                           "prices now x%.2f of the profile (profile again if this recurs)",
                           priced_bytes, needed_bytes, self._cost_model.factor)
        if (budget := self._policy.on_oom()) is not None:
            self._gate.set_budget_bytes(budget, self._gate.retry_after_s(priced_bytes))
            self._metrics.inc("budget_shrinks")
            logger.warning("out of memory: budget shrunk to %d bytes (%d OOMs so far)",
                           budget, self.oom_count)

    def recover_after_oom(self) -> bool | None:
        """On the thread, after an OOM: return cached blocks to the device
        (``torch.cuda.empty_cache``) and run the engine's canary. Returns ``True`` (finite
        output), ``False`` (NaN/Inf, or the canary failed otherwise) or ``None`` (the canary
        itself ran out of memory: inconclusive)."""
        if not self._allocator_summary_logged:  # once per replica: it is long
            self._allocator_summary_logged = True
            summary = (torch.cuda.memory_summary() if torch.cuda.is_available()
                       else f"{self._probe.device}: {self._probe.memory_snapshot()}")
            logger.warning("first out-of-memory error of this replica; allocator state:\n%s",
                           summary)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            return bool(self._engine.canary())
        except torch.OutOfMemoryError:
            logger.warning("the canary inference after an OOM ran out of memory too")
            return None
        except Exception:
            logger.exception("the canary inference after an OOM failed")
            return False

    def error_for(self, exc: BaseException, leased_bytes: int) -> BaseException:
        """What the caller of a failed job raises: 503 ``oom`` with ``Retry-After`` for an
        out-of-memory error, 503 ``draining`` for a device fault; other errors are bugs and
        pass through."""
        if isinstance(exc, torch.OutOfMemoryError):
            return OverloadedError("the device ran out of memory; retry later",
                                   code=Reason.OOM.value,
                                   retry_after_s=self._gate.retry_after_s(leased_bytes))
        if is_device_fault(exc):
            return draining_error()
        return exc

    def figures(self, running: int, total: int) -> DeviceFigures:
        """The device's part of the replica's state (the thread's job counts given)."""
        return DeviceFigures(inferences_running=running, inferences_total=total,
                             oom_count=self.oom_count, device_fault=self.device_fault,
                             cost_correction_factor=self._cost_model.factor,
                             cost_corrections=self._cost_model.corrections)
