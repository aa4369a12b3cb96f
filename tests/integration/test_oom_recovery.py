"""What a replica learns from an out-of-memory error: a request that needed more than its price
corrects the cost model (and the shape that cannot fit is then refused, not retried into OOM);
a canary with NaN output after an OOM gets the replica replaced without shrinking its budget."""

from __future__ import annotations

import time

import httpx

from deployments.replica.profiling import measure_replica
from serve_app.config import parse_args
from tests.support import MiB, fake_app_args

GiB = 1 << 30


def _replica(base_url: str, replica_id: str | None = None, **expect) -> dict:
    """The replica's published status once it shows ``expect`` (the registry is ~1 s behind)."""
    deadline = time.monotonic() + 10
    while True:
        replicas = httpx.get(f"{base_url}/v1/status").json()["replicas"]
        for replica in replicas:
            if replica_id in (None, replica["replica_id"]) and all(
                    replica.get(k) == v for k, v in expect.items()):
                return replica
        assert time.monotonic() < deadline, f"no replica shows {expect}: {replicas}"
        time.sleep(0.25)


def test_an_oom_above_the_price_corrects_the_cost_model(deploy, tmp_path):
    # A profile measured at 1 MiB per token, reused by a replica whose requests really take
    # 2 MiB per token (a stale profile: the checks on reuse cannot see per-token cost).
    def args(bytes_per_token: int, **memory) -> dict:
        return fake_app_args(
            fake={"device_capacity_bytes": 2 * GiB, "weights_bytes": 256 * MiB,
                  "bytes_per_token": bytes_per_token},
            memory={"reserve_bytes": 0, **memory},
            limits={"max_inputs": 16, "max_input_tokens": 64, "max_tokens": 4})

    profile_path = tmp_path / "profile.json"
    measure_replica(parse_args(args(MiB)), on_progress=lambda _: None).profile.save(profile_path)
    app = deploy(args(2 * MiB, profile_path=str(profile_path)))
    before = _replica(app.base_url)
    assert before["profile"]["reused"] is True
    assert before["cost_correction_factor"] == 1.0
    big = {"input": [" ".join(["w"] * 62)] * 16}  # 16 x 64 tokens: priced 1 GiB, takes 2 GiB
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        oom = http.post("/v1/embeddings", json=big)
        assert oom.status_code == 503, oom.text
        assert oom.json()["error"]["code"] == "oom"
        assert int(oom.headers["retry-after"]) >= 1
        after = _replica(app.base_url, before["replica_id"], oom_count=1)
        # The OOM said "Tried to allocate 2.00 GiB" for a request priced 1 GiB: prices x2.
        assert after["cost_correction_factor"] == 2.0
        assert after["cost_corrections"] == 1
        assert after["budget_shrink_count"] == 1
        assert after["device_fault"] is None
        # Now priced 2 GiB, more than the whole budget (0.9 x 1.75 GiB): refused, not run.
        refused = http.post("/v1/embeddings", json=big)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "request_too_large"
        small = http.post("/v1/embeddings", json={"input": ["a b c"]})
        assert small.status_code == 200, small.text
    final = _replica(app.base_url, before["replica_id"], inferences_total=2)
    assert final["oom_count"] == 1  # the refused request never reached the device
    app.check_invariants()


def test_nan_output_after_an_oom_replaces_the_replica_without_shrinking(deploy):
    app = deploy(fake_app_args(
        fake={"oom_probability": 1.0, "nan_after_oom": True},
        limits={"max_inputs": 1, "max_input_tokens": 16, "max_tokens": 4},
        deployment={"health_check_period_s": 3, "health_check_timeout_s": 5}))
    old = _replica(app.base_url)
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        oom = http.post("/v1/embeddings", json={"input": "a b"})
        assert oom.status_code == 503, oom.text
        assert oom.json()["error"]["code"] == "oom"
        faulted = _replica(app.base_url, old["replica_id"], oom_count=1)
        assert "NaN" in faulted["device_fault"]
        assert faulted["budget_shrink_count"] == 0
        assert faulted["budget_bytes"] == faulted["measured_budget_bytes"]
        assert faulted["cost_correction_factor"] == 1.0  # an injected OOM: price was right
        refused = http.post("/v1/embeddings", json={"input": "a b"})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] in ("draining", "oom", "no_replicas")
    deadline = time.monotonic() + 90
    while {r["replica_id"] for r in httpx.get(f"{app.base_url}/v1/status").json()["replicas"]
           } & {old["replica_id"]}:
        assert time.monotonic() < deadline, "the faulted replica was not replaced"
        time.sleep(0.5)
