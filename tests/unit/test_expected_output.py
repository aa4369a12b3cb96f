"""``admission.kv_lease: expected``: the new tokens a request is leased follow the completion
lengths observed in its ``max_tokens`` range (a nearest-rank quantile over the last
``WINDOW``, ``max_tokens`` until ``MIN_SAMPLES`` are known), never above ``max_tokens``; the
replica's published cost model carries the expectations, so the ingress prices as it does;
the option is refused for engines that do not page their own KV cache."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deployments.engines.registry import engine_class
from serve_app.config import ConfigError, parse_args
from serve_app.memory.cost_model import CorrectedCostModel
from serve_app.memory.expected_output import (
    MIN_SAMPLES,
    WINDOW,
    ExpectedOutput,
    ExpectedOutputCostModel,
    max_tokens_range,
    published_model,
)
from serve_app.memory.kv_pool import KVPool

POOL = KVPool(blocks=64, block_tokens=16, block_bytes=1000)


def test_ranges_are_named_by_the_next_power_of_two() -> None:
    assert [max_tokens_range(n) for n in (1, 2, 3, 64, 65, 100, 128, 129)] == \
        [1, 2, 4, 64, 128, 128, 128, 256]


def test_max_tokens_until_enough_completions_are_known_then_their_quantile() -> None:
    expected = ExpectedOutput(quantile=0.9)
    for length in range(1, MIN_SAMPLES):  # 31 completions of 1..31 tokens
        expected.observe(100, length)
    assert expected.tokens(100) == 100 and expected.table() == {}
    expected.observe(100, 40)  # the 32nd: sorted 1..31, 40; nearest rank ceil(0.9 x 32) = 29
    assert expected.tokens(100) == 29
    assert expected.tokens(70) == 29  # the same range (64, 128]
    assert expected.tokens(20) == 20  # another range: nothing known
    assert expected.tokens(10 ** 0) == 1
    assert expected.table() == {128: 29}


def test_an_expectation_is_never_above_the_requests_own_max_tokens() -> None:
    expected = ExpectedOutput(quantile=1.0)
    for _ in range(MIN_SAMPLES):
        expected.observe(128, 120)
    assert (expected.tokens(128), expected.tokens(100), expected.tokens(65)) == (120, 100, 65)


def test_only_the_last_window_counts() -> None:
    expected = ExpectedOutput(quantile=0.5)
    for _ in range(WINDOW):
        expected.observe(256, 250)
    for _ in range(WINDOW):
        expected.observe(256, 10)  # the traffic changed: the old lengths are forgotten
    assert expected.tokens(256) == 10


@given(lengths=st.lists(st.integers(0, 600), min_size=MIN_SAMPLES, max_size=300),
       quantile=st.floats(0.01, 1.0), max_tokens=st.integers(257, 512))
def test_the_expectation_covers_the_quantile_of_the_last_window(lengths, quantile,
                                                                  max_tokens) -> None:
    expected = ExpectedOutput(quantile)
    for length in lengths:
        expected.observe(512, length)
    window = [min(length, 512) for length in lengths[-WINDOW:]]
    tokens = expected.tokens(max_tokens)
    covered = sum(length <= tokens for length in window)
    assert covered >= math.ceil(quantile * len(window)) or tokens == max_tokens
    assert tokens == min(max_tokens, sorted(window)[math.ceil(quantile * len(window)) - 1])


def test_the_price_is_the_blocks_of_the_prompt_and_the_expected_tokens() -> None:
    expected = ExpectedOutput(quantile=0.95)
    model = ExpectedOutputCostModel(POOL.cost_model(), expected)
    assert model.request_bytes(1, 10, 200) == 1000 * 14  # ceil(210 / 16): max_tokens first
    for _ in range(MIN_SAMPLES):
        expected.observe(200, 22)
    assert model.request_bytes(1, 10, 200) == 1000 * 2  # ceil((10 + 22) / 16)
    assert model.request_bytes(3, 10, 200) == 3 * 1000 * 2
    assert model.request_bytes(1, 10, 0) == 1000  # a prompt alone


def test_the_published_model_prices_as_the_replica() -> None:
    expected = ExpectedOutput(quantile=0.95)
    for length in range(MIN_SAMPLES):
        expected.observe(1000, 3 * length)
    replica = CorrectedCostModel(ExpectedOutputCostModel(POOL.cost_model(), expected))
    published = replica.published()
    assert published["expected_new_tokens"] == {"1024": 90}  # ceil(0.95 x 32) = 31st of 0..93
    ingress = published_model(published)
    shapes = [(1, p, n) for p in (1, 17, 100) for n in (0, 5, 90, 600, 1000)]
    assert [ingress.request_bytes(*s) for s in shapes] == \
        [replica.request_bytes(*s) for s in shapes]
    assert "expected_new_tokens" not in CorrectedCostModel(POOL.cost_model()).published()


def test_expected_leases_asked_of_an_engine_that_does_not_page_its_cache_are_refused() -> None:
    """The default (``expected``) applies where it can; set by hand on an engine without a
    KV pool it is refused, naming the key."""
    assert parse_args({}).admission.kv_lease == "expected"
    assert engine_class(parse_args({"model": {"engine": "fake", "name": "m"}})) is not None
    args = parse_args({"model": {"engine": "fake", "name": "m"},
                       "admission": {"kv_lease": "expected"}})
    with pytest.raises(ConfigError, match=r"admission\.kv_lease.*model\.engine: vllm"):
        engine_class(args)
    with pytest.raises(ConfigError, match="kv_lease_quantile"):
        parse_args({"model": {"engine": "fake", "name": "m"},
                    "admission": {"kv_lease_quantile": 0}})
