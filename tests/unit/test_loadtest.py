"""The pure parts of the load test: response classification, load shapes and mixes as data,
request bodies, and the summary maths (no Ray, no locust, no HTTP)."""

from __future__ import annotations

import math
import random

import pytest

from loadtest import payloads
from loadtest.markdown import verdicts
from loadtest.outcomes import (
    Outcome,
    classify,
    entry_name,
    error_code,
    retry_after_s,
    split_entry_name,
)
from loadtest.scenarios import (
    BASELINES,
    MIXES,
    SHAPES,
    SPIKE_MULTIPLE,
    USER_KINDS,
    Stage,
    apply_overrides,
    kind_shares,
)
from loadtest.summary import (
    bucket_delta,
    histogram_buckets,
    histogram_quantile,
    idle_problems,
    markdown_table,
    mean_price_bytes,
    parse_exposition,
    run_row,
    slot_count,
    total,
)
from serve_app.request import GenerationParams

MiB = 1 << 20

# --- classification -------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "headers", "code", "aborted", "expected"), [
    (200, {}, None, False, Outcome.OK),
    (201, {}, None, False, Outcome.OK),
    (200, {}, None, True, Outcome.OK),  # the answer came before the client gave up
    (503, {"Retry-After": "3"}, "queue_full", False, Outcome.REFUSED),
    (503, {"retry-after": "1"}, "queue_timeout", False, Outcome.REFUSED),
    (503, {"Retry-After": "2"}, None, False, Outcome.REFUSED),
    (503, {"Retry-After": "2"}, "oom", False, Outcome.OOM),
    (503, {}, "queue_full", False, Outcome.SERVER_ERROR),  # no Retry-After: contract broken
    (503, {}, "oom", False, Outcome.SERVER_ERROR),
    (503, {"Retry-After": "0"}, "queue_full", False, Outcome.SERVER_ERROR),
    (503, {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}, "queue_full", False,
     Outcome.SERVER_ERROR),
    (500, {"Retry-After": "1"}, "internal_error", False, Outcome.SERVER_ERROR),
    (504, {}, "inference_timeout", False, Outcome.SERVER_ERROR),
    (429, {"Retry-After": "1"}, None, False, Outcome.CLIENT_ERROR),
    (422, {}, "idempotency_key_reused", False, Outcome.CLIENT_ERROR),
    (None, {}, None, False, Outcome.ERROR),
    (0, {}, None, True, Outcome.ABORTED),
    (302, {}, None, False, Outcome.ERROR),
])
def test_classify(status: int | None, headers: dict[str, str], code: str | None,
                  aborted: bool, expected: Outcome) -> None:
    assert classify(status, headers, code, aborted) is expected


def test_only_ok_refused_and_aborted_are_not_failures() -> None:
    assert {o for o in Outcome if not o.is_failure} == {Outcome.OK, Outcome.REFUSED,
                                                         Outcome.ABORTED}


@pytest.mark.parametrize(("headers", "expected"), [
    ({"Retry-After": "7"}, 7), ({"RETRY-AFTER": " 12 "}, 12), ({"Retry-After": "0"}, None),
    ({"Retry-After": "-1"}, None), ({"Retry-After": "1.5"}, None), ({}, None)])
def test_retry_after_is_whole_seconds_of_at_least_one(headers: dict[str, str],
                                                      expected: int | None) -> None:
    assert retry_after_s(headers) == expected


@pytest.mark.parametrize(("body", "expected"), [
    (b'{"error": {"message": "m", "type": "overloaded", "code": "oom"}}', "oom"),
    ('{"error": {"message": "m", "type": "t", "code": null}}', None),
    (b'{"object": "list"}', None), (b"[1, 2]", None), (b"not json", None), (b"", None),
    (None, None)])
def test_error_code(body: bytes | str | None, expected: str | None) -> None:
    assert error_code(body) == expected


@pytest.mark.parametrize("outcome", list(Outcome))
def test_entry_names_round_trip(outcome: Outcome) -> None:
    name = entry_name("idempotent_replay", outcome)
    assert split_entry_name(name) == ("idempotent_replay", outcome)
    assert (name == "idempotent_replay") == (outcome is Outcome.OK)


def test_split_entry_name_rejects_unknown_outcomes() -> None:
    with pytest.raises(ValueError):
        split_entry_name("short | teapot")


# --- shapes, mixes, baselines ---------------------------------------------------------------


def test_spike_is_ten_times_the_base_load_in_its_middle_stage() -> None:
    spike = SHAPES["spike"]
    assert spike.duration_s == 60.0
    assert [spike.users_at(t, 12) for t in (0.0, 9.9, 10.0, 49.9, 50.0, 59.9)] == \
        [12, 12, 120, 120, 12, 12]
    assert spike.users_at(60.0, 12) is None
    assert spike.users_at(-0.1, 12) is None
    assert spike.peak_multiple() == SPIKE_MULTIPLE == 10.0
    assert spike.window_of(SPIKE_MULTIPLE) == (10.0, 50.0)
    assert spike.window_of(3.0) is None


def test_steady_ramp_and_soak() -> None:
    assert {SHAPES["steady"].users_at(t, 7) for t in (0, 30, 59.9)} == {7}
    ramp = [SHAPES["ramp"].users_at(7.5 * k + 1, 8) for k in range(8)]
    assert ramp == [2, 4, 6, 8, 10, 12, 14, 16]
    assert SHAPES["soak"].duration_s == 600.0  # bounded
    assert SHAPES["soak"].users_at(599, 5) == 5 and SHAPES["soak"].users_at(600, 5) is None


def test_a_running_shape_keeps_at_least_one_user() -> None:
    assert SHAPES["ramp"].users_at(0.0, 1) == 1  # a quarter of one user rounds to 1


def test_scaled_shape_keeps_proportions() -> None:
    short = SHAPES["spike"].scaled_to(15.0)
    assert short.duration_s == pytest.approx(15.0)
    assert short.stages[1] == Stage(10.0, SPIKE_MULTIPLE)
    assert short.users_at(3.0, 4) == 40 and short.users_at(13.0, 4) == 4
    with pytest.raises(ValueError):
        SHAPES["spike"].scaled_to(0)


def test_mixes_name_known_user_classes_and_bodies() -> None:
    assert set(USER_KINDS.values()) <= set(payloads.BODIES)
    for mix in MIXES.values():
        assert mix.weights and set(mix.weights) <= set(USER_KINDS), mix.name
        assert all(w > 0 for w in mix.weights.values())
    assert "CompletionUser" not in MIXES["mixed_embed"].weights  # an embedding model 404s


def test_kind_shares_follow_the_weights() -> None:
    # 6 short, 2 long + 1 abort, 2 mixed + 1 keyed, 2 completion, 2 chat
    shares = kind_shares(MIXES["mixed"])
    assert shares == pytest.approx({"short": 6 / 16, "long": 3 / 16, "mixed": 3 / 16,
                                    "completion": 2 / 16, "chat": 2 / 16})
    assert sum(shares.values()) == pytest.approx(1.0)


def test_baselines() -> None:
    names = [b.name for b in BASELINES]
    assert names[0] == "budget"  # first: its measurement sizes the slot count
    assert [b.overrides["admission.policy"] for b in BASELINES] == \
        ["budget", "semaphore", "none", "none"]
    assert [b.slot_count for b in BASELINES] == [False, False, False, True]
    assert BASELINES[1].overrides["admission.semaphore_permits"] == 1


def test_apply_overrides_sets_dotted_keys_without_touching_the_input() -> None:
    args = {"model": {"task": "fake"}, "admission": {"policy": "budget", "max_queue_len": 4}}
    result = apply_overrides(args, {"admission.policy": "none", "deployment.num_cpus": 0,
                                    "memory.profile_path": "p.json"})
    assert result == {"model": {"task": "fake"},
                      "admission": {"policy": "none", "max_queue_len": 4},
                      "deployment": {"num_cpus": 0}, "memory": {"profile_path": "p.json"}}
    assert args["admission"]["policy"] == "budget"


# --- request bodies -------------------------------------------------------------------------


def _shape_on_the_card(body: dict) -> tuple[int, int, int]:
    """``(inputs, longest input's tokens, max_tokens)`` of ``body`` as the fake card's ingress
    builds it (``build_request`` refuses what exceeds a limit of the load-test config)."""
    from deployments.engines.words import WordFrontEnd
    from loadtest.runner import config_args
    from serve_app.config import parse_args
    from serve_app.kinds import build_request

    args = parse_args(config_args("loadtest/configs/fake_small_card.yaml"))
    front = WordFrontEnd(args.fake.max_seq_tokens)  # words + 2 special tokens
    kind, ids, params, stream = payloads.tokenized(front, body)
    request = build_request(kind, ids, params, stream, args, front.max_seq_tokens)
    return len(ids), max(request.token_counts), params.max_tokens if params else 0


def test_bodies_stay_within_the_load_test_limits() -> None:
    rng = random.Random(1)
    for kind, make in payloads.BODIES.items():
        for _ in range(200):
            inputs, longest, new = _shape_on_the_card(make(rng))
            assert 1 <= inputs <= 8 and 1 <= longest <= 256 and 0 <= new <= 256, kind
    assert _shape_on_the_card({"input": "a b c"}) == (1, 5, 0)
    assert _shape_on_the_card({"input": ["a", "a b c d"]}) == (2, 6, 0)
    assert _shape_on_the_card({"prompt": "a b", "max_tokens": 40}) == (1, 4, 40)
    # "system: a b" / "user: c" / "assistant:": 6 words + 2 special tokens
    chat = {"messages": [{"role": "system", "content": "a b"},
                         {"role": "user", "content": "c"}], "max_tokens": 256}
    assert _shape_on_the_card(chat) == (1, 8, 256)
    assert payloads.request_of({"prompt": "a b", "max_tokens": 40, "temperature": 0}) == \
        ("generate", ["a b"], GenerationParams(max_tokens=40, temperature=0.0))


def test_the_runner_plans_max_ongoing_as_build_app_does() -> None:
    from loadtest.runner import config_args, planned_max_ongoing

    # The load-test card: a 4.5 GiB budget admits 4608 of the smallest request (1 token at
    # 1 MiB), so Ray's cap is its ceiling; without a gate (policy none) the cap is the only
    # gate: 4 P95 requests (8 x 128 tokens = 1 GiB) plus a queue of 64.
    args = config_args("loadtest/configs/fake_small_card.yaml")
    assert planned_max_ongoing(args) == 1024
    assert planned_max_ongoing({**args, "admission": {**args["admission"],
                                                      "policy": "none"}}) == 68


def test_long_bodies_are_long_and_seeded() -> None:
    first = payloads.long_body(random.Random(3))
    assert first == payloads.long_body(random.Random(3))
    assert len(first["input"]) == payloads.LONG_INPUTS
    assert all(200 <= len(t.split()) <= 220 for t in first["input"])


# --- summary maths --------------------------------------------------------------------------

BUCKETS = [(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (math.inf, 100.0)]


@pytest.mark.parametrize(("q", "expected"), [
    (0.5, 0.1), (0.25, 0.05), (0.9, 0.5), (0.95, 0.75), (0.99, 0.95), (1.0, 1.0)])
def test_histogram_quantile_interpolates_like_prometheus(q: float, expected: float) -> None:
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected)


def test_histogram_quantile_edges() -> None:
    assert histogram_quantile(0.99, [(1.0, 5.0), (math.inf, 10.0)]) == 1.0  # in +Inf
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, BUCKETS)


EXPOSITION = """\
# HELP vramgate_ooms_total Out-of-memory errors caught.
# TYPE vramgate_ooms_total counter
vramgate_ooms_total{deployment="ModelServer",replica="a"} 2.0
vramgate_ooms_total{deployment="ModelServer",replica="b"} 1.0
# HELP vramgate_inference_seconds Time on the inference thread per request.
# TYPE vramgate_inference_seconds histogram
vramgate_inference_seconds_bucket{deployment="ModelServer",replica="a",le="0.1"} 40.0
vramgate_inference_seconds_bucket{deployment="ModelServer",replica="a",le="1.0"} 45.0
vramgate_inference_seconds_bucket{deployment="ModelServer",replica="a",le="+Inf"} 45.0
vramgate_inference_seconds_bucket{deployment="ModelServer",replica="b",le="0.1"} 10.0
vramgate_inference_seconds_bucket{deployment="ModelServer",replica="b",le="1.0"} 55.0
vramgate_inference_seconds_bucket{deployment="ModelServer",replica="b",le="+Inf"} 55.0
vramgate_inference_seconds_count{deployment="ModelServer",replica="a"} 45.0
vramgate_inference_seconds_sum{deployment="ModelServer",replica="a"} 4.0
# HELP other_metric Not ours.
# TYPE other_metric gauge
other_metric 3.0
"""


def test_parse_exposition_keeps_our_samples_and_sums_over_replicas() -> None:
    samples = parse_exposition(EXPOSITION)
    assert all(name.startswith("vramgate_") for name, _, _ in samples)
    assert total(samples, "vramgate_ooms_total") == 3.0
    assert total(samples, "vramgate_ooms_total", replica="b") == 1.0
    assert total(samples, "vramgate_missing_total") == 0.0
    assert histogram_buckets(samples, "vramgate_inference_seconds") == \
        [(0.1, 50.0), (1.0, 100.0), (math.inf, 100.0)]


def test_bucket_delta_counts_what_was_observed_between_scrapes() -> None:
    assert bucket_delta([(0.1, 5.0), (math.inf, 8.0)],
                        [(0.1, 7.0), (1.0, 3.0), (math.inf, 12.0)]) == \
        [(0.1, 2.0), (1.0, 3.0), (math.inf, 4.0)]


def test_slot_count_is_the_budget_over_the_mean_price() -> None:
    mean = mean_price_bytes({"short": [16 * MiB, 16 * MiB], "long": [896 * MiB, 880 * MiB]},
                            {"short": 3.0, "long": 1.0})  # shares need not sum to 1
    assert mean == pytest.approx((3 * 16 + 888) / 4 * MiB)
    assert slot_count(4608 * MiB, mean) == 19  # 4608 / 234 = 19.7
    assert slot_count(100, 1000.0) == 1
    with pytest.raises(ValueError):
        slot_count(100, 0.0)
    with pytest.raises(ValueError):
        mean_price_bytes({"short": []}, {"short": 1.0})
    with pytest.raises(ValueError):
        mean_price_bytes({"short": [1]}, {"short": 0.0})


def _outcomes(**counts: int) -> dict:
    by_outcome = {k: {"count": v} for k, v in counts.items()}
    by_outcome.setdefault("ok", {"count": 0}).update(p50_ms=800, p99_ms=2400)
    return {"by_outcome": by_outcome, "start_unix_s": 1000.0, "end_unix_s": 1040.0}


def test_run_row_figures_and_bound() -> None:
    before = parse_exposition(EXPOSITION)
    after = [(n, lab, v * 2) if n != "vramgate_ooms_total" else (n, lab, v)
             for n, lab, v in before]
    row = run_row(_outcomes(ok=200, refused=30, oom=0, aborted=5), before, after,
                  max_queue_wait_s=2.0)
    assert row["duration_s"] == 40.0 and row["throughput_rps"] == 5.0
    assert row["arrival_rps"] == 5.88  # (200 + 30 + 5) / 40 s
    assert (row["p50_ms"], row["p99_ms"]) == (800, 2400)
    assert row["replica_ooms"] == 0
    # the increase is 50 <= 0.1 s, 100 <= 1 s: rank 99 lies at 0.1 + 0.9 x 49/50 = 0.982 s
    assert row["inference_p99_s"] == pytest.approx(0.982)
    assert row["latency_bound_ms"] == 2982 and row["within_bound"] is True
    assert row["non_2xx"] == 30 and row["non_2xx_all_503_retry_after"] is True
    assert row["5xx"] == 0 and row["error"] == 0


def test_run_row_flags_other_failures_and_a_broken_bound() -> None:
    samples = parse_exposition(EXPOSITION)
    row = run_row(_outcomes(ok=10, refused=3, oom=2, **{"5xx": 1}), [], samples,
                  max_queue_wait_s=1.0)
    assert row["non_2xx"] == 6 and row["non_2xx_all_503_retry_after"] is False
    assert row["replica_ooms"] == 3
    assert row["within_bound"] is False  # 2400 ms > 1 s + p99 inference (0.982 s)


def test_idle_problems_name_what_leaked() -> None:
    idle = {"replica_id": "r-123456789", "reserved_bytes": 0, "queue_depth": 0,
            "queued_bytes": 0, "active_leases": 0, "inferences_running": 0,
            "charged_bytes_total": 10, "released_bytes_total": 10}
    assert idle_problems([idle]) == []
    assert idle_problems([]) == ["no replica published its status"]
    leaking = {**idle, "reserved_bytes": 5, "released_bytes_total": 5}
    assert idle_problems([leaking]) == ["23456789: reserved_bytes=5",
                                        "23456789: charged 10 != released 5"]


def test_markdown_table() -> None:
    table = markdown_table([{"a": 1.0, "b": None, "c": True}, {"a": 0.123, "b": "x", "c": False},
                            {"a": 1234.5}], [("a", "A"), ("b", "B"), ("c", "C")])
    assert table.splitlines() == ["| A | B | C |", "|---|---|---|", "| 1 | - | yes |",
                                  "| 0.12 | x | NO |", "| 1234.5 | - | - |"]


def _row(baseline: str, ok_rps: float, oom: int = 0, replica_ooms: int = 0, **extra) -> dict:
    return {"baseline": baseline, "throughput_rps": ok_rps, "oom": oom,
            "replica_ooms": replica_ooms, "status_codes": {}, "ray_max_ongoing": 11, **extra}


def test_verdicts_say_whether_each_condition_holds() -> None:
    spike = {"baseline": "budget", "non_2xx": 40, "non_2xx_all_503_retry_after": True,
             "refused": 40, "oom": 0, "p99_ms": 7000, "latency_bound_ms": 6000,
             "max_queue_wait_s": 2.0, "inference_p99_s": 4.0, "within_bound": False}
    report = {"workloads": [{"engine": "fake", "mix": "mixed", "spikes": [spike], "rows": [
        _row("budget", 4.6), _row("semaphore(1)", 2.4), _row("none", 3.8, oom=30,
                                                             replica_ooms=3),
        _row("slots", 4.0, status_codes={"500 internal_error": 1})]}]}
    lines = verdicts(report)
    assert lines[0] == ("- fake, `mixed` mix: budget has 0 OOM 503s (0 on the replica), 0 500s, "
                        "4.6 req/s vs semaphore(1) 2.4 req/s (1.92x): holds.")
    assert lines[1].endswith("30 OOM 503s, 3 OOMs on the replica: shows OOMs.")
    assert lines[2].endswith("no OOMs (see the notes).")
    assert lines[3].endswith("DOES NOT hold.") and "p99 of admitted 7000 ms" in lines[3]
    report["workloads"][0]["rows"][1]["throughput_rps"] = 4.5  # within 5 %: not told apart
    assert "(1.02x): zero OOMs and 500s hold; the throughputs are within 5%" in \
        verdicts(report)[0]
    report["workloads"][0]["rows"][1]["throughput_rps"] = 5.0  # semaphore clearly faster
    assert verdicts(report)[0].endswith("(0.92x): DOES NOT hold.")
    report["workloads"][0]["rows"][1]["throughput_rps"] = 2.4
    report["workloads"][0]["rows"][0]["status_codes"] = {"500 internal_error": 2}
    assert verdicts(report)[0].endswith("DOES NOT hold.")


def test_render_links_the_plots_and_lists_every_run(tmp_path) -> None:
    from loadtest.markdown import render

    row = {**_row("budget", 4.0), "label": "fake-steady-budget", "shape": "steady",
           "offered_rps": 6.0, "p50_ms": 100, "p99_ms": 900, "refused": 3, "5xx": 0,
           "4xx": 0, "error": 0, "aborted": 1, "leaks": [],
           "audit": {"requests": 10, "replay_identical": 2, "stream_complete": 5,
                     "not_stream_complete": 1}, "retry_after_s": {"1": 2, "4": 1},
           "by_kind": {"chat_stream": {"ok": {"count": 5, "p50_ms": 2100, "p99_ms": 7000},
                                       "refused": {"count": 2}, "oom": {"count": 1}},
                       "short": {"ok": {"count": 9, "p50_ms": 40, "p99_ms": 120}}}}
    report = {"machine": {"cpu": "cpu", "cores": 2, "memory_gib": 8, "os": "linux",
                          "python": "3.11", "ray": "2.60", "locust": "2.47", "torch": "2",
                          "date": "today"},
              "command": "python -m loadtest.run report", "elapsed_s": 600,
              "workloads": [{"engine": "fake", "title": "Fake", "config": "c.yaml",
                             "mix": "mixed", "users": 24, "pace_rps": 0.25, "steady_s": 45,
                             "spike_s": 60, "slots": {}, "rows": [row], "spikes": []}]}
    page = render(report, tmp_path / "docs" / "benchmarks", tmp_path)
    assert "![fake comparison](docs/benchmarks/fake-steady-comparison.png)" in page
    assert "![fake budget](docs/benchmarks/fake-steady-budget.png)" in page
    assert "| fake steady budget | 10 | 0 | 0 | 2 / 2 | 5 / 6 | 1 / 1 / 4 | 0 |" in page
    assert "| `chat_stream` | 5: 2100 / 7000, 2 refused, 1 failed |" in page  # per kind
    assert "| `short` | 9: 40 / 120, 0 refused, 0 failed |" in page
    assert page.startswith("# Benchmarks") and "## Notes" in page
    # a named workload's runs, files and images go by its name
    report["workloads"][0].update(name="fake-chat", rows=[{**row, "label": "fake-chat-steady-"
                                                           "budget"}])
    page = render(report, tmp_path / "docs" / "benchmarks", tmp_path)
    assert "![fake-chat comparison](docs/benchmarks/fake-chat-steady-comparison.png)" in page
    assert "![fake-chat budget](docs/benchmarks/fake-chat-steady-budget.png)" in page
    assert "| fake-chat steady budget | 10 |" in page
