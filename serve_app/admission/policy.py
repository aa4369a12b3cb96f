"""The three admission policies, expressed as units charged against one controller.

* ``budget`` (the product): capacity = the replica's byte budget; a request costs its
  estimated bytes.
* ``semaphore`` (the article's baseline): capacity = ``semaphore_permits``; every request
  costs 1, whatever its size.
* ``none`` (benchmarks and fault demos): nothing is ever refused or queued.

Using one controller for all three keeps queueing, timeouts, ``Retry-After`` and accounting
identical, so benchmarks compare the policies and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

UNLIMITED_UNITS = 1 << 62


@dataclass(frozen=True)
class AdmissionPolicy:
    """How requests are charged.

    Attributes:
        name: ``budget``, ``semaphore`` or ``none``.
        capacity_units: the controller's capacity in this policy's units.
    """

    name: str
    capacity_units: int

    @classmethod
    def create(cls, name: str, budget_bytes: int, semaphore_permits: int) -> AdmissionPolicy:
        """Raises ValueError for an unknown policy name."""
        capacity = {"budget": budget_bytes, "semaphore": semaphore_permits,
                    "none": UNLIMITED_UNITS}
        if name not in capacity:
            raise ValueError(f"unknown admission policy {name!r}; use one of {sorted(capacity)}")
        return cls(name, capacity[name])

    def units(self, request_bytes: int) -> int:
        """What a request of ``request_bytes`` estimated bytes is charged."""
        if self.name == "budget":
            return request_bytes
        return 1 if self.name == "semaphore" else 0
