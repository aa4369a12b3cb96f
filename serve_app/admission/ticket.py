"""Who holds an admitted request's lease, and when it goes back.

Two parties may hold a lease: the request's caller (from admission until it leaves, however
it leaves) and the device (from the moment a forward pass takes the request up until the
inference thread is done with that pass, which may be long after the caller left: a timeout
gives up on the *await*, not on the thread). The lease goes back when the last holder lets go:

- the device claimed it (:meth:`Ticket.claim`): when the device is done
  (:meth:`Ticket.device_done`, after what the device's completion itself does, e.g. shrink the
  budget after an OOM), whether or not the caller is still there: the memory is free then, and
  the next requests can be admitted into the very next pass;
- it never did: when the caller leaves (:meth:`Ticket.caller_done`, from the one ``finally``
  of :class:`deployments.replica.lifecycle.RequestLifecycle`).

Either way the one release function runs exactly once, never while a kernel may still use the
bytes. Pure: no Ray, torch, FastAPI or asyncio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from serve_app.admission.budget import Lease
from serve_app.admission.controller import Admission
from serve_app.request import InferenceRequest


@dataclass(eq=False)
class Ticket:
    """One admitted request and the lease it holds. What happens to it is told through its
    methods (the device claims it, waited, took it up, is done; the caller is done); its
    figures are read-only.

    Attributes:
        request: the request.
        admission: its lease, queue wait and position.
        release: gives the lease back: ``release(ticket, ran=...)`` (``ran``: the device used
            it); called exactly once.
    """

    request: InferenceRequest
    admission: Admission
    release: Callable[..., None] = field(repr=False)
    _waited_s: float = field(default=0.0, init=False)
    _handed_to_thread: bool = field(default=False, init=False)
    _batch: int = field(default=1, init=False)
    _ran: bool = field(default=False, init=False)
    _claimed: bool = field(default=False, init=False, repr=False)
    _released: bool = field(default=False, init=False, repr=False)

    @property
    def lease(self) -> Lease:
        return self.admission.lease

    @property
    def waited_s(self) -> float:
        """Queue wait after the lease (for a pass, then for the thread), seconds."""
        return self._waited_s

    @property
    def queue_wait_s(self) -> float:
        """Every second waited so far: for the lease, then for a pass and the thread."""
        return self.admission.queue_wait_s + self._waited_s

    @property
    def handed_to_thread(self) -> bool:
        """The inference thread was given work using this lease."""
        return self._handed_to_thread

    @property
    def batch(self) -> int:
        """Requests in the pass it ran in (1: alone)."""
        return self._batch

    @property
    def ran(self) -> bool:
        """The device ran that work (known once the device is done)."""
        return self._ran

    @property
    def released(self) -> bool:
        """The lease went back: the device must not take this request up any more."""
        return self._released

    def add_wait(self, seconds: float) -> None:
        """It waited ``seconds`` more after its lease (for a pass, then for the thread):
        queue wait too."""
        self._waited_s += seconds

    def mark_handed_to_thread(self, batch: int) -> None:
        """The inference thread was given work using this lease: a pass (or a decode step)
        of ``batch`` requests."""
        self._handed_to_thread, self._batch = True, batch

    def claim(self) -> None:
        """The device holds the lease from now until :meth:`device_done` (a pass took the
        request up). Idempotent."""
        self._claimed = True

    def device_done(self, ran: bool) -> None:
        """The device is done with the lease (``ran``: it really used it): give it back if
        the device held it. Idempotent."""
        self._ran = self._ran or ran
        if self._claimed:
            self._give_back()

    def caller_done(self) -> None:
        """The caller leaves: give the lease back if the device never held it."""
        if not self._claimed:
            self._give_back()

    def _give_back(self) -> None:
        if not self._released:
            self._released = True
            self.release(self, ran=self._ran)
