"""Priority classes of the admission queue, and the waiters of one class by tenant.

Two classes (``auth.tenants[].priority``, ``Prefer: priority=...``): ``interactive`` (the
default) and ``batch``. A class is admitted only while no class before it has anyone waiting
(:data:`PRIORITIES` gives the order), so a batch request starts only in room interactive
traffic leaves; within a class, tenants share by byte-seconds (:mod:`serve_app.admission.fair`)
and each tenant's waiters are FIFO. Batch requests are predicted, positioned and so refused
behind every interactive waiter: under overload they are refused or left waiting first.

Pure: no Ray, torch or FastAPI.
"""

from __future__ import annotations

from enum import StrEnum


class Priority(StrEnum):
    """A request's priority class."""

    INTERACTIVE = "interactive"
    """Answered at once; admitted before any batch request."""
    BATCH = "batch"
    """Fills the room interactive traffic leaves (durable jobs run so by default)."""


PRIORITIES: tuple[Priority, ...] = (Priority.INTERACTIVE, Priority.BATCH)
"""The classes in admission order."""
