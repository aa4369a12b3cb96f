"""How a load-test response is classified. Pure: no locust, no HTTP client.

The classes are mutually exclusive and follow the README's error table (HTTP API):

========== =====================================================================================
``ok``      any 2xx
``refused`` 503 with a valid ``Retry-After`` (whole seconds >= 1) and an error code other than
            ``oom``: the gate said "not now" (``queue_full``, ``queue_timeout``, ...). Not a
            failure: a client is told when to come back.
``oom``     503 with code ``oom``: the device ran out of memory on this request (or the
            budget, shrunk after one, cannot hold it now). Counted apart from refusals although
            it carries ``Retry-After`` too: it is what the gate exists to prevent. A failure.
``5xx``     any other 5xx: 500, 502, 504, or a 503 *without* a valid ``Retry-After`` (a
            contract violation). A failure.
``4xx``     any 4xx (the load test sends only valid requests, so each one is a bug). A failure.
``error``   no HTTP response (connection refused or reset, unexpected client timeout).
            A failure.
``aborted`` the client gave up on purpose before the answer came (the aborting users). Not a
            failure: the server's job is only to release what the request held.
========== =====================================================================================

A streamed answer (``stream: true``, server-sent events) is a 200 from its first byte on: an
error after it comes in-band, as a last ``data: {"error": ...}`` event before ``data:
[DONE]`` (README, HTTP API; ``deployments/http/routes/generation.py``). It is ``ok`` only when
read to
its end, it ends with ``data: [DONE]``, no event carries an error and one carried the
``finish_reason`` (:func:`stream_problem`); otherwise ``oom`` for an in-band ``oom``, ``5xx``
for anything else (:func:`stream_outcome`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum


class Outcome(StrEnum):
    OK = "ok"
    REFUSED = "refused"
    OOM = "oom"
    SERVER_ERROR = "5xx"
    CLIENT_ERROR = "4xx"
    ERROR = "error"
    ABORTED = "aborted"

    @property
    def is_failure(self) -> bool:
        """Whether locust counts it as a failure (``refused``, ``ok`` and ``aborted`` are not)."""
        return self not in (Outcome.OK, Outcome.REFUSED, Outcome.ABORTED)


def retry_after_s(headers: Mapping[str, str]) -> int | None:
    """The ``Retry-After`` header as whole seconds >= 1, or ``None`` when it is missing or not
    such a number (an HTTP date is valid HTTP but not what the README promises). Header names
    are matched case-insensitively."""
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if value is None or not value.strip().isdigit():
        return None
    seconds = int(value.strip())
    return seconds if seconds >= 1 else None


def error_code(body: bytes | str | None) -> str | None:
    """``error.code`` of an OpenAI-shaped error body, or ``None`` if the body is not one."""
    if not body:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, TypeError):
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def classify(status: int | None, headers: Mapping[str, str], code: str | None,
             aborted: bool = False) -> Outcome:
    """The outcome of one request (see the module docstring).

    Args:
        status: the HTTP status, or ``None``/``0`` when no response came.
        headers: the response headers (any case).
        code: ``error.code`` of the body (:func:`error_code`), if any.
        aborted: the client cancelled the request on purpose before the response came.
    """
    if not status:
        return Outcome.ABORTED if aborted else Outcome.ERROR
    if 200 <= status < 300:
        return Outcome.OK
    if status == 503 and retry_after_s(headers) is not None:
        return Outcome.OOM if code == "oom" else Outcome.REFUSED
    if status >= 500:
        return Outcome.SERVER_ERROR
    if 400 <= status < 500:
        return Outcome.CLIENT_ERROR
    return Outcome.ERROR  # 1xx/3xx: never expected here


DONE = "[DONE]"  # the data of a stream's last event (OpenAI's)


def sse_data(body: bytes | str) -> list[str]:
    """The ``data`` of each server-sent event of ``body`` (an event's ``data:`` lines joined
    by newlines), in order; an event the stream ends in the middle of (no blank line after
    it) is dropped, as the standard says. Source:
    https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation
    (one space after the colon is dropped; a blank line ends an event)."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    events, lines = [], []
    *complete, _unfinished = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for line in complete:
        if not line:
            if lines:
                events.append("\n".join(lines))
            lines = []
        elif line.startswith("data:"):
            lines.append(line[6:] if line.startswith("data: ") else line[5:])
    return events


def stream_problem(body: bytes | str | None) -> str | None:
    """What is wrong with a streamed answer read to its end: ``None`` when nothing is, else
    the ``error.code`` of its first in-band error event (``"error"`` when it has none),
    ``"no_done"`` when it does not end with ``data: [DONE]`` (cut short), or
    ``"no_finish_reason"`` when no event carried a ``finish_reason``."""
    events = sse_data(body or b"")
    finished = False
    for data in events[:-1] if events and events[-1] == DONE else events:
        try:
            event = json.loads(data)
        except ValueError:
            return "not_json"
        if isinstance(event, dict) and "error" in event:
            return error_code(data) or "error"
        choices = event.get("choices") if isinstance(event, dict) else None
        finished |= any(isinstance(c, dict) and c.get("finish_reason")
                        for c in choices or ())
    if not events or events[-1] != DONE:
        return "no_done"
    return None if finished else "no_finish_reason"


REFUSAL_CODES = frozenset({"queue_full", "queue_timeout", "predicted_timeout", "no_replicas",
                           "draining"})
"""503 codes: a stream that waited in the open (its 200 started with position comments) and
was then refused carries one in-band, with ``retry_after_ms``."""


def stream_outcome(problem: str | None) -> Outcome:
    """The outcome of a 200 whose stream had ``problem`` (:func:`stream_problem`): a refusal
    in-band (a queued stream not admitted in time) is refused, as its 503 would be."""
    if problem is None:
        return Outcome.OK
    if problem in REFUSAL_CODES:
        return Outcome.REFUSED
    return Outcome.OOM if problem == "oom" else Outcome.SERVER_ERROR


SEPARATOR = " | "


def entry_name(kind: str, outcome: Outcome) -> str:
    """Locust's stats name of a request: ``kind`` for a 2xx (so locust's own table reads as
    usual), ``kind | outcome`` otherwise, so every outcome has its own latency distribution."""
    return kind if outcome is Outcome.OK else f"{kind}{SEPARATOR}{outcome.value}"


def split_entry_name(name: str) -> tuple[str, Outcome]:
    """Inverse of :func:`entry_name`.

    Raises:
        ValueError: the suffix is not an :class:`Outcome`.
    """
    kind, sep, outcome = name.rpartition(SEPARATOR)
    if not sep:
        return name, Outcome.OK
    return kind, Outcome(outcome)
