"""Waiting before a replica accepts a request is bounded too: with ``max_ongoing_requests``
reached, requests wait in Ray Serve's handle queue at the ingress, which Ray bounds in length
but not in time. The ingress gives up after ``admission.max_queue_wait_s`` (503
``queue_timeout`` with ``Retry-After``), and the replica counts the time already spent, so an
admitted request's whole queue wait stays within the bound (found by the load test's 10x
spike: admitted p99 27 s against a 14.8 s bound)."""

from __future__ import annotations

import pytest

from tests.support import embed_at_once, fake_app_args, settled_scrape, total, wait_for

MAX_QUEUE_WAIT_S = 1.0


@pytest.fixture(scope="module")
def app(deploy):
    # One request at a time reaches the replica (max_ongoing_requests 1), each taking about
    # 0.5 s (12 tokens x 40 ms): of 8 sent at once, the later ones wait at the ingress. Small
    # limits keep the start-up profile (which runs at this speed too) to a few seconds.
    # Refusal by prediction is off: with it, the ingress refuses most of the eight at arrival
    # (``predicted_timeout``, tested in test_queue_position_http and test_wait_prediction),
    # and the bound on the wait that this module is about would go untested.
    return deploy(fake_app_args(
        fake={"latency_per_token_s": 0.04},
        limits={"max_inputs": 1, "max_input_tokens": 16, "max_tokens": 1},
        admission={"max_queue_wait_s": MAX_QUEUE_WAIT_S, "max_queue_len": 8,
                   "refuse_predicted_waits": False},
        deployment={"max_ongoing_requests": 1},
        batching={"enabled": False}))


async def test_a_request_no_replica_accepts_in_time_is_refused_and_no_wait_exceeds_the_bound(
        app):
    # Normally two of the eight are admitted (the second after waiting for the first); a
    # loaded machine may admit only the first within the bound (seen once on CI), so up to
    # three rounds are sent until a request that waited was admitted. Every round's refusals
    # and admitted waits are checked.
    waits_ms: list[float] = []
    for _ in range(3):
        responses = await embed_at_once(app.base_url, 8)
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        print(f"\n8 at once, one at a time: {len(ok)} x 200, "
              f"{[(r.status_code, r.json()['error']['code']) for r in refused]}")
        assert ok and refused
        for r in refused:
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text
            assert int(r.headers["retry-after"]) >= 1
        # Queue wait reported by the replica: the way to it, the lease and the thread, in all.
        waits_ms += [float(r.headers["x-queue-wait-ms"]) for r in ok]
        assert max(waits_ms) <= MAX_QUEUE_WAIT_S * 1000 * 1.05, waits_ms
        if len(ok) > 1:
            break
    assert max(waits_ms) > 300, waits_ms  # the later admitted ones did wait on their way
    app.check_invariants()


def refusals_by_deployment(samples: dict) -> dict[str, float]:
    name = "vramgate_admission_decisions_total"
    return {deployment: total(samples, name, deployment=deployment, outcome="rejected",
                              reason="queue_timeout")
            for deployment in ("Ingress", "ModelServer")}


async def test_requests_still_in_ray_serves_handle_queue_are_refused_by_the_ingress(app):
    # Each request takes >= 0.48 s and the replica takes one at a time, so when the 1 s bound
    # ends at most 3 of the 8 have reached it: the others are still in Ray Serve's handle
    # queue at the ingress, which must refuse them itself (were it to wait, the replica would
    # refuse them later, on arrival, after up to 4 s: the replica-side check alone passes the
    # test above).
    # The test before this one was refused too: its counts must be in the baseline.
    before = refusals_by_deployment(settled_scrape(app.base_url, refusals_by_deployment))
    responses = await embed_at_once(app.base_url, 8)
    refused = [r for r in responses if r.status_code == 503]
    assert len(refused) >= 5, [r.status_code for r in responses]
    after = refusals_by_deployment(wait_for(
        app.base_url, lambda s: sum(refusals_by_deployment(s).values())
        >= sum(before.values()) + len(refused)))
    by_ingress = after["Ingress"] - before["Ingress"]
    by_replica = after["ModelServer"] - before["ModelServer"]
    print(f"\n{len(refused)} refused: {by_ingress:g} by the ingress, {by_replica:g} by the "
          "replica")
    assert by_ingress + by_replica == len(refused)
    assert by_ingress >= 5
    app.check_invariants()
