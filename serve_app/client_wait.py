"""How long a client will wait, and at what priority, from its request headers.

Two headers say it: ``Prefer: wait=N`` (RFC 7240, section 4.3: the client prefers a response
within N seconds) and ``X-Stainless-Read-Timeout``, which the official OpenAI SDKs send with
every request (their read timeout in seconds, e.g. ``2.0`` for ``OpenAI(timeout=2)``; see
``openai/_base_client.py``, ``_build_headers``). ``Prefer: priority=batch`` (or
``interactive``) names the request's priority class (:mod:`serve_app.admission.priority`).
Pure: no Ray, FastAPI or torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from serve_app.admission.priority import Priority

PREFER_WAIT = "wait"
PREFER_PRIORITY = "priority"
RESPOND_ASYNC = "respond-async"
NO_WAIT_BELOW_S = 0.1
"""A limit shorter than this leaves no time to wait at all, and is read as 0 (the request
runs if it can start at once, else it is refused at once): it is about what a request spends
before it can start with nothing ahead of it (ingress to replica, Ray Serve's assignment, the
inference thread's hand-off), which counts against the limit."""


def preferences(headers: Mapping[str, str]) -> dict[str, str]:
    """The ``Prefer`` header's preferences (RFC 7240 section 2), lower-cased names to values
    (``""`` for a bare token such as ``respond-async``); parameters after ``;`` ignored."""
    found: dict[str, str] = {}
    for item in headers.get("prefer", "").split(","):
        token = item.split(";", 1)[0].strip()
        if not token:
            continue
        name, _, value = token.partition("=")
        found.setdefault(name.strip().lower(), value.strip().strip('"'))
    return found


def client_wait_limit_s(headers: Mapping[str, str]) -> float | None:
    """The shortest wait the client asked for, in seconds: ``Prefer: wait`` and
    ``X-Stainless-Read-Timeout``, whichever is smaller; ``0.0`` (do not wait: run only if it
    can start at once) for ``0`` or anything under :data:`NO_WAIT_BELOW_S`; ``None`` when
    neither is a finite number >= 0 (a malformed value is ignored, as RFC 7240 asks of
    preferences)."""
    limits = [_seconds(preferences(headers).get(PREFER_WAIT)),
              _seconds(headers.get("x-stainless-read-timeout"))]
    given = [limit for limit in limits if limit is not None]
    if not given:
        return None
    return 0.0 if min(given) < NO_WAIT_BELOW_S else min(given)


def prefers_async(headers: Mapping[str, str]) -> bool:
    """``Prefer: respond-async`` (RFC 7240 section 4.1): answer 202 and run it as a job."""
    return RESPOND_ASYNC in preferences(headers)


def _seconds(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def client_priority(headers: Mapping[str, str]) -> Priority | None:
    """The priority class the client asked for (``Prefer: priority=batch|interactive``,
    case-insensitive); ``None`` when it named none or an unknown one (ignored, as RFC 7240
    asks of preferences it does not support)."""
    value = preferences(headers).get(PREFER_PRIORITY, "").lower()
    return Priority(value) if value in {p.value for p in Priority} else None
