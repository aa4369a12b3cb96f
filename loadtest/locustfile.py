"""Locust scenarios for vramgate: run it with locust itself, or through ``python -m loadtest.run``.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless \\
        --mix mixed --shape spike --base-users 10 --pace-rps 1 --csv out/locust --csv-full-history

User classes (weights come from ``--mix``, see :data:`loadtest.scenarios.MIXES`): short, long
and mixed-length embeddings, completions, chat (about half streamed), idempotent retries
(``Idempotency-Key``; a refused try is retried after ``Retry-After`` with the same key, and a
finished one is sometimes replayed, expecting ``Idempotent-Replayed: true`` and the same body)
and clients that abort mid-request (a socket timeout of :data:`ABORT_AFTER_S`). Every request
carries a fresh ``X-Request-Id``. The load shape is :class:`ScenarioShape` over ``--shape``
(users over time, see :data:`loadtest.scenarios.SHAPES`); each user paces itself to
``--pace-rps``.

Every response is classified by :func:`loadtest.outcomes.classify` and recorded in locust's
stats under ``kind`` (2xx) or ``kind | outcome`` (anything else), so each outcome keeps its own
latency distribution; refusals (503 with ``Retry-After``) and aborts are successes for locust,
everything else non-2xx (OOMs included) is a failure. A streamed answer is read to its end
(its latency is the whole stream's) and is a 2xx only if it ends with ``data: [DONE]`` and
carries no in-band error (:func:`loadtest.outcomes.stream_problem`). With ``--summary-json
PATH`` the test's end writes the merged figures per outcome and kind (locust's
``StatsEntry.extend``) and the contract checks (request ids echoed, ``Retry-After`` on every
503, replays identical, streams complete).
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import gevent
from locust import LoadTestShape, constant_pacing, events, task
from locust.contrib.fasthttp import FAILURE_EXCEPTIONS, FastHttpUser
from locust.stats import StatsEntry

# `locust -f loadtest/locustfile.py` puts only loadtest/ on sys.path; the package needs its root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest import payloads  # noqa: E402
from loadtest.outcomes import (  # noqa: E402
    Outcome,
    classify,
    entry_name,
    error_code,
    retry_after_s,
    split_entry_name,
    stream_outcome,
    stream_problem,
)
from loadtest.scenarios import MIXES, SHAPES  # noqa: E402

ABORT_AFTER_S = 0.3  # the aborting users' socket timeout: mid-inference for a long request
RETRY_TRIES = 4  # the idempotent users' tries per key (the first + 3 retries after Retry-After)
REPLAY_PROBABILITY = 0.5  # share of finished keyed requests sent again with the same key
PERCENTILES = (0.5, 0.9, 0.99)

AUDIT: Counter = Counter()  # contract checks, written to the summary JSON
EXAMPLES: dict[str, str] = {}  # the first offending value of each failed contract check
STATUS_CODES: Counter = Counter()  # "200", "503 queue_full", "0 TimeoutError", ...
RETRY_AFTERS: Counter = Counter()  # Retry-After seconds of the 503s -> how many
_SEEDS = itertools.count()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    group = parser.add_argument_group("vramgate scenario")
    group.add_argument("--mix", default="mixed", choices=sorted(MIXES),
                       help="user classes and weights (loadtest.scenarios.MIXES)")
    group.add_argument("--shape", default="steady", choices=sorted(SHAPES),
                       help="users over time (loadtest.scenarios.SHAPES)")
    group.add_argument("--base-users", type=int, default=10,
                       help="users at 1x of the shape")
    group.add_argument("--pace-rps", type=float, default=1.0,
                       help="most requests per second per user")
    group.add_argument("--shape-seconds", type=float, default=0.0,
                       help="stretch the shape to last this long (0: as defined)")
    group.add_argument("--retry-cap-s", type=float, default=2.0,
                       help="longest Retry-After the idempotent users honour")
    group.add_argument("--seed", type=int, default=0, help="seeds the request bodies")
    group.add_argument("--summary-json", default="",
                       help="write the outcome summary here at the end of the test")


@events.init.add_listener
def _configure(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:  # used as a library without the command line
        return
    for name, weight in MIXES[options.mix].weights.items():
        globals()[name].weight = weight


def _new_request_id() -> str:
    return f"lt-{uuid.uuid4().hex}"


class VramgateUser(FastHttpUser):
    """Base class: sends one request of its ``kind`` per period of ``1 / --pace-rps``
    seconds (locust's ``constant_pacing``; back to back while a request takes longer), the
    first after a random phase within one period, so that users spawned together (a spike)
    do not all send at once; records each outcome."""

    abstract = True
    kind = ""
    aborts = False  # a socket timeout on this user's requests is an abort, not an error
    connection_timeout = 10.0
    network_timeout = 120.0

    def on_start(self) -> None:
        options = self.environment.parsed_options
        seed = options.seed if options is not None else 0
        self.rng = random.Random(f"{seed}-{type(self).__name__}-{next(_SEEDS)}")
        self.period_s = 1.0 / (options.pace_rps if options is not None else 1.0)
        self.phased = False

    def wait_time(self) -> float:
        if not self.phased:  # the first wait: a random phase (see the class docstring)
            self.phased = True
            self._cp_last_wait_time = self.rng.uniform(0.0, self.period_s)
            self._cp_last_run = time.perf_counter()  # what constant_pacing keeps
            return self._cp_last_wait_time
        return constant_pacing(self.period_s)(self)

    @task
    def step(self) -> None:
        if self.phased:  # the first task only leads to the phase wait
            self.send_one()

    def send_one(self) -> None:
        self.send(self.kind, payloads.BODIES[self.kind](self.rng))

    def send(self, kind: str, body: dict[str, Any], headers: dict[str, str] | None = None,
             route_kind: str | None = None) -> tuple[Outcome, Any]:
        """POST ``body`` to the route of ``route_kind or kind``; record it as ``kind``.
        Returns the outcome and locust's response."""
        request_id = _new_request_id()
        route = payloads.ROUTES[route_kind or kind]
        # Without stream=True locust reads the whole body (a stream to its end) before it
        # takes the response time.
        with self.client.post(route, json=body, name=kind, catch_response=True,
                              headers={"X-Request-Id": request_id, **(headers or {})},
                              ) as response:
            outcome = self._record(response, kind, request_id, bool(body.get("stream")))
        return outcome, response

    def _record(self, response: Any, kind: str, request_id: str, streamed: bool) -> Outcome:
        status = response.status_code or 0
        headers = {name: value for name in ("retry-after", "x-request-id")
                   if (value := _header(response, name)) is not None}
        error = getattr(response, "error", None)
        # geventhttpclient wraps a socket timeout in RetriesExceeded(original=...)
        cause = getattr(error, "original", None) or error
        code = error_code(_body(response)) if status >= 400 else None
        aborted = self.aborts and isinstance(cause, TimeoutError)
        outcome = classify(status, headers, code, aborted)
        detail = code or (type(cause).__name__ if cause is not None else "")
        if streamed and outcome is Outcome.OK:  # a 200 from the first byte: read the events
            problem = stream_problem(_body(response))
            outcome, detail = stream_outcome(problem), f"stream {problem}" if problem else ""
            if outcome is not Outcome.REFUSED:  # a refusal in-band is no broken stream
                _check("stream_complete", problem is None, f"{request_id}: {problem}")
        STATUS_CODES[f"{status} {detail}".strip()] += 1
        AUDIT["requests"] += 1
        if status:
            echoed = headers.get("x-request-id")
            _check("request_id_echoed", echoed == request_id, f"sent {request_id}, got "
                   f"{echoed!r}")
        if status == 503:
            seconds = retry_after_s(headers)
            _check("503_with_retry_after", seconds is not None, repr(headers))
            RETRY_AFTERS[str(seconds)] += 1
        response.request_meta["name"] = entry_name(kind, outcome)
        if outcome.is_failure:
            response.failure(f"{status} {detail}")
        else:
            response.success()
        return outcome


class ShortEmbedUser(VramgateUser):
    kind = "short"


class LongEmbedUser(VramgateUser):
    kind = "long"


class MixedEmbedUser(VramgateUser):
    kind = "mixed"


class CompletionUser(VramgateUser):
    kind = "completion"


class ChatUser(VramgateUser):
    """Chat completions (:func:`loadtest.payloads.chat_body`), about half of them streamed,
    recorded as ``chat`` and ``chat_stream``."""

    kind = "chat"

    def send_one(self) -> None:
        body = payloads.chat_body(self.rng)
        self.send("chat_stream" if body["stream"] else "chat", body, route_kind="chat")


class AbortingUser(VramgateUser):
    """Sends long embeddings and hangs up after :data:`ABORT_AFTER_S` if no answer came."""

    kind = "abort"
    aborts = True
    network_timeout = ABORT_AFTER_S

    def send_one(self) -> None:
        self.send(self.kind, payloads.long_body(self.rng), route_kind="long")


class IdempotentRetryUser(VramgateUser):
    """A careful client: one ``Idempotency-Key`` per logical request, retried after
    ``Retry-After`` (capped by ``--retry-cap-s``) while refused, up to :data:`RETRY_TRIES`
    tries; a finished request is sent again with :data:`REPLAY_PROBABILITY`, which must be
    answered from the store (``Idempotent-Replayed: true``, same body)."""

    def send_one(self) -> None:
        options = self.environment.parsed_options
        cap_s = options.retry_cap_s if options is not None else 2.0
        key = f"lt-{uuid.uuid4().hex}"
        body = payloads.mixed_body(self.rng)
        for _ in range(RETRY_TRIES):
            outcome, response = self.send("idempotent", body, {"Idempotency-Key": key},
                                          route_kind="mixed")
            if outcome not in (Outcome.REFUSED, Outcome.OOM):
                break
            AUDIT["idempotent_retries"] += 1
            retry_after = retry_after_s({"retry-after": _header(response, "retry-after") or ""})
            gevent.sleep(min(cap_s, retry_after or 1))
        else:
            AUDIT["idempotent_gave_up"] += 1
            return
        if outcome is Outcome.OK and self.rng.random() < REPLAY_PROBABILITY:
            first = json.loads(response.content)
            again, replay = self.send("idempotent_replay", body, {"Idempotency-Key": key},
                                      route_kind="mixed")
            same = (again is Outcome.OK and json.loads(replay.content) == first
                    and _header(replay, "idempotent-replayed") == "true")
            _check("replay_identical", same, f"{again.value}, replayed header "
                   f"{_header(replay, 'idempotent-replayed')!r}")


def _body(response: Any) -> bytes | None:
    """The response body, or ``None`` when none came or reading it failed (the failure is
    locust's ``request_meta["exception"]``)."""
    try:
        return response.content
    except FAILURE_EXCEPTIONS:
        return None


def _header(response: Any, name: str) -> str | None:
    """A response header (any case), or ``None`` (also when no response came)."""
    headers = getattr(response, "headers", None)
    return headers.get(name) if headers else None


def _check(name: str, ok: bool, example: str) -> None:
    """Count a contract check as ``name`` or ``not_<name>``, keeping the first offence."""
    AUDIT[name if ok else f"not_{name}"] += 1
    if not ok:
        EXAMPLES.setdefault(name, example[:500])


class ScenarioShape(LoadTestShape):
    """Users over time from ``--shape`` x ``--base-users``; the run ends with the shape."""

    def tick(self) -> tuple[int, float, list[type]] | None:
        options = self.runner.environment.parsed_options
        shape = SHAPES[options.shape]
        if options.shape_seconds > 0:
            shape = shape.scaled_to(options.shape_seconds)
        users = shape.users_at(self.get_run_time(), options.base_users)
        if users is None:
            return None
        classes = [globals()[name] for name in MIXES[options.mix].weights]
        return users, max(10.0, users * 5.0), classes


@events.test_stop.add_listener
def _write_summary(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options is None or not options.summary_json:
        return
    summary = outcome_summary(environment.stats)
    summary.update(audit=dict(AUDIT), audit_examples=EXAMPLES, status_codes=dict(STATUS_CODES),
                   retry_after_s=dict(RETRY_AFTERS),
                   options={k: getattr(options, k) for k in (
                       "mix", "shape", "base_users", "pace_rps", "shape_seconds", "seed")},
                   written_at_unix_s=time.time())
    path = Path(options.summary_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True))


def outcome_summary(stats: Any) -> dict[str, Any]:
    """Locust's entries merged per outcome (all kinds) and per kind x outcome:
    ``{"by_outcome": {outcome: figures}, "by_kind": {kind: {outcome: figures}},
    "start_unix_s", "end_unix_s"}``, figures as :func:`_figures`."""
    merged: dict[str, StatsEntry] = {}
    by_kind: dict[str, dict[str, Any]] = {}
    for entry in stats.entries.values():
        kind, outcome = split_entry_name(entry.name)
        total = merged.setdefault(outcome.value, StatsEntry(stats, outcome.value, ""))
        total.extend(entry)
        by_kind.setdefault(kind, {})[outcome.value] = _figures(entry)
    return {"by_outcome": {k: _figures(v) for k, v in sorted(merged.items())},
            "by_kind": by_kind, "start_unix_s": stats.start_time,
            "end_unix_s": stats.last_request_timestamp}


def _figures(entry: StatsEntry) -> dict[str, Any]:
    """Count, mean and percentiles (ms, locust's rounding) of one entry."""
    figures: dict[str, Any] = {"count": entry.num_requests,
                               "avg_ms": round(entry.avg_response_time, 1),
                               "max_ms": round(entry.max_response_time, 1)}
    for q in PERCENTILES:
        figures[f"p{round(q * 100)}_ms"] = (entry.get_response_time_percentile(q)
                                            if entry.num_requests else None)
    return figures

