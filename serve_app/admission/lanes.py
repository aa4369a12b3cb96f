"""The waiters of one priority class of the admission queue (:mod:`.priority`), by tenant:
one FIFO per tenant (:mod:`.fair` chooses among the tenants). Pure: no Ray, torch or FastAPI.
"""

from __future__ import annotations

from collections import OrderedDict

from serve_app.admission.decision import Waiter


class TenantLanes:
    """The waiters of one priority class: one FIFO per tenant, tenants listed by when they
    became backlogged (so ties in the fair order go to the earliest)."""

    def __init__(self) -> None:
        self.lanes: dict[str, OrderedDict[int, Waiter]] = {}
        self.bytes: dict[str, int] = {}
        self.count = 0
        self.total_bytes = 0

    def __bool__(self) -> bool:
        return self.count > 0

    def add(self, waiter: Waiter) -> None:
        """``waiter`` at the tail of its tenant's FIFO."""
        tenant = waiter.tenant
        self.lanes.setdefault(tenant, OrderedDict())[waiter.waiter_id] = waiter
        self.bytes[tenant] = self.bytes.get(tenant, 0) + waiter.nbytes
        self.count += 1
        self.total_bytes += waiter.nbytes

    def remove(self, waiter: Waiter) -> None:
        """``waiter`` out of its tenant's FIFO.

        Raises:
            KeyError: it is not in this class.
        """
        lane = self.lanes[waiter.tenant]
        del lane[waiter.waiter_id]
        self.bytes[waiter.tenant] -= waiter.nbytes
        self.count -= 1
        self.total_bytes -= waiter.nbytes
        if not lane:
            del self.lanes[waiter.tenant], self.bytes[waiter.tenant]

    def head(self, tenant: str) -> Waiter:
        """The first waiter of ``tenant`` (backlogged in this class)."""
        return next(iter(self.lanes[tenant].values()))

    def sizes_of_others(self, tenant: str) -> dict[str, list[int]]:
        """Every other tenant's waiters' bytes, in their order."""
        return {other: [w.nbytes for w in lane.values()]
                for other, lane in self.lanes.items() if other != tenant}
