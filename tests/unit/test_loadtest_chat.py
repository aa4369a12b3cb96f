"""The load test's chat mix (issue 15, item 5): chat bodies within the load-test card's
limits, the ``chat`` mix and the chat user in ``mixed``, how a streamed answer is accounted
(complete only with ``data: [DONE]``, a ``finish_reason`` and no in-band error), the slot
count's price of a chat, and the report's chat-only workload with its done-when goal."""

from __future__ import annotations

import random

import pytest

from loadtest import payloads
from loadtest.markdown import verdicts
from loadtest.outcomes import Outcome, sse_data, stream_outcome, stream_problem
from loadtest.scenarios import MIXES, USER_KINDS, kind_shares
from serve_app.request import GenerationParams

MiB = 1 << 20

# --- streamed answers -----------------------------------------------------------------------


def _events(*payloads_: object) -> bytes:
    """A server-sent event stream of ``payloads_`` (JSON, or a string as it is)."""
    import json

    return b"".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode()
                    for p in payloads_)


def _chunk(content: str | None, finish_reason: str | None = None) -> dict:
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


OOM_EVENT = {"error": {"message": "out of memory", "type": "overloaded", "code": "oom"}}


@pytest.mark.parametrize(("body", "problem", "outcome"), [
    (_events(_chunk(""), _chunk("alpha"), _chunk(" bravo", "length"), "[DONE]"), None,
     Outcome.OK),
    (_events(_chunk("alpha", "stop"), {"choices": [], "usage": {"total_tokens": 9}},
             "[DONE]"), None, Outcome.OK),  # the usage event after the finish
    (_events(_chunk("alpha"), OOM_EVENT, "[DONE]"), "oom", Outcome.OOM),  # in-band OOM
    (_events(_chunk("alpha"), {"error": {"message": "m", "type": "t", "code": "internal_error"}},
             "[DONE]"), "internal_error", Outcome.SERVER_ERROR),
    (_events(_chunk("alpha"), {"error": {"message": "m"}}, "[DONE]"), "error",
     Outcome.SERVER_ERROR),
    (_events(_chunk("alpha"), OOM_EVENT), "oom", Outcome.OOM),  # and cut short
    # a queued stream (position comments, then the role) not admitted in time: refused
    (b": queued position=2 eta_ms=900\n\n" + _events(
        {"error": {"message": "m", "type": "overloaded", "code": "queue_timeout",
                   "retry_after_ms": 1500}}, "[DONE]"), "queue_timeout", Outcome.REFUSED),
    (_events(_chunk("alpha"), _chunk(" bravo", "length")), "no_done", Outcome.SERVER_ERROR),
    (_events(_chunk("alpha")) + b"data: {\"choi", "no_done", Outcome.SERVER_ERROR),
    (_events(_chunk("alpha"), "[DONE]"), "no_finish_reason", Outcome.SERVER_ERROR),
    (_events("[DONE]", _chunk("a", "stop"), "[DONE]"), "not_json", Outcome.SERVER_ERROR),
    (b"", "no_done", Outcome.SERVER_ERROR), (None, "no_done", Outcome.SERVER_ERROR),
])
def test_a_stream_is_ok_only_when_complete_without_an_error_event(
        body: bytes | None, problem: str | None, outcome: Outcome) -> None:
    assert stream_problem(body) == problem
    assert stream_outcome(problem) is outcome
    assert outcome.is_failure is (problem is not None and outcome is not Outcome.REFUSED)


def test_sse_data_reads_events_as_the_standard_says() -> None:
    text = ": a comment\r\nevent: x\r\ndata: one\r\ndata:two\r\n\r\nid: 3\n\ndata: [DONE]\n\n"
    assert sse_data(text) == ["one\ntwo", "[DONE]"]
    assert sse_data(b"data:  spaced\n\n") == [" spaced"]  # only one space is dropped
    # an event the stream ends in (no blank line after it) is not dispatched
    assert sse_data("data: one\n\ndata: [DONE]\n") == sse_data("data: one\n\ndata: [DO") == \
        ["one"]


def test_the_chat_route_s_streams_read_as_complete() -> None:
    from deployments.http.routes.chat import _ChatReply
    from deployments.http.routes.generation import _sse

    reply = _ChatReply("chatcmpl-1", 0, "fake")
    events = [*reply.opening(), reply.piece("alpha", None), reply.piece(" bravo", "length"),
              reply.usage_event(9, 2)]
    whole = "".join(_sse(e) for e in events) + "data: [DONE]\n\n"
    assert stream_problem(whole.encode()) is None
    cut = "".join(_sse(e) for e in events[:2]) + _sse(OOM_EVENT) + "data: [DONE]\n\n"
    assert stream_problem(cut) == "oom"


def test_a_queued_stream_refused_in_band_carries_its_wait() -> None:
    from deployments.http.routes.completions import _Completion
    from deployments.http.routes.generation import _in_band, render
    from serve_app.errors import OverloadedError
    from serve_app.stream_events import Queued

    body = _in_band(OverloadedError("late", code="queue_timeout", retry_after_s=1.25))
    assert body["error"]["code"] == "queue_timeout" and body["error"]["retry_after_ms"] == 1250
    reply = _Completion("cmpl-1", 1, "m")
    assert render(Queued(3, 420), reply, False) == [": queued position=3 eta_ms=420\n\n"]
    assert render(Queued(0, None), reply, False) == [": queued position=0\n\n"]
    [comment] = render(Queued(1, 5), reply, False)
    assert sse_data(comment) == []  # ignored by clients


# --- bodies, mixes, prices -----------------------------------------------------------------


def test_the_load_test_card_allows_what_the_bodies_ask() -> None:
    from loadtest.runner import config_args

    fake = config_args("loadtest/configs/fake_small_card.yaml")
    assert fake["limits"] == {"max_inputs": 8, "max_input_tokens": 256, "max_tokens": 256}
    assert fake["fake"].get("max_seq_tokens", 2048) == 2048  # the default context
    minilm = config_args("loadtest/configs/minilm_cpu.yaml")["limits"]
    assert minilm == {"max_inputs": 8, "max_input_tokens": 256}


def test_the_chat_mix_is_completions_and_chat_only() -> None:
    assert MIXES["chat"].weights == {"CompletionUser": 1, "ChatUser": 1}
    assert kind_shares(MIXES["chat"]) == {"completion": 0.5, "chat": 0.5}
    assert USER_KINDS["ChatUser"] == "chat" and payloads.ROUTES["chat"] == "/v1/chat/completions"
    # in the heterogeneous mix with the weight of the completions; never for an embedder
    assert MIXES["mixed"].weights["ChatUser"] == MIXES["mixed"].weights["CompletionUser"] == 2
    assert "ChatUser" not in MIXES["mixed_embed"].weights


def test_chat_bodies_are_seeded_greedy_and_about_half_streamed() -> None:
    from deployments.engines.words import WordFrontEnd

    rng = random.Random(5)
    bodies = [payloads.chat_body(rng) for _ in range(1000)]
    again = random.Random(5)
    assert bodies[:20] == [payloads.chat_body(again) for _ in range(20)]
    front = WordFrontEnd(2048)
    for body in bodies:
        system, user = body["messages"]
        assert (system["role"], user["role"]) == ("system", "user")
        s, u = len(system["content"].split()), len(user["content"].split())
        assert 4 <= s <= 12 and 8 <= u <= 24
        assert body["temperature"] == 0 and 8 <= body["max_tokens"] <= 256
        kind, [ids], params, stream = payloads.tokenized(front, body)
        assert kind == "generate" and len(ids) == s + u + 5  # 3 role words + 2 special
        assert params == GenerationParams(max_tokens=body["max_tokens"], temperature=0.0)
        assert stream is body["stream"]
    new_tokens = [b["max_tokens"] for b in bodies]
    assert min(new_tokens) == 8 and max(new_tokens) == 256  # the whole range is drawn
    assert 450 <= sum(b["stream"] for b in bodies) <= 550


def test_the_slot_count_prices_chat_as_its_chat_template_renders_it() -> None:
    from deployments.engines.fake import exact_cost_model
    from deployments.engines.words import WordFrontEnd
    from loadtest.prices import SAMPLES_PER_KIND, slots_for
    from loadtest.runner import config_args
    from serve_app.memory.cost_model import CorrectedCostModel

    status = {"cost_model": CorrectedCostModel(exact_cost_model(MiB, 0)).published(),
              "measured_budget_bytes": 4608 * MiB}  # the card's: 1 MiB per token
    slots = slots_for(config_args("loadtest/configs/fake_small_card.yaml"), [status], "chat")
    assert slots["shares"] == {"completion": 0.5, "chat": 0.5}
    rng, front = random.Random(0), WordFrontEnd(2048)  # the bodies slots_for drew, in order
    for kind in ("completion", "chat"):
        sizes = [len(ids[0]) + params.max_tokens for _, ids, params, _ in (
            payloads.tokenized(front, payloads.BODIES[kind](rng))
            for _ in range(SAMPLES_PER_KIND))]
        exact = sum(sizes) / len(sizes) * MiB  # prompt + max_tokens, before any padding
        # leased padded to whole 16-token blocks: at most 2 x 15 tokens more
        assert exact <= slots["mean_price_by_kind"][kind] <= exact + 30 * MiB, kind
    assert slots["mean_price_by_kind"]["chat"] > 2 * slots["mean_price_by_kind"]["completion"]
    assert slots["slots"] == 4608 * MiB // slots["mean_price_bytes"]


# --- the report ------------------------------------------------------------------------------


def _row(baseline: str, ok_rps: float) -> dict:
    return {"baseline": baseline, "throughput_rps": ok_rps, "oom": 0, "replica_ooms": 0,
            "status_codes": {}}


def test_the_report_runs_the_fake_card_under_both_mixes_with_their_goals() -> None:
    from loadtest.report import WORKLOADS

    by_key = {w.key: w for w in WORKLOADS}
    assert list(by_key) == ["fake", "fake-chat", "minilm"]  # file names stay apart
    fake, chat = by_key["fake"], by_key["fake-chat"]
    assert (fake.engine, fake.mix, fake.goal) == ("fake", "mixed", 1.5)
    assert (chat.engine, chat.mix, chat.goal, chat.spike) == ("fake", "chat", 3.0, False)
    assert chat.config == fake.config == "loadtest/configs/fake_small_card.yaml"
    assert (chat.users, chat.pace_rps) == (fake.users, fake.pace_rps)  # 15 req/s offered
    assert by_key["minilm"].goal is None


def test_a_workload_goal_is_the_throughput_ratio_to_reach() -> None:
    section = {"engine": "fake", "name": "fake-chat", "mix": "chat", "goal": 3.0,
               "spikes": [], "rows": [_row("budget", 7.5), _row("semaphore(1)", 2.4)]}
    [line] = verdicts({"workloads": [section]})
    assert line == ("- fake-chat, `chat` mix: budget has 0 OOM 503s (0 on the replica), 0 500s, "
                    "7.5 req/s vs semaphore(1) 2.4 req/s (3.12x, goal >= 3x): holds.")
    section["rows"][0]["throughput_rps"] = 7.0  # 2.92x: above semaphore(1), below the goal
    assert verdicts({"workloads": [section]})[0].endswith(
        "7.0 req/s vs semaphore(1) 2.4 req/s (2.92x, goal >= 3x): DOES NOT hold.")
    section["rows"][0].update(throughput_rps=9.6, replica_ooms=1)  # 4x, but an OOM
    assert verdicts({"workloads": [section]})[0].endswith("(4.00x, goal >= 3x): DOES NOT hold.")
    section["rows"][0].update(replica_ooms=0, oom=3)  # OOM 503s (in-band ones included)
    assert verdicts({"workloads": [section]})[0].endswith("(4.00x, goal >= 3x): DOES NOT hold.")
    section["rows"][0].update(oom=0)
    assert verdicts({"workloads": [section]})[0].endswith("(4.00x, goal >= 3x): holds.")
