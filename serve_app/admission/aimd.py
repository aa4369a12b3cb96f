"""The budget after an out-of-memory error: shrink multiplicatively, regrow additively (AIMD).

An OOM means the cost model under-priced something (fragmentation, another process on the
card, an input the profile did not cover). Halving-style decrease reacts at once; additive
increase after a quiet period probes back towards the measured budget, the scheme TCP uses for
congestion windows (Chiu and Jain 1989, "Analysis of the increase and decrease algorithms for
congestion avoidance in computer networks"). Pure: clock injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field


@dataclass
class AimdBudget:
    """The current budget of a replica whose measured budget is ``measured_bytes``.

    Args:
        measured_bytes: the budget derived at start-up; never exceeded.
        decrease_factor: budget multiplier on each OOM, in (0, 1).
        increase_fraction: share of ``measured_bytes`` regained per quiet period.
        quiet_s: seconds without an OOM before each regrowth step.
        floor_fraction: the budget never drops below this share of ``measured_bytes``.
        clock: monotonic seconds.
    """

    measured_bytes: int
    _: KW_ONLY
    decrease_factor: float = 0.7
    increase_fraction: float = 0.1
    quiet_s: float = 10.0
    floor_fraction: float = 0.25
    clock: Callable[[], float] = time.monotonic
    current_bytes: int = field(init=False)
    shrink_count: int = field(default=0, init=False)
    regrow_count: int = field(default=0, init=False)
    _last_change_at: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.decrease_factor < 1:
            raise ValueError(f"decrease_factor must be in (0, 1), got {self.decrease_factor}")
        self.current_bytes = self.measured_bytes
        self._last_change_at = self.clock()

    @property
    def floor_bytes(self) -> int:
        return max(1, int(self.measured_bytes * self.floor_fraction))

    def on_oom(self) -> int:
        """Shrink after an OOM; returns the new budget."""
        self.current_bytes = max(self.floor_bytes,
                                 int(self.current_bytes * self.decrease_factor))
        self.shrink_count += 1
        self._last_change_at = self.clock()
        return self.current_bytes

    def regrow(self) -> int | None:
        """One additive step per full quiet period since the last change; the new budget, or
        ``None`` if nothing changed."""
        if self.current_bytes >= self.measured_bytes:
            return None
        steps = int((self.clock() - self._last_change_at) // self.quiet_s)
        if steps <= 0:
            return None
        step_bytes = max(1, int(self.measured_bytes * self.increase_fraction))
        needed = -(-(self.measured_bytes - self.current_bytes) // step_bytes)
        self.current_bytes = min(self.measured_bytes, self.current_bytes + steps * step_bytes)
        self.regrow_count += min(steps, needed)
        self._last_change_at += steps * self.quiet_s
        return self.current_bytes

