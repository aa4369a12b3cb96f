"""BENCHMARKS.md from a report's summary (:func:`loadtest.report.run_report`). Pure text.

Everything in the page is computed from the summary, verdicts included, so that one command
regenerates it; the prose around the figures says how they were measured and what the
setup's numbers mean.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import tenants
from loadtest import vllm_section
from loadtest.outcomes import Outcome
from loadtest.scenarios import BASELINES, MIXES, SHAPES, SPIKE_MULTIPLE
from loadtest.summary import markdown_table

STEADY_COLUMNS = (("baseline", "baseline"), ("ray_max_ongoing", "max_ongoing_requests"),
                  ("offered_rps", "offered req/s"), ("arrival_rps", "sent req/s"),
                  ("throughput_rps", "2xx req/s"),
                  ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"), ("refused", "refused"),
                  ("queue_timeout", "of which queue_timeout (full wait)"),
                  ("predicted_timeout", "of which predicted_timeout (at once)"),
                  ("refused_p99_ms", "503 p99 ms"),
                  ("oom", "OOM 503s"), ("replica_ooms", "replica OOMs"), ("5xx", "other 5xx"),
                  ("other_failures", "4xx / no answer"), ("aborted", "aborted"),
                  ("idle_ok", "idle after"))
SPIKE_COLUMNS = (("baseline", "run"), ("capacity_rps", "capacity req/s"),
                 ("spike_offered_rps", f"{SPIKE_MULTIPLE:g}x offered req/s"),
                 ("arrival_rps", "sent req/s (whole run)"), ("throughput_rps", "2xx req/s"),
                 ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
                 ("inference_p99_s", "p99 inference s"),
                 ("latency_bound_ms", "bound ms"), ("within_bound", "p99 within bound"),
                 ("refused", "refused"),
                 ("queue_timeout", "of which queue_timeout (full wait)"),
                 ("predicted_timeout", "of which predicted_timeout (at once)"),
                 ("refused_p99_ms", "503 p99 ms"),
                 ("oom", "OOM 503s"), ("5xx", "other 5xx"),
                 ("other_failures", "4xx / no answer"),
                 ("non_2xx_all_503_retry_after", "every non-2xx a 503 + Retry-After"),
                 ("idle_ok", "idle after"))


def _derived(row: Mapping[str, Any]) -> dict[str, Any]:
    return {**row, "other_failures": row.get("4xx", 0) + row.get("error", 0),
            "idle_ok": not row.get("leaks")}


def summary_tables(report: Mapping[str, Any]) -> str:
    """The tables alone (what the command prints at the end)."""
    parts = []
    for section in report["workloads"]:
        parts.append(f"{section['title']} ({section['mix']} mix, steady)\n"
                     + markdown_table([_derived(r) for r in section["rows"]], STEADY_COLUMNS))
        if section["spikes"]:
            parts.append(f"{section['title']} ({section['mix']} mix, "
                         f"{SPIKE_MULTIPLE:g}x spike)\n"
                         + markdown_table([_derived(r) for r in section["spikes"]],
                                          SPIKE_COLUMNS))
    return "\n\n".join(parts) + "\n\n" + "\n".join(verdicts(report))


def _row(section: Mapping[str, Any], baseline: str) -> Mapping[str, Any] | None:
    return next((r for r in section["rows"] if r["baseline"] == baseline), None)


# Throughputs closer than this are not told apart: run-to-run variation on the shared 2-core
# machine (the same baseline measured 6.8 and 8.7 req/s an hour apart while the machine's other
# work changed).
SAME_THROUGHPUT_RATIO = 1.05


def _count_500(row: Mapping[str, Any]) -> int:
    return sum(n for code, n in row.get("status_codes", {}).items() if code.startswith("500"))


def _name(section: Mapping[str, Any]) -> str:
    """The workload's name in labels and file names (its engine's, before workloads had
    names)."""
    return section.get("name") or section["engine"]


def _throughput_verdict(section: Mapping[str, Any], budget: Mapping[str, Any],
                        sem: Mapping[str, Any]) -> str:
    """Budget vs semaphore(1): zero OOMs and 500s, and the throughput ratio at least the
    workload's ``goal`` (without one: not told apart from, or above, semaphore(1))."""
    safe = budget["oom"] == 0 and budget["replica_ooms"] == 0 and _count_500(budget) == 0
    ratio = budget["throughput_rps"] / max(sem["throughput_rps"], 1e-9)
    goal = section.get("goal")
    if goal is not None:
        verdict = "holds" if safe and ratio >= goal else "DOES NOT hold"
    elif not safe or ratio < 1 / SAME_THROUGHPUT_RATIO:
        verdict = "DOES NOT hold"
    elif ratio < SAME_THROUGHPUT_RATIO:
        verdict = (f"zero OOMs and 500s hold; the throughputs are within "
                   f"{SAME_THROUGHPUT_RATIO - 1:.0%} of each other (not told apart: "
                   "see the notes)")
    else:
        verdict = "holds"
    goal_text = "" if goal is None else f", goal >= {goal:g}x"
    return (f"- {_name(section)}, `{section['mix']}` mix: budget has {budget['oom']} OOM "
            f"503s ({budget['replica_ooms']} on the replica), {_count_500(budget)} 500s, "
            f"{budget['throughput_rps']} req/s vs semaphore(1) {sem['throughput_rps']} "
            f"req/s ({ratio:.2f}x{goal_text}): {verdict}.")


def verdicts(report: Mapping[str, Any]) -> list[str]:
    """The issue's done-when conditions, each with its figures and ``holds`` / ``DOES NOT
    hold``."""
    lines = []
    for section in report["workloads"]:
        name = _name(section)
        budget, sem = _row(section, "budget"), _row(section, "semaphore(1)")
        if budget and sem:
            lines.append(_throughput_verdict(section, budget, sem))
        for row in (_row(section, "none"), _row(section, "slots")):
            if row:
                shows = row["oom"] > 0 or row["replica_ooms"] > 0
                lines.append(
                    f"- {name}, {row['baseline']} "
                    f"(max_ongoing_requests {row.get('ray_max_ongoing')}): "
                    f"{row['oom']} OOM 503s, {row['replica_ooms']} OOMs on the replica: "
                    f"{'shows OOMs' if shows else 'no OOMs (see the notes)'}.")
        for spike in section["spikes"]:
            all_503 = spike["non_2xx_all_503_retry_after"]
            lines.append(
                f"- {name}, {SPIKE_MULTIPLE:g}x spike, {spike['baseline']}: "
                f"{spike['non_2xx']} non-2xx, "
                f"{'all' if all_503 else 'NOT all'} 503 with Retry-After "
                f"({spike['refused']} refused + {spike['oom']} oom); p99 of admitted "
                f"{spike['p99_ms']} ms vs bound {spike['latency_bound_ms']} ms "
                f"(max_queue_wait_s {spike['max_queue_wait_s']:g} + p99 inference "
                f"{spike['inference_p99_s']} s): "
                f"{'holds' if all_503 and spike['within_bound'] else 'DOES NOT hold'}.")
    return lines


CONTRACT_CHECKS = (
    "Request ids not echoed (`X-Request-Id`), 503s without a valid `Retry-After`, "
    "idempotent replays answered identically (`Idempotent-Replayed: true`, same body), "
    "streamed answers complete (of the 200s: ending with `data: [DONE]`, a `finish_reason`, "
    "no in-band error; a status `200 stream <problem>` is one that was not), retries after "
    "`Retry-After` with the same `Idempotency-Key`, every status seen (`0` = no answer: the "
    "aborting clients' socket timeouts), and what the idle invariants found once the "
    "load stopped (reserved bytes, queue, leases, running inferences, charged == released).")
CONTRACT_COLUMNS = (
    ("run", "run"), ("requests", "requests"), ("ids", "ids not echoed"),
    ("ra", "503 without Retry-After"), ("replays", "replays identical"),
    ("streams", "streams complete"), ("retry_after", "Retry-After s min / median / max"),
    ("retries", "keyed retries"), ("codes", "statuses"), ("leaks", "idle after"))


def _contract_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for section in report["workloads"]:
        for row in [*section["rows"], *section["spikes"]]:
            audit = row.get("audit", {})
            replays = audit.get("replay_identical", 0) + audit.get("not_replay_identical", 0)
            streams = audit.get("stream_complete", 0) + audit.get("not_stream_complete", 0)
            waits = sorted(int(k) for k, n in row.get("retry_after_s", {}).items()
                           for _ in range(n) if k.isdigit())
            rows.append({
                "run": f"{_name(section)} {row['shape']} {row['baseline']}",
                "retry_after": (f"{waits[0]} / {waits[len(waits) // 2]} / {waits[-1]}"
                                if waits else "-"),
                "requests": audit.get("requests", 0),
                "ids": audit.get("not_request_id_echoed", 0),
                "ra": audit.get("not_503_with_retry_after", 0),
                "replays": f"{audit.get('replay_identical', 0)} / {replays}",
                "streams": f"{audit.get('stream_complete', 0)} / {streams}",
                "retries": audit.get("idempotent_retries", 0),
                "codes": ", ".join(f"{k}: {v}" for k, v in sorted(
                    row.get("status_codes", {}).items())),
                "leaks": "; ".join(row.get("leaks", [])) or "none"})
    return rows


def render(report: Mapping[str, Any], out_dir: Path, page_dir: Path) -> str:
    """The whole BENCHMARKS.md; images are linked relative to ``page_dir``."""
    def img(name: str) -> str:
        return os.path.relpath(out_dir / name, page_dir)

    m = report["machine"]
    lines = [
        "# Benchmarks: memory-budget admission under load",
        "",
        "Generated by `" + report["command"] + "` "
        f"({report['elapsed_s'] / 60:.0f} min, {m['date']}); do not edit by hand: change "
        "`loadtest/` and run it again. `python -m loadtest.run report --quick` is a "
        "~9-minute smoke run of the fake-engine part (written to `loadtest/results/quick/`).",
        "",
        f"**Machine:** {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, "
        f"{m['os']}; Python {m['python']}, Ray {m['ray']}, locust {m['locust']}, torch "
        f"{m['torch']}. Service, load generator and metrics scraper share the cores (loopback "
        "only); other work on the machine at the time was not controlled.",
        "",
        *_method_lines(report),
        "",
        "## Done-when",
        "",
        *verdicts(report),
        "",
    ]
    for section in report["workloads"]:
        lines += _section_lines(section, img)
    if report.get("tenants"):
        lines += tenants.section_lines(report["tenants"])
    if report.get("vllm"):
        lines += vllm_section.section_lines(report["vllm"])
    lines += [
        "## Contract checks (every run)",
        "",
        CONTRACT_CHECKS,
        "",
        markdown_table(_contract_rows(report), CONTRACT_COLUMNS),
        "",
        *NOTES,
    ]
    return "\n".join(lines) + "\n"


def _method_lines(report: Mapping[str, Any]) -> list[str]:
    baselines = "\n".join(f"- **{b.name}**: {b.description}." for b in BASELINES)
    shapes = "; ".join(f"`{s.name}`: {s.description}" for s in SHAPES.values())
    return [
        "## What is measured",
        "",
        "Each run deploys the config with one baseline's overrides on a fresh app, loads it "
        "with `locust --headless` (`loadtest/locustfile.py`) and scrapes `GET /metrics` every "
        "second. Each user sends one request per period (`constant_pacing`, first after a "
        "random phase), so the offered load is users x pace while requests take less than a "
        "period; *sent req/s* is what was actually sent (a user whose request outlasts its "
        "period sends its next one late). Outcomes (`loadtest/outcomes.py`): **2xx**; "
        "**refused** = 503 with `Retry-After` and a code other than `oom` (not a failure); "
        "**OOM 503s** = 503 `oom`, counted apart (the gate exists to prevent them), beside "
        "**replica OOMs**, the increase of the replicas' `vramgate_ooms_total` (one OOM fails "
        "every request of its batch); **other 5xx** (500, 504, a 503 without `Retry-After`); "
        "**4xx / no answer**; **aborted** = clients that hang up mid-request on purpose. "
        "Throughput is 2xx per second over the run; p50/p99 are client-side latencies of the "
        "2xx (locust's merged entries, which round to 2 significant digits above 100 ms). "
        "*p99 inference* comes from the replicas' `vramgate_inference_seconds` histogram "
        "(interpolated within buckets, as `histogram_quantile`).",
        "",
        f"Mixes: {'; '.join(f'`{k}`: {v.description}' for k, v in MIXES.items())}. "
        f"Shapes: {shapes}.",
        "",
        "Baselines, each its own deployment of the same config:",
        "",
        baselines,
    ]


def _kind_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per request kind (locust's entries), each steady run's 2xx as ``count: p50 / p99 ms``
    with its refusals and failures (:mod:`loadtest.outcomes`); nothing for rows without
    ``by_kind``."""
    kinds = sorted({kind for row in rows for kind in row.get("by_kind", {})})
    if not kinds:
        return []
    table = []
    for kind in kinds:
        entry = {"kind": f"`{kind}`"}
        for row in rows:
            figures = row.get("by_kind", {}).get(kind, {})
            ok = figures.get(Outcome.OK.value, {})
            refused = figures.get(Outcome.REFUSED.value, {}).get("count", 0)
            failed = sum(f["count"] for o, f in figures.items() if Outcome(o).is_failure)
            entry[row["baseline"]] = (f"{ok.get('count', 0)}: {ok.get('p50_ms') or '-'} / "
                                      f"{ok.get('p99_ms') or '-'}, {refused} refused, "
                                      f"{failed} failed")
        table.append(entry)
    return ["Per request kind (`chat_stream`: streamed chat answers, timed to their last "
            "event): each baseline's 2xx as count: p50 / p99 ms, then its refusals and "
            "failures.", "",
            markdown_table(table, [("kind", "kind"), *((r["baseline"], r["baseline"])
                                                       for r in rows)]), ""]


def _section_lines(section: Mapping[str, Any], img: Any) -> list[str]:
    engine = _name(section)
    slots = section.get("slots") or {}
    lines = [f"## {section['title']}", "",
             f"Config `{section['config']}`, mix `{section['mix']}`, steady shape for "
             f"{section['steady_s']:g} s at {section['users']} users x "
             f"{section['pace_rps']:g} req/s.", ""]
    if slots:
        by_kind = ", ".join(f"{k} {v / 2**20:.1f} MiB ({slots['shares'][k]:.0%})"
                            for k, v in slots["mean_price_by_kind"].items())
        lines += [
            f"**Slot count:** the budget run's replica measured a budget of "
            f"{slots['budget_bytes'] / 2**20:.0f} MiB; its published cost model prices the "
            f"mix's requests (200 seeded bodies per kind, tokenized and padded as the replica "
            f"does, `loadtest/prices.py`) at {by_kind} of the requests; weighted mean "
            f"{slots['mean_price_bytes'] / 2**20:.1f} MiB; `max_ongoing_requests` = "
            f"floor(budget / mean) = **{slots['slots']}**.", ""]
    lines += [markdown_table([_derived(r) for r in section["rows"]], STEADY_COLUMNS), "",
              *_kind_lines(section["rows"]),
              f"![{engine} comparison]({img(f'{engine}-steady-comparison.png')})", ""]
    for row in section["rows"]:
        lines.append(f"![{engine} {row['baseline']}]({img(row['label'] + '.png')})")
    lines.append("")
    if section["spikes"]:
        first = section["spikes"][0]
        lines += [
            f"### {SPIKE_MULTIPLE:g}x spike", "",
            f"The budget's steady throughput ({first['capacity_rps']} req/s) is the 1x load: "
            f"{first['base_users']} users x {first['pace_rps']:g} req/s = "
            f"{first['offered_rps']} req/s, then {first['peak_users']} users "
            f"({first['spike_offered_rps']} req/s) for two thirds of the "
            f"{section['spike_s']:g} s run."
            + (" The second run is the same with `deployment.max_ongoing_requests` raised so "
               "that no request waits in Ray Serve's handle queue."
               if len(section["spikes"]) > 1 else ""), "",
            markdown_table([_derived(r) for r in section["spikes"]], SPIKE_COLUMNS), ""]
        for row in section["spikes"]:
            lines.append(f"![{engine} spike {row['baseline']}]({img(row['label'] + '.png')})")
        lines.append("")
    return lines


NOTES: Sequence[str] = (
    "## Notes",
    "",
    "- **Why the fake card is 6 GiB.** `loadtest/configs/fake_small_card.yaml`: capacity "
    "6 GiB, weights 1 GiB, 1 MiB per token, so 5 GiB are free and the budget is 4.5 GiB "
    "(safety factor 0.9). The largest request the limits allow (8 x (256 + 256) tokens = "
    "4 GiB) fits, so every policy's replica starts. A long request of the load test (4 inputs "
    "of up to 222 tokens, priced padded to 224) costs 896 MiB: the budget runs five at once, "
    "but one full batch of them (32 inputs, 7 GiB) overruns the 5 GiB left on the card, and "
    "so does any ungated batch of more than 22 inputs padded to a long one's length.",
    "- **Why the fake card's time has a cost per pass.** Its time is 30 ms per forward pass "
    "(an embedding batch, a prefill, each generated token) + 0.6 ms per token of the padded "
    "batch (`fake.latency_per_pass_s`, `fake.latency_per_token_s`), as on a GPU, where a pass "
    "reads every weight once whatever its batch (Pope et al. 2022, 'Efficiently Scaling "
    "Transformer Inference', sec. 2): a long request alone takes 0.57 s, a completion of 48 "
    "new tokens 1.5 s alone and about the same in a batch of four. Until the card had a cost "
    "per pass its time was linear in batch x tokens, a batch took as long as its members one "
    "after another, and `semaphore(1)` matched the budget's throughput (3.26 vs 2.93 req/s).",
    "- **Why so slow.** The replica's capacity must stay a few requests per second so that "
    "ten times it stays within what proxy, ingress and locust can carry on 2 cores. With a "
    "third of these times (10 ms per pass, 0.2 ms per token) the budget served 9.9 req/s, and "
    "its 10x spike (99 req/s offered) saturated the CPU: every answer, refusals included, "
    "took 9-19 s in the HTTP stack (admitted p99 19 s against a bound of 11 s). "
    "`max_queue_wait_s` is the default 10 s, well above the longest pass the budget allows "
    "(4608 tokens x 0.6 ms + 30 ms = 2.8 s; a decode step of 32 sequences, 49 ms).",
    "- **Budget vs semaphore(1) throughput.** `semaphore(1)` runs one request at a time, so "
    "each pays the fixed cost alone, and a completion or chat reply pays it once per new "
    "token. The budget runs what waited while the thread was busy as few passes as its "
    "leases allow: embeddings together, and completions and chat on token-level continuous "
    "batching (`deployments/replica/decode_loop.py`): each decode step advances every running "
    "sequence by one token, sequences join between steps as their KV-cache leases fit and "
    "leave when they finish, so up to `batching.max_batch_size` (32) sequences share a "
    "step's fixed cost and an 8-token reply does not wait for a 256-token one. On the fake "
    "card that is what the throughput difference is made of. MiniLM on one CPU thread is "
    "the other case: its time goes to long inputs whose forward pass is already "
    "compute-bound, so batching buys little there (`benchmarks/throughput.py` measures "
    "short inputs, where it does). On both, "
    "the budget also runs, without OOMs, what an ungated replica runs out of memory on, and "
    "does not pad short inputs to long ones (the `none` and `slots` rows lose throughput to "
    "that).",
    "- **Streams and chat.** A streamed answer starts (200) once its sequence has joined "
    "the running batch, so a refusal while it waits to join (`queue_timeout` after "
    "`max_queue_wait_s`) is a 503 with `Retry-After` like any other; what goes wrong after "
    "the first byte comes in-band and is counted by its code (`200 stream <code>` in the "
    "statuses). On continuous batching `admission.inference_timeout_s` bounds the time "
    "without a token, not a whole reply: decode steps take turns with embedding passes on "
    "the replica's one inference thread, so under the `mixed` load a long reply advances "
    "about one token per embedding pass (up to 2.8 s each here) and the longest chats (up to "
    "256 new tokens) take most of a minute: the mixed runs' p99. On completions and chat "
    "only, the budget leases each sequence its prompt + `max_tokens` from its start (the KV "
    "cache it may grow to), so it runs fewer sequences at once than `none` and `slots`, "
    "whose caches hold only what has been generated so far: its gate is fully reserved "
    "while the card is not (see the timelines), the price of never running out of memory.",
    "- **No OOMs on the real model is expected.** On CPU the replica's \"device\" is a "
    "2 GiB share of host memory, a budget of prices measured as resident-set growth; nothing "
    "raises an out-of-memory error when an unchecked batch exceeds it (the kernel would kill "
    "the process far later), and MiniLM's requests are small against it: the slot count "
    "comes out far above the concurrency the load reaches. The MiniLM rows compare "
    "throughput and latency; the OOM comparison is the fake engine's.",
    "- **Latency under overload.** `admission.max_queue_wait_s` bounds the whole wait of "
    "an admitted request: before it reaches a replica (in Ray Serve's handle queue at the "
    "ingress, while the replica has `max_ongoing_requests` in flight: the ingress gives up "
    "after the bound with 503 `queue_timeout`, and the replica counts the time spent on the "
    "way against the same bound), for a lease, and for a pass on the inference thread. "
    "What it does not bound is time outside the gate: the proxy and ingress when the CPU is "
    "saturated (here they share 2 cores with locust). Under the budget policy the derived "
    "`max_ongoing_requests` is what the budget admits at once counted at the smallest "
    "request's price (capped at 1024), so requests do not wait in the handle queue, and the "
    "report's second spike run with it set to 1000 by hand, which differed from the first "
    "only by noise, is left out when the derived figure is that high already. Joined from "
    "the Serve logs of one spike run (71 users at 1x, 35.5 req/s at 10x), the slowest "
    "admitted requests' client latency was their queue wait plus their inference to within "
    "50 ms: the tail is long chats that waited up to the bound and then decoded for 20-35 s. "
    "(Before the ingress bounded the handle queue, the first run's admitted p99 was 27 s "
    "against a 14.8 s bound; in the report of 2026-12-02, on a machine then about 3x slower "
    "(MiniLM 4.43 req/s at this load), 48 s against 39.2 s.)",
    "- **Refusals' latency (503 p99).** A refusal by prediction is decided at once, at the "
    "ingress from the replicas' published figures (before the body when even the smallest "
    "request could not start in time) or at the replica on arrival; its client still pays "
    "Ray Serve's HTTP path. Timed by the client in a steady fake-card run outside the report "
    "(312 refusals, all `predicted_timeout`): the 199 decided at the ingress took 8-24 ms "
    "at the median per kind, the 113 decided at the replica 19-44 ms, the slowest 78 ms (a "
    "keyed request: those skip the refusal before the body, as their key may have a stored "
    "answer, and ask the key store first). Three steady runs that day gave a 503 p99 of 58, "
    "63 and 64 ms. The report of 2026-12-02, with the same refusal paths, gave 830 ms on a "
    "machine then about 3x slower: on 2 shared cores this figure "
    "follows the CPU left to proxy and ingress, and in the 10x spike, where most requests "
    "are refused, it is seconds (its queue_timeouts count too).",
    "- Locust rounds response times above 100 ms to 2 significant digits; a p99 over a few "
    "hundred requests rests on its few slowest ones. The machine was shared with other work "
    "during the run; figures vary by some percent between runs.",
)
