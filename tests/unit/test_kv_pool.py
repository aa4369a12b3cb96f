"""The KV pool of an engine that pages its own cache (vLLM): prices are the blocks of prompt +
max_tokens, the budget is the pool, and what vLLM is asked to allocate follows the replica's
share."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deployments.engines.vllm_engine import DEFAULT_BLOCK_TOKENS, kv_pool_request, model_len
from serve_app.config import parse_args
from serve_app.memory.budget import InsufficientMemoryError
from serve_app.memory.cost_model import FittedCostModel, TransformerShape
from serve_app.memory.kv_pool import BLOCK_SIZES, KVPool, kv_blocks, kv_blocks_feature

GiB = 1 << 30


@given(block_tokens=st.sampled_from(BLOCK_SIZES), batch=st.integers(1, 8),
       prompt=st.integers(1, 4096), new=st.integers(0, 4096))
def test_a_request_is_priced_at_the_blocks_its_sequences_can_grow_to(
        block_tokens: int, batch: int, prompt: int, new: int) -> None:
    pool = KVPool(blocks=1000, block_tokens=block_tokens, block_bytes=12_345)
    blocks = batch * math.ceil((prompt + new) / block_tokens)
    assert pool.request_blocks(batch, prompt, new) == blocks
    assert pool.cost_model().request_bytes(batch, prompt, new) == blocks * 12_345


def test_the_price_survives_publishing_as_a_fitted_model() -> None:
    model = KVPool(blocks=32, block_tokens=128, block_bytes=262_144).cost_model()
    assert model.to_dict() == {"kind": "fitted", "features": ["kv_blocks_128"],
                               "coefficients": [262_144.0], "held_out_error": None}
    again = FittedCostModel.from_dict(model.to_dict())
    assert again.request_bytes(1, 100, 28) == 262_144  # 128 tokens: one block
    assert again.request_bytes(1, 100, 29) == 2 * 262_144  # 129: two
    assert again.request_bytes(3, 1, 0) == 3 * 262_144


def test_block_sizes_without_a_feature_are_refused() -> None:
    assert kv_blocks_feature(16) == "kv_blocks_16"
    with pytest.raises(ValueError, match="KV blocks of 24 tokens: only powers of two up to "
                                         "1024 are priced"):
        kv_blocks_feature(24)
    assert kv_blocks(0, 16) == 0 and kv_blocks(16, 16) == 1 and kv_blocks(17, 16) == 2


def test_the_pool_is_the_budget() -> None:
    pool = KVPool(blocks=2340, block_tokens=128, block_bytes=65_536)
    assert pool.pool_bytes == 2340 * 65_536
    assert pool.figures() == {"block_tokens": 128, "block_bytes": 65_536, "blocks_total": 2340}


SHAPE = TransformerShape(num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=2,
                         intermediate_size=256, vocab_size=300, max_positions=512,
                         dtype_bytes=4, is_decoder=True)


def args(**sections: dict) -> object:
    return parse_args({"model": {"engine": "generate", "path": "/lm"}, **sections})


def test_max_model_len_is_the_limits_within_the_positions() -> None:
    assert model_len(args(limits={"max_input_tokens": 128, "max_tokens": 64}), SHAPE) == 192
    assert model_len(args(limits={"max_input_tokens": 1024, "max_tokens": 256}), SHAPE) == 512


def test_on_cpu_the_pool_is_what_the_batch_can_fill_within_the_capacity() -> None:
    block_bytes = SHAPE.kv_cache_bytes(1, DEFAULT_BLOCK_TOKENS["cpu"])
    assert block_bytes == 128 * 2 * 2 * 2 * 64 * 4  # tokens x K,V x layers x heads x dim x fp32
    config = args(batching={"max_batch_size": 16},
                  memory={"safety_factor": 0.9, "reserve_bytes": 0})
    # 256 tokens: 2 blocks a sequence, 16 sequences
    request = kv_pool_request(config, "cpu", 8 * GiB, 0, 10 << 20, block_bytes, 256)
    assert request.kv_cache_memory_bytes == 16 * 2 * block_bytes
    # little room: what the capacity leaves after the weights, times the safety factor
    request = kv_pool_request(config, "cpu", 15 << 20, 0, 10 << 20, block_bytes, 256)
    assert request.kv_cache_memory_bytes == int((5 << 20) * 0.9) < 16 * 2 * block_bytes
    with pytest.raises(InsufficientMemoryError, match="less than one sequence of 256 tokens"):
        kv_pool_request(config, "cpu", (10 << 20) + block_bytes, 0, 10 << 20, block_bytes, 256)


def test_on_a_gpu_share_vllm_gets_the_share_less_the_reserve() -> None:
    config = args(deployment={"num_gpus": 0.5}, memory={"reserve_bytes": 4 * GiB})
    request = kv_pool_request(config, "cuda", 0, 80 * GiB, 2 * GiB, 1 << 20, 4096)
    assert request.kv_cache_memory_bytes is None
    assert request.gpu_memory_utilization == pytest.approx(0.45)
    tight = args(deployment={"num_gpus": 0.05}, memory={"reserve_bytes": 2 * GiB})
    with pytest.raises(InsufficientMemoryError, match="cannot hold the weights"):
        kv_pool_request(tight, "cuda", 0, 80 * GiB, 2 * GiB, 1 << 20, 4096)
