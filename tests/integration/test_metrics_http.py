"""``GET /metrics``: exact deltas after a known workload, parsed with prometheus-client's own
parser; whole-cluster figures whatever the number of model or ingress replicas."""

from __future__ import annotations

import httpx

from tests.support import MiB, by_label, fake_app_args, scrape, total, wait_for


def test_exact_deltas_after_100_requests_of_which_20_are_refused(deploy):
    # Two model replicas, a 40 MiB budget each at 1 MiB per token.
    app = deploy(fake_app_args(
        fake={"bytes_per_token": MiB},
        memory={"budget_bytes": 40 * MiB},
        limits={"max_inputs": 8, "max_input_tokens": 16, "max_tokens": 4},
        # Priced exactly (no padding for batching): the ratio histogram then shows 1.0.
        batching={"pad_to_multiple_of": 1},
        deployment={"num_replicas": 2}))
    before = scrape(app.base_url)
    admitted0 = total(before, "vramgate_admission_decisions_total", outcome="admitted")
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        for i in range(100):
            if i % 5 == 4:  # 20 requests of 8 x 16 tokens = 128 MiB > the 40 MiB budget
                response = http.post("/v1/embeddings", json={"input": ["w " * 14] * 8})
                assert response.status_code == 400, response.text
            else:
                response = http.post("/v1/embeddings", json={"input": f"request {i}"})
                assert response.status_code == 200, response.text
        for _ in range(5):  # idempotent replays never reach a model replica
            replay = http.post("/v1/embeddings", json={"input": "request 0"},
                               headers={"Idempotency-Key": "metrics-test"})
            assert replay.status_code == 200
    after = wait_for(app.base_url, lambda s: total(
        s, "vramgate_admission_decisions_total", outcome="admitted") >= admitted0 + 81
        and total(s, "vramgate_idempotency_hits_total") >= 4)

    def delta(name: str, **match: str) -> float:
        return total(after, name, **match) - total(before, name, **match)

    # 80 + the first idempotent request (it ran); its 4 repeats were replayed.
    assert delta("vramgate_admission_decisions_total", outcome="admitted") == 81
    assert delta("vramgate_admission_decisions_total", outcome="rejected") == 20
    assert delta("vramgate_admission_decisions_total", outcome="rejected",
                 reason="request_too_large") == 20
    assert delta("vramgate_admission_decisions_total", outcome="cancelled") == 0
    assert delta("vramgate_idempotency_hits_total", outcome="replayed") == 4
    assert delta("vramgate_http_requests_total", route="/v1/embeddings", status="200") == 85
    assert delta("vramgate_http_requests_total", route="/v1/embeddings", status="400") == 20
    assert delta("vramgate_queue_wait_seconds_count") == 81
    assert delta("vramgate_inference_seconds_count") == 81
    assert delta("vramgate_request_measured_over_estimated_count") == 81
    # The fake engine's cost is exact: every ratio falls in the (0.9, 1.0] bucket.
    assert delta("vramgate_request_measured_over_estimated_bucket", le="0.9") == 0
    assert delta("vramgate_request_measured_over_estimated_bucket", le="1.0") == 81
    # Both replicas did work, and each has its gauges.
    admitted = by_label(after, "vramgate_admission_decisions_total", "replica")
    assert len(admitted) == 2 and all(v > 0 for v in admitted.values())
    budgets = by_label(after, "vramgate_budget_bytes", "replica")
    assert budgets == {r: 40 * MiB for r in admitted}
    assert set(by_label(after, "vramgate_device_allocated_bytes", "replica")) == set(admitted)
    assert all(v == 0 for v in by_label(after, "vramgate_reserved_bytes", "replica").values())


def test_two_ingress_replicas_neither_double_nor_go_backwards(deploy):
    app = deploy(fake_app_args(deployment={"ingress_replicas": 2},
                               limits={"max_inputs": 1, "max_input_tokens": 16, "max_tokens": 4}))
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        start = total(scrape(app.base_url), "vramgate_http_requests_total",
                      route="/v1/embeddings")
        previous = start
        ingress_replicas: set[str] = set()
        for i in range(60):
            assert http.post("/v1/embeddings", json={"input": f"x {i}"}).status_code == 200
            if i % 6 == 5:  # scrapes land on either ingress replica
                samples = scrape(app.base_url)
                for name, labels in samples:
                    if name == "vramgate_http_requests_total":
                        ingress_replicas.add(dict(labels)["replica"])
                seen = total(samples, "vramgate_http_requests_total", route="/v1/embeddings")
                assert seen >= previous, "a counter went backwards between scrapes"
                previous = seen
    final = wait_for(app.base_url, lambda s: total(
        s, "vramgate_http_requests_total", route="/v1/embeddings") >= start + 60)
    assert total(final, "vramgate_http_requests_total", route="/v1/embeddings") == start + 60
    assert len(ingress_replicas) == 2  # both counted, each once
