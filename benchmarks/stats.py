"""Order statistics the benchmarks print."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th quantile (0 < q <= 1) of ``values`` by nearest rank: the smallest value
    with at least ``q`` of them at or below it, the ``ceil(q x n)``-th in ascending order
    (the nearest-rank method: Wikipedia, "Percentile"). Of 65 values the 99th percentile is
    the largest; of 200, the third largest. NaN when there are none.

    Raises:
        ValueError: ``q`` outside (0, 1].
    """
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1], got {q}")
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    # q x n rounded first: 0.07 x 100 is 7.000000000000001 in floats, whose ceiling would
    # take the 8th value where nearest rank is the 7th.
    return ordered[max(1, math.ceil(round(q * len(ordered), 9))) - 1]
