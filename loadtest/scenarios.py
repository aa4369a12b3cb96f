"""Load shapes, user mixes and baselines, as data. Pure: no locust, no Ray.

A run is a *mix* of user classes (weights), driven through a *shape* (users over time, in
multiples of a base user count), against one *baseline* (an admission policy and its knobs).
Every user sends one request per ``1 / pace_rps`` seconds (locust's ``constant_pacing``, the
first after a random phase), so the offered load is ``users x pace_rps`` while requests take
less than a period (longer ones delay their user's next request: give slow runs a low pace and
many users), and a refused request does not turn into a tight retry loop: a shape's "10x" is
ten times the offered requests per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Stage:
    """``users`` x the base user count, for ``duration_s`` seconds."""

    duration_s: float
    users: float


@dataclass(frozen=True)
class LoadShape:
    """Users over time: consecutive :class:`Stage` s, then the end of the run."""

    name: str
    description: str
    stages: tuple[Stage, ...]

    @property
    def duration_s(self) -> float:
        return sum(stage.duration_s for stage in self.stages)

    def peak_multiple(self) -> float:
        return max(stage.users for stage in self.stages)

    def users_at(self, t_s: float, base_users: int) -> int | None:
        """Users ``t_s`` seconds into the run (at least 1 while it runs), ``None`` once the
        last stage is over."""
        if t_s < 0:
            return None
        elapsed = 0.0
        for stage in self.stages:
            elapsed += stage.duration_s
            if t_s < elapsed:
                return max(1, round(stage.users * base_users))
        return None

    def window_of(self, multiple: float) -> tuple[float, float] | None:
        """``(start_s, end_s)`` of the first stage at ``multiple`` x the base users, or
        ``None`` if there is none."""
        start = 0.0
        for stage in self.stages:
            if math.isclose(stage.users, multiple):
                return start, start + stage.duration_s
            start += stage.duration_s
        return None

    def scaled_to(self, duration_s: float) -> LoadShape:
        """The same shape stretched or squeezed to last ``duration_s`` seconds.

        Raises:
            ValueError: ``duration_s`` <= 0.
        """
        if duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {duration_s}")
        factor = duration_s / self.duration_s
        return replace(self, stages=tuple(Stage(s.duration_s * factor, s.users)
                                          for s in self.stages))


SPIKE_MULTIPLE = 10.0

SHAPES: dict[str, LoadShape] = {shape.name: shape for shape in (
    LoadShape("steady", "the base load throughout", (Stage(60.0, 1.0),)),
    LoadShape("ramp", "from a quarter of the base load to twice it, in 8 equal steps",
              tuple(Stage(7.5, k / 4) for k in range(1, 9))),
    LoadShape("spike", f"the base load, {SPIKE_MULTIPLE:g}x for two thirds of the run, the "
              "base load again", (Stage(10.0, 1.0), Stage(40.0, SPIKE_MULTIPLE),
                                  Stage(10.0, 1.0))),
    LoadShape("soak", "the base load for 10 minutes (bounded)", (Stage(600.0, 1.0),)),
)}


@dataclass(frozen=True)
class Mix:
    """User classes of :mod:`loadtest.locustfile` by name, with locust weights."""

    name: str
    description: str
    weights: dict[str, int] = field(default_factory=dict)


MIXES: dict[str, Mix] = {mix.name: mix for mix in (
    Mix("mixed", "heterogeneous: short, long and mixed-length embeddings, completions, chat "
        "(streamed and not), idempotent retries, clients that abort",
        {"ShortEmbedUser": 6, "LongEmbedUser": 2, "MixedEmbedUser": 2, "CompletionUser": 2,
         "ChatUser": 2, "IdempotentRetryUser": 1, "AbortingUser": 1}),
    Mix("mixed_embed", "as `mixed` without completions and chat (for an embedding-only "
        "model)",
        {"ShortEmbedUser": 6, "LongEmbedUser": 2, "MixedEmbedUser": 2,
         "IdempotentRetryUser": 1, "AbortingUser": 1}),
    Mix("short", "short single-sentence embeddings only", {"ShortEmbedUser": 1}),
    Mix("long", "long 4-input embeddings only", {"LongEmbedUser": 1}),
    Mix("completions", "completions only", {"CompletionUser": 1}),
    Mix("chat", "completions and chat only (chat streamed and not, max_tokens 8-256)",
        {"CompletionUser": 1, "ChatUser": 1}),
)}


# The body each user class of :mod:`loadtest.locustfile` sends (a kind of
# :data:`loadtest.payloads.BODIES`): what the slot-count baseline averages prices over.
USER_KINDS: dict[str, str] = {
    "ShortEmbedUser": "short", "LongEmbedUser": "long", "MixedEmbedUser": "mixed",
    "CompletionUser": "completion", "ChatUser": "chat", "IdempotentRetryUser": "mixed",
    "AbortingUser": "long"}


def kind_shares(mix: Mix) -> dict[str, float]:
    """Each body kind's share of a mix's requests: users pace themselves alike, so a user
    class sends in proportion to its weight (retries and replays aside)."""
    weight = sum(mix.weights.values())
    shares: dict[str, float] = {}
    for user, w in mix.weights.items():
        shares[USER_KINDS[user]] = shares.get(USER_KINDS[user], 0.0) + w / weight
    return shares


@dataclass(frozen=True)
class Baseline:
    """One admission setup compared side by side.

    Attributes:
        name: the label in tables and plots.
        overrides: dotted ``args:`` keys set over the config, e.g.
            ``{"admission.policy": "semaphore"}``.
        slot_count: ``deployment.max_ongoing_requests`` is set at run time to
            :func:`loadtest.summary.slot_count` (budget / average request price) of the budget
            run of the same workload (plain Ray Serve tuned to the average request).
    """

    name: str
    description: str
    overrides: dict[str, Any]
    slot_count: bool = False


BASELINES: tuple[Baseline, ...] = (
    Baseline("budget", "admission.policy: budget (the product: lease measured bytes)",
             {"admission.policy": "budget"}),
    Baseline("semaphore(1)", "admission.policy: semaphore, 1 permit (the article's "
             "asyncio.Semaphore(1))",
             {"admission.policy": "semaphore", "admission.semaphore_permits": 1}),
    Baseline("none", "admission.policy: none (no gate; Ray Serve's derived "
             "max_ongoing_requests only)", {"admission.policy": "none"}),
    Baseline("slots", "plain Ray Serve: policy none, deployment.max_ongoing_requests = "
             "budget / average request price", {"admission.policy": "none"}, slot_count=True),
)


def apply_overrides(args: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``args`` with each dotted key of ``overrides`` set (sections created as
    needed), e.g. ``{"admission.policy": "none"}``."""
    result = {k: (dict(v) if isinstance(v, dict) else v) for k, v in args.items()}
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        node = result
        for part in path:
            child = node.get(part)
            node[part] = child = dict(child) if isinstance(child, dict) else {}
            node = child
        node[last] = value
    return result
