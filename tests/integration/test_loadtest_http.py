"""The load test end to end, briefly: ``locust --headless`` with the heterogeneous mix through
a 10x spike against the budget policy on the load-test card (``loadtest/configs/
fake_small_card.yaml``, without its time per forward pass so that its start-up profile takes
seconds, and a queue of 4 waiting at most 1 s so that the spike is refused too).
Every non-2xx must be a 503 with ``Retry-After``, the budget must keep the device from running
out of memory, and the replica must be idle afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.prices import slots_for
from loadtest.runner import RunSpec, Scraper, config_args, run_locust
from loadtest.scenarios import BASELINES, apply_overrides
from loadtest.summary import run_row

CONFIG = "loadtest/configs/fake_small_card.yaml"


@pytest.fixture(scope="module")
def app(deploy):
    # A short queue and wait, so that the spike is refused as well as served.
    args = apply_overrides(config_args(CONFIG), {
        "fake.latency_per_pass_s": 0.0, "admission.policy": "budget",
        "admission.max_queue_len": 4, "admission.max_queue_wait_s": 1.0})
    return deploy(args)


def test_a_short_spike_is_refused_with_retry_after_and_never_runs_out_of_memory(
        app, tmp_path: Path) -> None:
    spec = RunSpec(label="it-spike", engine="fake", config=CONFIG, baseline=BASELINES[0],
                   mix="mixed", shape="spike", base_users=4, pace_rps=1.0, shape_seconds=10.0)
    scraper = Scraper(app.base_url)
    before = scraper.scrape()
    outcomes = run_locust(spec, app.base_url, tmp_path)
    replicas = app.check_invariants()  # idle: nothing reserved, queued or leaked
    row = run_row(outcomes, before, scraper.scrape(),
                  max_queue_wait_s=app.args["admission"]["max_queue_wait_s"])
    print(f"\nspike: {outcomes['status_codes']}, audit {outcomes['audit']}")
    assert row["ok"] > 20 and row["refused"] > 0
    assert row["non_2xx_all_503_retry_after"], outcomes["status_codes"]
    assert row["oom"] == 0 and row["5xx"] == 0 and row["4xx"] == 0 and row["error"] == 0
    assert row["replica_ooms"] == 0 and all(r["oom_count"] == 0 for r in replicas)
    audit = outcomes["audit"]
    assert audit.get("not_request_id_echoed", 0) == 0
    assert audit.get("not_503_with_retry_after", 0) == 0
    assert audit.get("not_replay_identical", 0) == 0
    assert (tmp_path / "locust_stats_history.csv").stat().st_size > 0


def test_the_slot_count_baseline_prices_the_mix_as_the_replicas_do(app) -> None:
    [replica] = app.check_invariants()
    slots = slots_for(app.args, [replica], "mixed")
    prices = slots["mean_price_by_kind"]
    # 1 MiB per token (the card's cost, which the profile fits exactly): a short input (8-16
    # tokens) is priced padded to 16, a long request as 4 inputs padded to 208-224 tokens.
    assert prices["short"] == pytest.approx(16 << 20, rel=1e-3)
    assert (4 * 208 << 20) * 0.999 <= prices["long"] <= (4 * 224 << 20) * 1.001
    assert slots["budget_bytes"] == replica["measured_budget_bytes"]
    assert 1 <= slots["slots"] <= slots["budget_bytes"] // prices["short"]
