"""The benchmarks' percentile is the nearest rank: the p99 of 65 waits is the slowest one,
of 120 the second slowest (what the tenants report's noisy-neighbour runs rely on)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.stats import percentile


def test_nearest_rank_of_known_counts() -> None:
    assert percentile(range(1, 66), 0.99) == 65
    assert percentile(range(1, 121), 0.99) == 119
    assert percentile(range(1, 201), 0.99) == 198
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([5.0, 1.0], 1.0) == 5.0
    assert percentile(range(1, 101), 0.07) == 7  # 0.07 x 100 is 7.000000000000001 in floats
    assert percentile(range(1, 101), 0.001) == 1
    assert math.isnan(percentile([], 0.99))


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5])
def test_a_quantile_outside_0_1_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], q)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1),
       st.floats(min_value=0.01, max_value=1.0))
def test_at_least_q_of_the_values_are_at_or_below_it(values: list[float], q: float) -> None:
    p = percentile(values, q)
    assert p in values
    assert sum(v <= p for v in values) >= q * len(values)
    assert sum(v < p for v in values) < q * len(values)  # and it is the smallest such
