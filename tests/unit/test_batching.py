"""Budget-aware batch forming: every member once, no batch priced above its members' leases,
similar lengths together."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.admission.batching import BatchMember, form_batches

PER_TOKEN, PER_PASS = 1000, 5000


def price(inputs: int, longest: int) -> int:
    """A linear cost model: one fixed cost per forward pass + bytes per padded token."""
    return PER_PASS + inputs * longest * PER_TOKEN


def member(inputs: int, longest: int) -> BatchMember:
    return BatchMember(inputs, longest, price(inputs, longest))


def test_equal_lengths_batch_together_up_to_the_size_limit() -> None:
    members = [member(1, 10) for _ in range(5)]
    assert form_batches(members, price, max_batch_inputs=2) == [[0, 1], [2, 3], [4]]
    assert form_batches(members, price, max_batch_inputs=32) == [[0, 1, 2, 3, 4]]


def test_a_long_input_is_not_padded_onto_short_ones_beyond_their_leases() -> None:
    # Three 1 x 8-token requests and one 1 x 100: all together would cost 4 x 100 tokens,
    # more than the leases (3 x 8 + 100 tokens + 4 fixed costs) hold.
    members = [member(1, 8), member(1, 100), member(1, 8), member(1, 8)]
    batches = form_batches(members, price, max_batch_inputs=32)
    assert batches == [[0, 2, 3], [1]]


def test_batches_run_oldest_member_first() -> None:
    members = [member(1, 50), member(1, 5), member(1, 5), member(2, 50)]
    assert form_batches(members, price, max_batch_inputs=32) == [[0, 3], [1, 2]]


def test_a_member_larger_than_the_batch_limit_runs_alone() -> None:
    members = [member(40, 10), member(1, 10)]
    assert form_batches(members, price, max_batch_inputs=32) == [[0], [1]]


def test_a_bad_limit_is_refused() -> None:
    with pytest.raises(ValueError):
        form_batches([member(1, 1)], price, max_batch_inputs=0)


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 128), st.integers(0, 3)),
                min_size=0, max_size=24),
       st.integers(1, 40))
def test_every_batch_fits_its_leases_and_every_member_runs_once(raw, max_inputs) -> None:
    # A lease may be a little above the member's own price (priced before a correction).
    members = [BatchMember(n, t, price(n, t) + extra * PER_TOKEN) for n, t, extra in raw]
    batches = form_batches(members, price, max_batch_inputs=max_inputs)
    assert sorted(i for batch in batches for i in batch) == list(range(len(members)))
    for batch in batches:
        assert batch == sorted(batch)
        if len(batch) > 1:
            inputs = sum(members[i].inputs for i in batch)
            longest = max(members[i].longest_tokens for i in batch)
            assert inputs <= max_inputs
            assert price(inputs, longest) <= sum(members[i].leased_bytes for i in batch)
    assert [batch[0] for batch in batches] == sorted(batch[0] for batch in batches)
