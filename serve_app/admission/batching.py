"""Budget-aware grouping of admitted requests into forward passes.

Pure: no Ray, torch or asyncio. A batch padded to its longest input costs
``price(total inputs, longest, most new tokens)``, which can exceed the sum of its members'
prices (a short input padded to a long one's length costs what a long one costs; a batch of
completions generates to its largest ``max_tokens``, and holds every row's KV cache that
long). Each member already holds a lease of its own price, so a batch is formed only where its
price fits the leases its members hold together: the device never holds more than the budget
has leased (the gate's invariant).
Members are grouped by length (new tokens, then prompt), so that little is lost to padding,
and batches run oldest member first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchMember:
    """One admitted request waiting to be batched.

    Attributes:
        inputs: its number of inputs (>= 1).
        longest_tokens: tokens of its longest input (the length it is padded to).
        leased_bytes: the bytes its lease holds (its price when it was admitted).
        new_tokens: a completion's ``max_tokens`` (0 for an embedding): a pass generates
            to its largest member's.
    """

    inputs: int
    longest_tokens: int
    leased_bytes: int
    new_tokens: int = 0


def form_batches(members: Sequence[BatchMember], price: Callable[[int, int, int], float],
                 max_batch_inputs: int) -> list[list[int]]:
    """Group ``members`` (given oldest first) into batches; returns lists of indices.

    Every member is in exactly one batch. A batch of two or more members has at most
    ``max_batch_inputs`` inputs in all and ``price(inputs, longest, most new) <=
    sum(leased_bytes)``; a member that fits with nobody runs alone (as without batching).
    Members are taken in order of length (new tokens, then longest input) and each joins the
    open batch if both limits still hold, else opens the next; batches are returned in order
    of their oldest member, members oldest first.

    Args:
        members: the waiting requests, oldest first.
        price: bytes of one pass of ``(inputs, padded length, new tokens)`` (the cost
            model).
        max_batch_inputs: ``batching.max_batch_size``.

    Raises:
        ValueError: ``max_batch_inputs`` < 1.
    """
    if max_batch_inputs < 1:
        raise ValueError(f"max_batch_inputs must be >= 1, got {max_batch_inputs}")
    order = sorted(range(len(members)),
                   key=lambda i: (members[i].new_tokens, members[i].longest_tokens, i))
    batches: list[list[int]] = []
    inputs = longest = new = leased = 0
    for i in order:
        member = members[i]
        joined = (inputs + member.inputs, max(longest, member.longest_tokens),
                  max(new, member.new_tokens), leased + member.leased_bytes)
        if batches and joined[0] <= max_batch_inputs and price(*joined[:3]) <= joined[3]:
            batches[-1].append(i)
        else:
            batches.append([i])
            joined = (member.inputs, member.longest_tokens, member.new_tokens,
                      member.leased_bytes)
        inputs, longest, new, leased = joined
    return sorted((sorted(batch) for batch in batches), key=lambda batch: batch[0])
