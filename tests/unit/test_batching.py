"""Budget-aware batch forming: every member once, no batch priced above its members' leases,
similar lengths (prompt and new tokens) together."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.admission.batching import BatchMember, form_batches

PER_TOKEN, PER_PASS = 1000, 5000


def price(inputs: int, longest: int, new: int = 0) -> int:
    """A linear cost model: one fixed cost per forward pass + bytes per padded token (every
    row's cache as long as the longest prompt + the most new tokens)."""
    return PER_PASS + inputs * (longest + new) * PER_TOKEN


def member(inputs: int, longest: int, new: int = 0, leased: int | None = None) -> BatchMember:
    return BatchMember(inputs, longest, price(inputs, longest, new) if leased is None
                       else leased, new)


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


def test_completions_asking_for_similar_new_tokens_batch_together() -> None:
    # Leases priced padded to multiples of 16 (batching.pad_to_multiple_of): 40 and 48 new
    # tokens are both leased at 48 and fit one pass; 8 (leased at 16) does not join them.
    members = [member(1, 16, 40, leased=price(1, 16, 48)),
               member(1, 16, 8, leased=price(1, 16, 16)),
               member(1, 16, 48, leased=price(1, 16, 48))]
    assert form_batches(members, price, max_batch_inputs=32) == [[0, 2], [1]]
    exact = [member(1, 16, 40), member(1, 16, 48)]  # leased at exactly their own length
    assert form_batches(exact, price, max_batch_inputs=32) == [[0], [1]]


def test_a_pass_the_price_refuses_is_never_formed() -> None:
    never = lambda inputs, longest, new: float("inf") if inputs > 1 else 0.0  # noqa: E731
    assert form_batches([member(1, 8), member(1, 8)], never, max_batch_inputs=32) == [[0], [1]]


def test_a_bad_limit_is_refused() -> None:
    with pytest.raises(ValueError):
        form_batches([member(1, 1)], price, max_batch_inputs=0)


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 128), st.integers(0, 64),
                          st.integers(0, 40)), min_size=0, max_size=24),
       st.integers(1, 40))
def test_every_batch_fits_its_leases_and_every_member_runs_once(raw, max_inputs) -> None:
    # A lease may be above the member's own price (padded, or priced before a correction).
    members = [member(n, t, new, price(n, t, new) + extra * PER_TOKEN)
               for n, t, new, extra in raw]
    batches = form_batches(members, price, max_batch_inputs=max_inputs)
    assert sorted(i for batch in batches for i in batch) == list(range(len(members)))
    for batch in batches:
        assert batch == sorted(batch)
        if len(batch) > 1:
            inputs = sum(members[i].inputs for i in batch)
            longest = max(members[i].longest_tokens for i in batch)
            new = max(members[i].new_tokens for i in batch)
            assert inputs <= max_inputs
            assert price(inputs, longest, new) <= sum(members[i].leased_bytes for i in batch)
    assert [batch[0] for batch in batches] == sorted(batch[0] for batch in batches)
