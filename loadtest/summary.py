"""The maths of a load-test run's summary. Pure: no Ray, no locust, no HTTP.

Inputs are what a run leaves behind: locust's merged figures per outcome (the locustfile's
summary JSON), and ``/metrics`` scrapes as ``(name, labels, value)`` samples (parsed with
prometheus-client's parser). Outputs are one row of the side-by-side table, the
``max_ongoing_requests`` of the slot-count baseline, and the done-when verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtest.outcomes import Outcome

Sample = tuple[str, dict[str, str], float]  # (sample name, labels, value)


def parse_exposition(text: str, prefix: str = "vramgate_") -> list[Sample]:
    """The samples of a Prometheus text exposition whose names start with ``prefix``.

    Raises:
        ValueError: ``text`` is not valid exposition format.
    """
    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith(prefix)]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 if none): a
    counter or gauge summed over replicas."""
    return sum(value for n, lab, value in samples
               if n == name and all(lab.get(k) == v for k, v in labels.items()))


def histogram_buckets(samples: Iterable[Sample], name: str) -> list[tuple[float, float]]:
    """``[(le, cumulative count)]`` of histogram ``name`` (without ``_bucket``), summed over
    replicas, sorted by bound (``+Inf`` last)."""
    counts: dict[float, float] = {}
    for n, labels, value in samples:
        if n == f"{name}_bucket":
            le = float(labels["le"])
            counts[le] = counts.get(le, 0.0) + value
    return sorted(counts.items())


def bucket_delta(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]],
                 ) -> list[tuple[float, float]]:
    """``after - before`` per bound (what was observed between the two scrapes); a bound
    missing from ``before`` counts from 0."""
    earlier = dict(before)
    return [(le, count - earlier.get(le, 0.0)) for le, count in after]


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q``-quantile of a cumulative histogram, as Prometheus's ``histogram_quantile``
    computes it (linear interpolation within the bucket holding rank ``q x count``, the
    first bucket starting at 0; a rank in the ``+Inf`` bucket gives the largest finite bound).
    ``None`` for an empty histogram.

    Source: https://prometheus.io/docs/prometheus/latest/querying/functions/#histogram_quantile

    Raises:
        ValueError: ``q`` outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(le):
                return lower_le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le


def mean_price_bytes(prices_by_kind: Mapping[str, Sequence[int]],
                     share_by_kind: Mapping[str, float]) -> float:
    """The average request price of a mix: each kind's mean price weighted by its share of
    the requests.

    Raises:
        ValueError: a kind with a share has no prices, or the shares sum to 0.
    """
    weight = sum(share_by_kind.values())
    if weight <= 0:
        raise ValueError("the shares sum to 0")
    mean = 0.0
    for kind, share in share_by_kind.items():
        prices = prices_by_kind.get(kind)
        if not prices:
            raise ValueError(f"no prices for kind {kind!r}")
        mean += share * sum(prices) / len(prices)
    return mean / weight


def slot_count(budget_bytes: int, mean_price: float) -> int:
    """``max_ongoing_requests`` of plain Ray Serve tuned to the average request: as many
    average requests as the budget holds, ``max(1, floor(budget / mean price))``.

    Raises:
        ValueError: a price <= 0.
    """
    if mean_price <= 0:
        raise ValueError(f"mean price must be > 0, got {mean_price}")
    return max(1, math.floor(budget_bytes / mean_price))


def run_row(outcomes: Mapping[str, Any], before: Sequence[Sample], after: Sequence[Sample],
            max_queue_wait_s: float) -> dict[str, Any]:
    """One row of the side-by-side table.

    Args:
        outcomes: the locustfile's summary (``by_outcome``: counts and ms percentiles;
            ``start_unix_s`` / ``end_unix_s``).
        before, after: ``/metrics`` samples scraped before the load and after it settled.
        max_queue_wait_s: the run's ``admission.max_queue_wait_s``.

    Returns:
        ``duration_s``; counts per :class:`Outcome` value; ``throughput_rps`` (2xx per
        second); ``arrival_rps`` (requests of every outcome per second); ``p50_ms`` /
        ``p99_ms`` of the 2xx; ``replica_ooms`` (the replicas'
        ``vramgate_ooms_total`` increase); ``inference_p99_s`` (from the
        ``vramgate_inference_seconds`` histogram's increase); ``latency_bound_ms`` =
        ``max_queue_wait_s`` + that p99; ``within_bound``; ``non_2xx`` and
        ``non_2xx_all_503_retry_after`` (every non-2xx but deliberate aborts was a 503 with
        ``Retry-After``: refused or oom); ``queue_timeout`` (503s after the whole wait) and
        ``predicted_timeout`` (503s at once, their predicted wait too long) from the
        locustfile's ``status_codes``; ``refused_p99_ms``, the client-side p99 of refusals.
    """
    by_outcome = outcomes.get("by_outcome", {})
    counts = {o.value: int(by_outcome.get(o.value, {}).get("count", 0)) for o in Outcome}
    duration_s = max(1e-9, float(outcomes["end_unix_s"]) - float(outcomes["start_unix_s"]))
    ok = by_outcome.get(Outcome.OK.value, {})
    inference = bucket_delta(histogram_buckets(before, "vramgate_inference_seconds"),
                             histogram_buckets(after, "vramgate_inference_seconds"))
    inference_p99_s = histogram_quantile(0.99, inference)
    bound_ms = (None if inference_p99_s is None
                else 1000.0 * (max_queue_wait_s + inference_p99_s))
    p99_ms = ok.get("p99_ms")
    non_2xx = sum(counts.values()) - counts["ok"] - counts["aborted"]
    return {
        "duration_s": round(duration_s, 1),
        **counts,
        "throughput_rps": round(counts["ok"] / duration_s, 2),
        "arrival_rps": round(sum(counts.values()) / duration_s, 2),
        "p50_ms": ok.get("p50_ms"),
        "p99_ms": p99_ms,
        "replica_ooms": int(total(after, "vramgate_ooms_total")
                            - total(before, "vramgate_ooms_total")),
        "inference_p99_s": None if inference_p99_s is None else round(inference_p99_s, 3),
        "latency_bound_ms": None if bound_ms is None else round(bound_ms),
        "within_bound": None if bound_ms is None or p99_ms is None else p99_ms <= bound_ms,
        "non_2xx": non_2xx,
        "non_2xx_all_503_retry_after": non_2xx == counts["refused"] + counts["oom"],
        **{code: int(outcomes.get("status_codes", {}).get(f"503 {code}", 0))
           for code in ("queue_timeout", "predicted_timeout")},
        "refused_p99_ms": by_outcome.get(Outcome.REFUSED.value, {}).get("p99_ms"),
    }


def idle_problems(replicas: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the idle invariants (nothing reserved, queued, leased or running; charged bytes ==
    released) find wrong in settled ``/v1/status`` replicas (empty: nothing leaked)."""
    if not replicas:
        return ["no replica published its status"]
    problems = []
    for r in replicas:
        rid = str(r.get("replica_id", "?"))[-8:]
        for key in ("reserved_bytes", "queue_depth", "queued_bytes", "active_leases",
                    "inferences_running"):
            if r.get(key):
                problems.append(f"{rid}: {key}={r[key]}")
        if r.get("charged_bytes_total") != r.get("released_bytes_total"):
            problems.append(f"{rid}: charged {r.get('charged_bytes_total')} != released "
                            f"{r.get('released_bytes_total')}")
    return problems


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]],
                   ) -> str:
    """A GitHub markdown table: ``columns`` are ``(key, header)``; ``None`` shows as ``-``,
    booleans as ``yes`` / ``NO``."""
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        if isinstance(value, float):
            return f"{value:g}" if abs(value) >= 100 or value == int(value) else f"{value:.2f}"
        return str(value)

    lines = ["| " + " | ".join(header for _, header in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(row.get(key)) for key, _ in columns) + " |"
              for row in rows]
    return "\n".join(lines)
