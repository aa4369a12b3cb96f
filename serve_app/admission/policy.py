"""The admission policies, each charging requests in its own units against one controller.

* ``budget`` (the product): capacity = the replica's byte budget; a request costs its
  estimated bytes. It owns the budget's AIMD (:mod:`serve_app.admission.aimd`): an OOM
  shrinks the capacity, quiet periods regrow it.
* ``semaphore`` (the article's baseline): capacity = ``semaphore_permits``; every request
  costs 1, whatever its size.
* ``none`` (benchmarks and fault demos): nothing is ever refused or queued.

Using one controller for all three keeps queueing, timeouts, ``Retry-After`` and accounting
identical, so benchmarks compare the policies and nothing else. :func:`make_policy` is the
one place a policy is chosen by name (:data:`POLICIES`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from serve_app.admission.aimd import AimdBudget
from serve_app.config import AdmissionConfig

UNLIMITED_UNITS = 1 << 62


class AdmissionPolicy:
    """How requests are charged (see module docstring).

    Args:
        admission: the ``admission.*`` knobs.
        budget_bytes: the replica's measured byte budget.
        clock: monotonic seconds (the budget policy's quiet periods).

    Class attributes:
        name: the ``admission.policy`` value.
        gate_units: what the gate's figures count (``bytes``, ``requests``, ``none``).
        budget_must_hold_largest: whether a replica whose budget cannot hold the largest
            request the limits allow must refuse to start.
    """

    name: ClassVar[str]
    gate_units: ClassVar[str]
    budget_must_hold_largest: ClassVar[bool] = False

    def __init__(self, admission: AdmissionConfig, budget_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.admission = admission
        self.measured_budget_bytes = budget_bytes

    @property
    def capacity_units(self) -> int:
        """The controller's capacity now, in this policy's units."""
        raise NotImplementedError

    @classmethod
    def units(cls, request_bytes: int) -> int:
        """What a request of ``request_bytes`` estimated bytes is charged (a class method:
        the ingress prices with the policy's class, the replica with its instance)."""
        raise NotImplementedError

    @property
    def budget_bytes(self) -> int:
        """The byte budget now (the measured one unless this policy adapts it)."""
        return self.measured_budget_bytes

    def on_oom(self) -> int | None:
        """An OOM was caught: the controller's new capacity, or ``None`` to keep it."""
        return None

    def regrow(self) -> int | None:
        """Called periodically: the controller's new capacity, or ``None`` to keep it."""
        return None

    @property
    def shrink_count(self) -> int:
        return 0

    @property
    def regrow_count(self) -> int:
        return 0

    @classmethod
    def running_estimate(cls, admission: AdmissionConfig,
                         by_memory: int) -> tuple[int, str | None]:
        """Requests a replica runs at once under this policy, given that its budget holds
        ``by_memory`` P95 requests; and what set it, when not the memory (for planning)."""
        return by_memory, None

    @classmethod
    def admitted_estimate(cls, admission: AdmissionConfig, running: int,
                          smallest_by_memory: int | None) -> tuple[int, str]:
        """Requests a replica may hold admitted at once (leased, running or waiting for
        its pass), for Ray Serve's ``max_ongoing_requests``; ``running``: the
        :meth:`running_estimate`; ``smallest_by_memory``: how many of the smallest request
        its budget holds (``None``: unknown). By default the ``running`` estimate: the
        semaphore's permits, or, without a gate (Ray's cap the only one), P95 requests."""
        return running, "running at once"


class BudgetPolicy(AdmissionPolicy):
    """Leases measured bytes, the budget adapted after OOMs (AIMD)."""

    name = "budget"
    gate_units = "bytes"
    budget_must_hold_largest = True

    @classmethod
    def admitted_estimate(cls, admission: AdmissionConfig, running: int,
                          smallest_by_memory: int | None) -> tuple[int, str]:
        # The budget admits small requests many at a time (a P95 count would cap a replica
        # running short embeddings at a few): Ray's cap must not bind before the budget,
        # or requests wait in Ray Serve's handle queue, unseen by the replica's FIFO (its
        # position, prediction and refusal at once). Steady fake-card load test: with the
        # P95 count (max_ongoing_requests 68) refusals by prediction had a p99 of 3.7 s,
        # spent waiting for a slot; with this count (capped: 1024), 0.56 s.
        if smallest_by_memory is None:
            return running, "running at once"
        return max(running, smallest_by_memory), "budget // smallest request"

    def __init__(self, admission: AdmissionConfig, budget_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(admission, budget_bytes, clock)
        self.aimd = AimdBudget(budget_bytes, decrease_factor=admission.oom_decrease_factor,
                               increase_fraction=admission.oom_regrow_fraction,
                               quiet_s=admission.oom_quiet_s,
                               floor_fraction=admission.oom_floor_fraction, clock=clock)

    @property
    def capacity_units(self) -> int:
        return self.aimd.current_bytes

    @classmethod
    def units(cls, request_bytes: int) -> int:
        return request_bytes

    @property
    def budget_bytes(self) -> int:
        return self.aimd.current_bytes

    def on_oom(self) -> int | None:
        return self.aimd.on_oom()

    def regrow(self) -> int | None:
        return self.aimd.regrow()

    @property
    def shrink_count(self) -> int:
        return self.aimd.shrink_count

    @property
    def regrow_count(self) -> int:
        return self.aimd.regrow_count


class SemaphorePolicy(AdmissionPolicy):
    """``admission.semaphore_permits`` requests at once, whatever their size."""

    name = "semaphore"
    gate_units = "requests"

    @property
    def capacity_units(self) -> int:
        return self.admission.semaphore_permits

    @classmethod
    def units(cls, request_bytes: int) -> int:
        return 1

    @classmethod
    def running_estimate(cls, admission: AdmissionConfig,
                         by_memory: int) -> tuple[int, str | None]:
        return admission.semaphore_permits, "admission.semaphore_permits"


class NoGatePolicy(AdmissionPolicy):
    """Admits everything at once (benchmarks and fault demos)."""

    name = "none"
    gate_units = "none"

    @property
    def capacity_units(self) -> int:
        return UNLIMITED_UNITS

    @classmethod
    def units(cls, request_bytes: int) -> int:
        return 0


POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (BudgetPolicy, SemaphorePolicy, NoGatePolicy)}
"""Every admission policy, by its ``admission.policy`` name."""


def policy_class(name: str) -> type[AdmissionPolicy]:
    """The policy named ``name``.

    Raises:
        ValueError: an unknown policy name.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown admission policy {name!r}; use one of {sorted(POLICIES)}")
    return POLICIES[name]


def make_policy(admission: AdmissionConfig, budget_bytes: int,
                clock: Callable[[], float] = time.monotonic) -> AdmissionPolicy:
    """The policy ``admission.policy`` names, for a replica of ``budget_bytes``.

    Raises:
        ValueError: an unknown policy name.
    """
    return policy_class(admission.policy)(admission, budget_bytes, clock)
