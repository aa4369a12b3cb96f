"""The one pricing rule: what a request, or a forward pass, is charged.

Three places need a price and all take it from here, so that they agree to the byte:

- the ingress, to tell the budget-aware request router how large a request is
  (:func:`estimate_units`, with the cost model the replicas publish);
- the model replica, for the lease it admits the request against (its own cost model);
- the replica's batcher, for a forward pass formed from several admitted requests.

For the same shape and the same published cost model, the router's estimate is therefore the
lease the replica takes. Pure: no Ray, torch or FastAPI.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from serve_app.memory.cost_model import CostModel, Shape
from serve_app.memory.expected_output import published_model


class UnitsPolicy(Protocol):
    """What an admission policy charges for a request of so many bytes
    (:mod:`serve_app.admission.policy`)."""

    def units(self, request_bytes: int) -> int: ...


def priced_tokens(token_counts: Sequence[int], batchable: bool, pad_to_multiple_of: int,
                  limit_tokens: int) -> int:
    """The padded length a request is priced at: its longest input (or a completion's
    ``max_tokens``), or, when it can be batched, that rounded up to ``pad_to_multiple_of``
    (``batching.pad_to_multiple_of``) and capped at ``limit_tokens`` (the limit of that
    length), so that requests of similar length fit one pass within their leases
    (over-reserving fewer than ``pad_to_multiple_of`` tokens per input).

    Raises:
        ValueError: ``token_counts`` is empty.
    """
    longest = max(token_counts)
    if not batchable:
        return longest
    padded = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    return min(max(padded, longest), limit_tokens)


def shape_bytes(cost_model: CostModel, shape: Shape) -> int:
    """Device bytes of ``shape``: one forward pass of ``shape.inputs`` rows padded to
    ``shape.prompt_tokens`` (and generating ``shape.new_tokens`` each).

    A generating shape is priced ``inputs`` x one row's price: the profile measures generation
    at batch 1, and every activation and KV-cache tensor of a decoder has a leading batch
    dimension (the weights, shared, are held, not priced), so b rows hold at most b x one row
    (Pope et al. 2022, "Efficiently Scaling Transformer Inference", sec. 2.1). An encoder pass
    is priced as the padded batch it is.
    """
    if shape.new_tokens:
        return shape.inputs * cost_model.request_bytes(1, shape.prompt_tokens, shape.new_tokens)
    return cost_model.request_bytes(shape.inputs, shape.prompt_tokens, 0)


class Pricer:
    """Prices shapes in an admission policy's units under one cost model.

    Args:
        cost_model: the replica's own (corrected) cost model, or one a replica published.
        policy: the admission policy (bytes under ``budget``, 1 under ``semaphore``).
    """

    def __init__(self, cost_model: CostModel, policy: UnitsPolicy) -> None:
        self.cost_model, self.policy = cost_model, policy

    def units(self, shape: Shape) -> int:
        """What ``shape`` is charged: the policy's units of :func:`shape_bytes`."""
        return self.policy.units(shape_bytes(self.cost_model, shape))


def estimate_units(published: Iterable[Mapping[str, Any] | None], shape: Shape,
                   policy: UnitsPolicy) -> int | None:
    """The ingress's price of ``shape``: the largest over the replicas' published cost
    models (:meth:`~serve_app.memory.cost_model.CorrectedCostModel.published`; they
    profiled separately), ``None`` while no replica has published one."""
    prices = [Pricer(published_model(raw), policy).units(shape)
              for raw in published if raw]
    return max(prices) if prices else None
