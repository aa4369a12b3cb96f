"""What the load test's requests cost, priced as the replicas price them: the average price
of a mix sizes the slot-count baseline (plain Ray Serve with ``max_ongoing_requests`` = budget
/ average request price).

Each body is read, tokenized (a chat body's messages by the chat template) and priced as the
ingress does it (the engine's own front end, :func:`serve_app.kinds.build_request`,
:func:`serve_app.pricing.estimate_units` with the cost model the replicas publish in
``/v1/status``: the lease a replica takes for it), on a seeded sample of each kind of body the
mix sends.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from loadtest import payloads
from loadtest.scenarios import MIXES, kind_shares
from loadtest.summary import mean_price_bytes, slot_count
from serve_app.admission.policy import policy_class
from serve_app.kinds import build_request
from serve_app.pricing import estimate_units

SAMPLES_PER_KIND = 200


def slots_for(raw_args: dict[str, Any], statuses: Sequence[dict[str, Any]], mix: str,
              seed: int = 0) -> dict[str, Any]:
    """The slot-count baseline's ``max_ongoing_requests`` for ``mix`` on the budget-policy
    replicas whose ``statuses`` are given: ``floor(measured budget / mean price)``.

    Returns ``{"slots", "budget_bytes", "mean_price_bytes", "mean_price_by_kind",
    "shares"}``.

    Raises:
        ValueError: no replica has published a fitted cost model.
    """
    from deployments.engines.registry import engine_class
    from serve_app.config import parse_args

    args = parse_args(raw_args)
    front = engine_class(args).front_end(args)
    policy = policy_class(args.admission.policy)
    published = [status.get("cost_model") for status in statuses]
    rng = random.Random(seed)
    shares = kind_shares(MIXES[mix])
    prices: dict[str, list[int]] = {}
    for kind in shares:
        for _ in range(SAMPLES_PER_KIND):
            route_kind, ids, params, stream = payloads.tokenized(front,
                                                                payloads.BODIES[kind](rng))
            request = build_request(route_kind, ids, params, stream, args, front.max_seq_tokens)
            price = estimate_units(published, request.shape, policy)
            if price is None:
                raise ValueError("no replica published a fitted cost model")
            prices.setdefault(kind, []).append(price)
    budget = min(int(s["measured_budget_bytes"]) for s in statuses)
    mean = mean_price_bytes(prices, shares)
    return {"slots": slot_count(budget, mean), "budget_bytes": budget,
            "mean_price_bytes": round(mean),
            "mean_price_by_kind": {k: round(sum(v) / len(v)) for k, v in prices.items()},
            "shares": {k: round(v, 3) for k, v in shares.items()}}
