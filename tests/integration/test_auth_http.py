"""With an API key configured, every route but the probes needs ``Authorization: Bearer``."""

from __future__ import annotations

import httpx
import pytest

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def app(deploy):
    return deploy({"model": {"task": "fake", "name": "fake"},
                   "fake": {"latency_per_token_s": 0.0},
                   "limits": {"max_inputs": 2, "max_input_tokens": 32, "max_tokens": 8},
                   "auth": {"api_key": KEY}})


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
])
def test_missing_or_wrong_keys_are_401(app, headers):
    with httpx.Client(base_url=app.base_url, timeout=30, headers=headers) as http:
        for response in (http.post("/v1/embeddings", json={"input": "a"}),
                         http.post("/v1/completions", json={"prompt": "a"}),
                         http.get("/v1/models"), http.get("/v1/status")):
            assert response.status_code == 401, response.text
            assert response.json()["error"] == {
                "message": "missing or invalid API key (send Authorization: Bearer <key>)",
                "type": "authentication_error", "code": "invalid_api_key"}


def test_the_right_key_is_served_and_probes_need_none(app):
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        assert http.get("/healthz").status_code == 200
        assert http.get("/readyz").status_code == 200
        for probe in ("/healthz", "/readyz"):  # as load balancers send them, via Serve's proxy
            head = http.head(probe)
            assert (head.status_code, head.content) == (200, b"")
        authorized = {"Authorization": f"Bearer {KEY}"}
        assert http.post("/v1/embeddings", json={"input": "a b"},
                         headers=authorized).status_code == 200
        assert http.get("/v1/models", headers=authorized).status_code == 200
