"""What the load test's requests cost, priced as the replicas price them: the average price
of a mix sizes the slot-count baseline (plain Ray Serve with ``max_ongoing_requests`` = budget
/ average request price).

Prices come from the replicas' own published cost model (``/v1/status``, the fitted model the
budget policy charges) through the ingress's pricer (:class:`deployments.pricing.IngressPricer`,
the engine's own tokenizer), on a seeded sample of each kind of body the mix sends.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from loadtest import payloads
from loadtest.scenarios import MIXES, kind_shares
from loadtest.summary import mean_price_bytes, slot_count
from serve_app.admission.batching import priced_shape

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
    from deployments.pricing import IngressPricer
    from serve_app.config import parse_args

    args = parse_args(raw_args)
    pricer = IngressPricer(args)
    rng = random.Random(seed)
    shares = kind_shares(MIXES[mix])
    cfg = args.batching
    prices: dict[str, list[int]] = {}
    for kind in shares:
        for _ in range(SAMPLES_PER_KIND):
            inputs, longest, new = payloads.shape_of(payloads.BODIES[kind](rng),
                                                     pricer.count_tokens)
            # The replica's rule (deployments/model_server.py): batchable requests are
            # priced padded (the load test's completions are greedy, not streamed, no stop).
            batchable = cfg.enabled and (cfg.completions if new else
                                         inputs <= cfg.max_batch_size)
            longest, new = priced_shape([longest], new, batchable, cfg.pad_to_multiple_of,
                                        args.limits.max_input_tokens, args.limits.max_tokens)
            price = IngressPricer.price(statuses, inputs, longest, new)
            if price is None:
                raise ValueError("no replica published a fitted cost model")
            prices.setdefault(kind, []).append(price)
    budget = min(int(s["measured_budget_bytes"]) for s in statuses)
    mean = mean_price_bytes(prices, shares)
    return {"slots": slot_count(budget, mean), "budget_bytes": budget,
            "mean_price_bytes": round(mean),
            "mean_price_by_kind": {k: round(sum(v) / len(v)) for k, v in prices.items()},
            "shares": {k: round(v, 3) for k, v in shares.items()}}
