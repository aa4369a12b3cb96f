"""How far predicted waits have been off, and the margin that makes refusals by prediction
rarely wrong the costly way.

A request refused at once by prediction costs its client nothing but a retry; a request
admitted on a prediction that was too short may wait its whole limit and be refused then, the
wait in vain that prediction exists to prevent. So predictions are corrected by the errors of
the recent ones: a request is refused when its predicted wait plus the ``quantile`` of the
recent errors (waited minus predicted, seconds, of admitted requests) exceeds the time it has.
With the default 0.99, about one admitted request in a hundred waits longer than its
corrected prediction. The errors come from the replica's own admitted requests, so the margin
follows the load (it is 0 until ``MIN_ERRORS`` were seen).

Each configured tenant keeps its own errors, per priority class (:class:`TenantCalibrations`):
a tenant's predictions are off in its own way. A light tenant's fluid share
(:meth:`serve_app.admission.fair.FairShare.share_ahead`) counts only what the other tenants
have queued *now*, not what a heavier tenant sends meanwhile, so its waits may run long while
a backlogged tenant's are close; a priority class waits behind whatever arrives in the classes
before it. One margin for all would let one tenant's misses refuse every tenant by prediction
(measured: under two tenants' overload both queues emptied together every ~15 s). Pure: no
Ray, torch or FastAPI.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from serve_app.admission.fair import DEFAULT_TENANT
from serve_app.admission.priority import PRIORITIES, Priority

MIN_ERRORS = 20
"""Errors needed before a margin is trusted (fewer: no margin)."""


class WaitCalibration:
    """The last ``window`` prediction errors and their ``quantile``.

    Args:
        window: errors kept (the most recent).
        quantile: in (0, 1]; the margin is this quantile of the errors kept, at least 0.
    """

    def __init__(self, window: int = 200, quantile: float = 0.99) -> None:
        if window < 1 or not 0 < quantile <= 1:
            raise ValueError(f"need window >= 1 and 0 < quantile <= 1, got {window}, "
                             f"{quantile}")
        self._errors: deque[float] = deque(maxlen=window)
        self._quantile = quantile

    def __len__(self) -> int:
        """Errors kept."""
        return len(self._errors)

    def record(self, error_s: float) -> None:
        """An admitted request waited ``error_s`` longer (< 0: shorter) than predicted."""
        self._errors.append(error_s)

    def margin_s(self) -> float:
        """Seconds added to predictions: the ``quantile`` of the recent errors (nearest
        rank), 0 when negative or before ``MIN_ERRORS`` errors."""
        if len(self._errors) < MIN_ERRORS:
            return 0.0
        ordered = sorted(self._errors)
        return max(0.0, ordered[math.ceil(self._quantile * len(ordered)) - 1])


class TenantCalibrations:
    """A :class:`WaitCalibration` per configured tenant and priority class, and one shared.

    A tenant's errors correct only its own predictions in their class; every error also goes
    to the shared one, whose margin a tenant and class with fewer than ``MIN_ERRORS`` errors
    of its own use (and every tenant not configured, so clients cannot grow the set).

    Args:
        tenants: the configured tenant names (``auth.tenants``); the default tenant is
            always one.
        window, quantile: of each :class:`WaitCalibration`.
    """

    def __init__(self, tenants: Iterable[str] = (), window: int = 200,
                 quantile: float = 0.99) -> None:
        self.shared = WaitCalibration(window, quantile)
        self._own = {(tenant, priority): WaitCalibration(window, quantile)
                     for tenant in {*tenants, DEFAULT_TENANT} for priority in PRIORITIES}

    def record(self, error_s: float, tenant: str = DEFAULT_TENANT,
               priority: Priority = Priority.INTERACTIVE) -> None:
        """A request of ``tenant`` and ``priority`` admitted (or timed out) ``error_s``
        seconds later (< 0: sooner) than predicted."""
        self.shared.record(error_s)
        own = self._own.get((tenant, priority))
        if own is not None:
            own.record(error_s)

    def margin_s(self, tenant: str = DEFAULT_TENANT,
                 priority: Priority = Priority.INTERACTIVE) -> float:
        """Seconds added to the predictions of ``tenant`` in ``priority``: its own errors'
        margin once it has ``MIN_ERRORS``, else the shared one."""
        own = self._own.get((tenant, priority))
        return own.margin_s() if own is not None and len(own) >= MIN_ERRORS \
            else self.shared.margin_s()
