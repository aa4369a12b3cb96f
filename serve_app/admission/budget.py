"""A replica's byte budget and the leases taken from it.

Pure: no Ray, torch or FastAPI. Nothing here blocks; waiting is the queue's job
(:mod:`serve_app.admission.queue`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from serve_app.admission.fair import DEFAULT_TENANT


@dataclass(eq=False)
class Lease:
    """``nbytes`` of a :class:`MemoryBudget`, held by one request until :meth:`release`.

    Releasing is idempotent: the bytes return to the budget exactly once, however many times
    ``release`` is called (``finally`` blocks on several paths may all call it).
    """

    lease_id: int
    nbytes: int
    _budget: MemoryBudget = field(repr=False)
    released: bool = False
    tenant: str = DEFAULT_TENANT

    def release(self) -> bool:
        """Return the bytes to the budget. Returns ``True`` the first time, ``False`` after."""
        if self.released:
            return False
        self.released = True
        self._budget._give_back(self)
        return True


class MemoryBudget:
    """Bytes of device memory that admitted requests may hold at once.

    Args:
        budget_bytes: the replica's budget, ``(capacity share - held - reserve) * safety``
            (see :func:`serve_app.memory.budget.derive_budget_bytes`). Must be > 0.

    Invariant: ``0 <= reserved_bytes``, and ``reserved_bytes <= budget_bytes`` whenever the
    budget has not been shrunk below what is already leased (:meth:`set_budget_bytes`).
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self._budget_bytes = int(budget_bytes)
        self._reserved_bytes = 0
        self._ids = itertools.count(1)
        self.active_leases = 0
        self.charged_bytes_total = 0
        self.released_bytes_total = 0
        self.peak_reserved_bytes = 0
        # Told True when the first lease is taken and False when the last goes back: when the
        # replica works (the drain rate's busy time, serve_app.admission.drain).
        self.on_busy: Callable[[bool], None] | None = None
        # Told each lease as it is taken (True) and given back (False): the tenants' service
        # (serve_app.admission.fair).
        self.on_lease: Callable[[Lease, bool], None] | None = None

    @property
    def budget_bytes(self) -> int:
        return self._budget_bytes

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes that may still be leased now (0 if the budget was shrunk below the leases)."""
        return max(0, self._budget_bytes - self._reserved_bytes)

    def fits_ever(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` could run on an idle replica."""
        return nbytes <= self._budget_bytes

    def try_reserve(self, nbytes: int, tenant: str = DEFAULT_TENANT) -> Lease | None:
        """Lease ``nbytes`` to ``tenant`` if they fit now, else return ``None``. Never blocks.

        Raises:
            ValueError: ``nbytes`` is negative or not a whole number.
        """
        if nbytes < 0 or nbytes != int(nbytes):
            raise ValueError(f"nbytes must be a whole number >= 0, got {nbytes}")
        nbytes = int(nbytes)
        # Not ``nbytes > free_bytes``: free_bytes is clamped at 0, which would let a 0-byte
        # lease in while the leases exceed a shrunk budget.
        if self._reserved_bytes + nbytes > self._budget_bytes:
            return None
        self._reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self._reserved_bytes)
        self.active_leases += 1
        self.charged_bytes_total += nbytes
        if self.active_leases == 1 and self.on_busy is not None:
            self.on_busy(True)
        lease = Lease(next(self._ids), nbytes, self, tenant=tenant)
        if self.on_lease is not None:
            self.on_lease(lease, True)
        return lease

    def set_budget_bytes(self, budget_bytes: int) -> None:
        """Change the budget (e.g. after an OOM). Existing leases are kept; if they now exceed
        the budget, nothing more is admitted until enough of them are released."""
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self._budget_bytes = int(budget_bytes)

    def _give_back(self, lease: Lease) -> None:
        self._reserved_bytes -= lease.nbytes
        self.active_leases -= 1
        self.released_bytes_total += lease.nbytes
        if self.on_lease is not None:
            self.on_lease(lease, False)
        if self.active_leases == 0 and self.on_busy is not None:
            self.on_busy(False)
