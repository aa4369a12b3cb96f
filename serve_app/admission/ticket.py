"""Who holds an admitted request's lease, and when it goes back.

Two parties may use a lease: the request's caller (from admission until it leaves, however it
leaves) and the device (from the moment a forward pass takes the request up until the
inference thread is done with that pass, which may be long after the caller left: a timeout
gives up on the *await*, not on the thread). A :class:`Ticket` records the device's claim;
the caller's one ``finally`` calls :meth:`Ticket.release_when_free`, which returns the lease
at once if the device never claimed it, else when the device is done. The bytes therefore go
back exactly once, never while a kernel may still use them.

Pure: asyncio only (no Ray, torch or FastAPI).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from serve_app.admission.budget import Lease
from serve_app.admission.controller import Admission
from serve_app.request import InferenceRequest

#: Gives a lease back; ``ran``: whether the device used it (see
#: :meth:`serve_app.admission.controller.AdmissionController.release`).
Release = Callable[..., None]


@dataclass(eq=False)
class Ticket:
    """One admitted request and the lease it holds.

    Attributes:
        request: the request.
        admission: its lease, queue wait and position.
        waited_s: queue wait after the lease (for a pass, then for the thread), seconds.
        handed_to_thread: the inference thread was given work using this lease.
        batch: requests in the pass it ran in (1: alone).
        ran: the device ran that work (known once the device is done).
    """

    request: InferenceRequest
    admission: Admission
    waited_s: float = 0.0
    handed_to_thread: bool = False
    batch: int = 1
    ran: bool = False
    _device: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def lease(self) -> Lease:
        return self.admission.lease

    @property
    def queue_wait_s(self) -> float:
        """Every second waited so far: for the lease, then for a pass and the thread."""
        return self.admission.queue_wait_s + self.waited_s

    def claim(self) -> None:
        """The device may use the lease from now until :meth:`device_done` (a pass took the
        request up). Idempotent. Call on the event loop."""
        if self._device is None:
            self._device = asyncio.get_running_loop().create_future()

    def device_done(self, ran: bool) -> None:
        """The device is done with the lease (``ran``: it really used it). Idempotent."""
        self.ran = self.ran or ran
        self.claim()
        assert self._device is not None
        if not self._device.done():
            self._device.set_result(None)

    def release_when_free(self, release: Release) -> None:
        """The caller is done: give the lease back through ``release(lease, ran=...)`` now if
        the device never claimed it, else once the device is done (after everything the
        device's completion itself does, e.g. shrinking the budget after an OOM)."""
        if self._device is None:
            release(self.lease, ran=False)
            return
        self._device.add_done_callback(lambda _: release(self.lease, ran=self.ran))
