"""How far predicted waits have been off, and the margin that makes refusals by prediction
rarely wrong the costly way.

A request refused at once by prediction costs its client nothing but a retry; a request
admitted on a prediction that was too short may wait its whole limit and be refused then, the
wait in vain that prediction exists to prevent. So predictions are corrected by the errors of
the recent ones: a request is refused when its predicted wait plus the ``quantile`` of the
recent errors (waited minus predicted, seconds, of admitted requests) exceeds the time it has.
With the default 0.99, about one admitted request in a hundred waits longer than its
corrected prediction. The errors come from the replica's own admitted requests, so the margin
follows the load (it is 0 until ``MIN_ERRORS`` were seen). Pure: no Ray, torch or FastAPI.
"""

from __future__ import annotations

import math
from collections import deque

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
