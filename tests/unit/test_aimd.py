"""AIMD budget: multiplicative decrease on OOM, additive regrowth after quiet periods."""

from __future__ import annotations

import pytest

from serve_app.admission.aimd import AimdBudget


def test_each_oom_shrinks_by_the_factor_down_to_the_floor(clock) -> None:
    aimd = AimdBudget(1000, decrease_factor=0.5, floor_fraction=0.2, clock=clock)
    assert [aimd.on_oom() for _ in range(4)] == [500, 250, 200, 200]
    assert aimd.shrink_count == 4 and aimd.current_bytes == 200


def test_regrowth_is_one_step_per_quiet_period_up_to_the_measured_budget(clock) -> None:
    aimd = AimdBudget(1000, decrease_factor=0.5, increase_fraction=0.1, quiet_s=10,
                      clock=clock)
    aimd.on_oom()
    clock.advance(9.9)
    assert aimd.regrow() is None
    clock.advance(0.1)
    assert aimd.regrow() == 600
    clock.advance(25)  # two more full periods (and half of a third)
    assert aimd.regrow() == 800
    clock.advance(100)
    assert aimd.regrow() == 1000
    assert aimd.regrow() is None and aimd.regrow_count == 5


def test_an_oom_restarts_the_quiet_period(clock) -> None:
    aimd = AimdBudget(1000, decrease_factor=0.5, quiet_s=10, clock=clock)
    aimd.on_oom()
    clock.advance(8)
    aimd.on_oom()
    clock.advance(8)
    assert aimd.regrow() is None and aimd.current_bytes == 250


def test_a_bad_factor_is_refused() -> None:
    with pytest.raises(ValueError, match="decrease_factor"):
        AimdBudget(1000, decrease_factor=1.0)
