"""Overload beyond the ingress's cap is refused at the door: with
``deployment.ingress_max_ongoing_requests`` requests at the ingress and
``deployment.ingress_max_queued_requests`` more waiting at Ray Serve's HTTP proxy, the proxy
answers the next ones 503 with ``Retry-After: ingress_retry_after_s`` at once (Ray Serve's
``max_queued_requests`` and ``backpressure_config``), without the ingress seeing them. Found by
``benchmarks.vllm``'s overload at 10x capacity on 2 cores: without a bound at the door every
request waited past its client's 10 s deadline, none was refused."""

from __future__ import annotations

import pytest

from tests.support import embed_at_once, fake_app_args

SENT = 8
INGRESS_ONGOING = 2
INGRESS_QUEUED = 1


@pytest.fixture(scope="module")
def app(deploy):
    # Each embedding takes about 0.6 s (12 tokens x 50 ms), long enough that all eight arrive
    # while the first ones are still at the ingress. Refusal by prediction is off, so that
    # whatever reaches the ingress is answered 200.
    return deploy(fake_app_args(
        fake={"latency_per_token_s": 0.05},
        limits={"max_inputs": 1, "max_input_tokens": 16, "max_tokens": 1},
        admission={"max_queue_wait_s": 30, "refuse_predicted_waits": False},
        deployment={"ingress_max_ongoing_requests": INGRESS_ONGOING,
                    "ingress_max_queued_requests": INGRESS_QUEUED,
                    "ingress_retry_after_s": 3},
        batching={"enabled": False}))


async def test_requests_beyond_the_ingress_cap_and_the_proxy_queue_get_503_with_retry_after(
        app):
    responses = await embed_at_once(app.base_url, SENT)
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    print(f"\n{SENT} at once, {INGRESS_ONGOING} at the ingress and {INGRESS_QUEUED} waiting: "
          f"{len(ok)} x 200, {len(refused)} refused")
    # Ray counts a request as queued until it is assigned to an ingress replica, so of
    # requests arriving at once it may refuse all but the first INGRESS_QUEUED, more than the
    # bound requires (its own comment in ray/serve/_private/router.py, wrap_request_assignment:
    # "with max_queued_requests=1 and 4 simultaneous requests ... requests 2,3,4 get
    # rejected"); never fewer while all arrive within the first one's 0.6 s. The first
    # INGRESS_QUEUED are queued, and a queued request is served.
    assert len(refused) >= SENT - INGRESS_ONGOING - INGRESS_QUEUED
    assert len(ok) >= INGRESS_QUEUED
    for r in refused:
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "3"
        assert "backpressure" in r.text
    for r in ok:
        assert len(r.json()["data"][0]["embedding"]) > 0
    app.check_invariants()
