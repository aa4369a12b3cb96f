"""A request priced above the replica's whole budget is refused at once with 400
``request_too_large`` (the fake engine's prices are exact: 1 MiB per token)."""

from __future__ import annotations

import httpx
import pytest

MiB = 1 << 20


@pytest.fixture(scope="module")
def app(deploy):
    return deploy({
        "model": {"task": "fake", "name": "fake"},
        "fake": {"bytes_per_token": MiB, "latency_per_token_s": 0.0},
        # An explicit budget below the largest request the limits allow (the operator's call).
        "memory": {"budget_bytes": 100 * MiB},
        "limits": {"max_inputs": 8, "max_input_tokens": 128, "max_tokens": 64},
    })


def test_prices_over_the_whole_budget_are_400_and_the_rest_are_served(app):
    words = lambda n: " ".join(["w"] * n)  # noqa: E731  n words = n + 2 tokens
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        fits = http.post("/v1/completions", json={"prompt": words(10), "max_tokens": 16})
        prompt_too_big = http.post("/v1/completions",
                                   json={"prompt": words(60), "max_tokens": 50})
        batch_too_big = http.post("/v1/embeddings", json={"input": [words(28)] * 4})
        batch_fits = http.post("/v1/embeddings", json={"input": [words(28)] * 3})
    assert fits.status_code == 200  # (12 + 16) MiB
    assert batch_fits.status_code == 200  # 3 x 30 MiB
    for refused in (prompt_too_big, batch_too_big):  # 112 MiB, 120 MiB > 100 MiB
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "request_too_large"
        assert "104857600" in error["message"]
    [replica] = app.check_invariants()
    assert replica["budget_bytes"] == 100 * MiB
