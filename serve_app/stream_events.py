"""The items of a streamed request, from the model replica to the ingress.

A replica's stream (:meth:`deployments.replica.lifecycle.RequestLifecycle.infer_stream`, through
``ModelServer.infer_stream`` and Ray Serve's handle, pickled) is: :class:`Queued` items while
the request waits, then one :class:`~serve_app.schemas.Admitted` once it holds its lease,
then a :class:`TextPiece` per piece of text, then one :class:`Finished`. Its first item is
always :class:`Queued` or :class:`Admitted`, so that the ingress hears admission before it
sends any byte. A refusal or failure on the replica ends the stream with a
:class:`StreamError`, which the ingress raises again (:mod:`deployments.http.model_client`).

The ingress turns them into server-sent events in one place,
:func:`deployments.http.routes.generation.render`. Plain frozen values: no Ray, FastAPI or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.errors import ServeAppError
from serve_app.schemas import Admitted


@dataclass(frozen=True)
class Queued:
    """The request waits: ``position`` requests are ahead of it; ``eta_ms``, its predicted
    wait left (milliseconds), is ``None`` while no drain rate is measured, and while a
    completion waits to join the running batch."""

    position: int
    eta_ms: int | None

    def headers(self) -> dict[str, str]:
        """The ``X-Queue-Position`` response header of a stream that starts queued."""
        return {"X-Queue-Position": str(self.position)}


@dataclass(frozen=True)
class TextPiece:
    """A piece of the generated text, as the engine made it."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The last item of a whole stream: why generation stopped (``stop``, ``length``, ...)
    and the usage, in tokens."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class StreamError:
    """The typed error that ended the stream on the replica (a refusal, before or after the
    first item, or a failure): returned as an item, not raised, so that Ray Serve does not
    log a refusal as a failed request."""

    error: ServeAppError


AdmissionEvent = Queued | Admitted
"""What a stream's first item is."""

StreamEvent = Queued | Admitted | TextPiece | Finished | StreamError
"""Any item of a stream."""

__all__ = ["AdmissionEvent", "Admitted", "Finished", "Queued", "StreamError", "StreamEvent",
           "TextPiece"]
