"""Your own engine, through config alone: a toy engine defined in this test module is named by
``model.engine`` and served over HTTP with admission, metrics and ``/v1/status``; nothing in
the project knows it.

The toy: every input gets the unit vector ``[0.5, 0.5, 0.5, 0.5]``; a pass holds 64 KiB of
host memory per token of its padded batch, which the replica measures at start-up (host RSS)
and fits its cost model to, as it would a real model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import numpy as np
import pytest

from deployments.engines.runners import EmbeddingRunner
from deployments.engines.words import WordFrontEnd
from serve_app.config import AppArgs
from tests.support import by_label, scrape, total, wait_for

MiB = 1 << 20


class ConstantEngine(EmbeddingRunner):
    """A toy embedding engine (the example of docs/architecture.md)."""

    kinds = ("embed",)
    max_seq_tokens = 64

    @classmethod
    def front_end(cls, args: AppArgs) -> WordFrontEnd:
        return WordFrontEnd(cls.max_seq_tokens)

    @classmethod
    def load(cls, args: AppArgs, device: str) -> ConstantEngine:
        engine = cls()
        engine.front = cls.front_end(args)
        return engine

    def embed_ids(self, input_ids: Sequence[Sequence[int]]) -> np.ndarray:
        longest = max(len(ids) for ids in input_ids)
        scratch = np.ones((len(input_ids), longest, 16384), dtype=np.float32)  # 64 KiB/token
        return np.full((len(input_ids), 4), 0.5, dtype=np.float32) + 0 * scratch[:, 0, :4]


ENGINE = f"{__name__}:ConstantEngine"


@pytest.fixture(scope="module")
def app(deploy):
    return deploy({"model": {"engine": ENGINE, "name": "toy", "device": "cpu"},
                   "memory": {"capacity_bytes": 1 << 30},
                   "limits": {"max_inputs": 4, "max_input_tokens": 32}})


def test_your_own_engine_is_served_with_admission_metrics_and_status(app) -> None:
    url = app.base_url
    before = scrape(url)
    bodies = [{"input": ["a b c", "d e f g h i j k"]}, {"input": "x"}, {"input": ["y z"] * 4}]
    with httpx.Client(base_url=url, timeout=60) as http:
        answers = [http.post("/v1/embeddings", json=body) for body in bodies]
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
        for body, answer in zip(bodies, answers, strict=True):
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            vectors = [d["embedding"] for d in answer.json()["data"]]
            assert vectors == [[0.5] * 4] * len(inputs)
            assert int(answer.headers["X-Queue-Position"]) >= 0
        # The ingress validated with the engine's own front end: 33 tokens > 32.
        too_long = http.post("/v1/embeddings", json={"input": " ".join(["w"] * 31)})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "input"
        # The engine serves one kind: the other route is not there.
        assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 404

    [replica] = app.check_invariants()
    assert (replica["task"], replica["kinds"], replica["model"]) == (ENGINE, ["embed"], "toy")
    assert replica["device"] == "cpu" and replica["method"].startswith("host RSS")
    assert replica["cost_model"]["kind"] == "fitted"
    assert replica["peak_reserved_bytes"] > 0  # requests held leases of measured bytes
    assert replica["charged_bytes_total"] == replica["released_bytes_total"] > 0

    def admitted(samples: dict) -> float:
        return total(samples, "vramgate_admission_decisions_total", outcome="admitted")

    after = wait_for(url, lambda s: admitted(s) - admitted(before) >= 3)
    assert admitted(after) - admitted(before) == 3
    assert by_label(after, "vramgate_budget_bytes", "replica") == {
        replica["replica_id"]: replica["budget_bytes"]}
