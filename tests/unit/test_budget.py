"""MemoryBudget and Lease: try-reserve never blocks and never over-commits; release exactly once."""

from __future__ import annotations

import pytest

from serve_app.admission.budget import Lease, MemoryBudget


def release_all(leases: list[Lease]) -> None:
    for lease in leases:
        lease.release()


def test_try_reserve_leases_the_bytes_asked_for() -> None:
    budget = MemoryBudget(100)
    lease = budget.try_reserve(30)
    assert lease is not None
    assert lease.nbytes == 30
    assert lease.released is False
    assert budget.reserved_bytes == 30
    assert budget.free_bytes == 70
    assert budget.active_leases == 1
    assert budget.charged_bytes_total == 30
    lease.release()


def test_try_reserve_returns_none_when_not_fitting_and_changes_nothing() -> None:
    budget = MemoryBudget(100)
    held = budget.try_reserve(80)
    assert budget.try_reserve(21) is None
    assert budget.reserved_bytes == 80
    assert budget.active_leases == 1
    assert budget.charged_bytes_total == 80
    held.release()


def test_try_reserve_fills_the_budget_exactly_and_no_further() -> None:
    budget = MemoryBudget(100)
    leases = [budget.try_reserve(25) for _ in range(4)]
    assert all(lease is not None for lease in leases)
    assert budget.reserved_bytes == 100
    assert budget.free_bytes == 0
    assert budget.try_reserve(1) is None
    zero = budget.try_reserve(0)  # nothing asked, nothing exceeded
    assert zero is not None and budget.reserved_bytes == 100
    release_all([*leases, zero])
    assert budget.reserved_bytes == 0


def test_many_small_reservations_never_exceed_the_budget() -> None:
    budget = MemoryBudget(1000)
    leases = []
    for nbytes in [7, 300, 1, 250, 999, 442, 3, 5, 0, 1000]:
        lease = budget.try_reserve(nbytes)
        assert budget.reserved_bytes <= budget.budget_bytes
        if lease is not None:
            leases.append(lease)
    assert budget.reserved_bytes == sum(lease.nbytes for lease in leases) == 1000
    release_all(leases)


def test_lease_ids_are_unique() -> None:
    budget = MemoryBudget(10)
    leases = [budget.try_reserve(1) for _ in range(10)]
    assert len({lease.lease_id for lease in leases}) == 10
    release_all(leases)


def test_release_returns_the_bytes_exactly_once() -> None:
    budget = MemoryBudget(100)
    lease = budget.try_reserve(40)
    assert lease.release() is True
    assert lease.release() is False
    assert lease.release() is False
    assert lease.released is True
    assert budget.reserved_bytes == 0
    assert budget.active_leases == 0
    assert budget.charged_bytes_total == 40
    assert budget.released_bytes_total == 40


def test_double_release_does_not_hand_out_someone_elses_bytes() -> None:
    budget = MemoryBudget(100)
    first = budget.try_reserve(60)
    first.release()
    second_holder = budget.try_reserve(60)
    first.release()  # a late second ``finally`` on the first request's path
    assert budget.reserved_bytes == 60
    assert budget.try_reserve(41) is None
    second_holder.release()


def test_negative_nbytes_is_refused() -> None:
    budget = MemoryBudget(100)
    with pytest.raises(ValueError, match="nbytes must be a whole number >= 0, got -1"):
        budget.try_reserve(-1)
    assert budget.reserved_bytes == 0
    assert budget.active_leases == 0


def test_fractional_nbytes_is_refused_so_no_byte_leaks() -> None:
    budget = MemoryBudget(100)
    with pytest.raises(ValueError, match="whole number"):
        budget.try_reserve(1.5)
    lease = budget.try_reserve(2.0)
    assert lease is not None and lease.nbytes == 2
    lease.release()
    assert budget.reserved_bytes == 0


@pytest.mark.parametrize("budget_bytes", [0, -1])
def test_budget_must_be_positive(budget_bytes: int) -> None:
    with pytest.raises(ValueError, match=f"budget_bytes must be > 0, got {budget_bytes}"):
        MemoryBudget(budget_bytes)
    with pytest.raises(ValueError, match="budget_bytes must be > 0"):
        MemoryBudget(10).set_budget_bytes(budget_bytes)


@pytest.mark.parametrize(("nbytes", "fits"), [(0, True), (99, True), (100, True), (101, False)])
def test_fits_ever_compares_with_the_whole_budget(nbytes: int, fits: bool) -> None:
    budget = MemoryBudget(100)
    held = budget.try_reserve(100)  # what is leased now does not matter
    assert budget.fits_ever(nbytes) is fits
    held.release()


def test_shrinking_below_leases_blocks_until_enough_is_released() -> None:
    budget = MemoryBudget(100)
    a, b = budget.try_reserve(50), budget.try_reserve(40)
    budget.set_budget_bytes(60)
    assert budget.budget_bytes == 60
    assert budget.free_bytes == 0  # 90 leased > 60: clamped, never negative
    assert budget.try_reserve(1) is None
    a.release()
    assert budget.free_bytes == 20
    assert budget.try_reserve(21) is None
    b.release()
    assert budget.free_bytes == 60
    assert budget.fits_ever(61) is False
    assert budget.reserved_bytes == 0 and budget.active_leases == 0


def test_a_budget_shrunk_below_its_leases_admits_not_even_zero_bytes() -> None:
    # free_bytes is clamped at 0, so comparing with it let a 0-byte lease in while 90 bytes
    # were leased against a budget of 60.
    budget = MemoryBudget(100)
    held = budget.try_reserve(90)
    budget.set_budget_bytes(60)
    assert budget.try_reserve(0) is None
    assert budget.active_leases == 1 and budget.charged_bytes_total == 90
    held.release()
    zero = budget.try_reserve(0)
    assert zero is not None
    zero.release()


def test_growing_the_budget_frees_room_at_once() -> None:
    budget = MemoryBudget(100)
    held = budget.try_reserve(100)
    budget.set_budget_bytes(150)
    extra = budget.try_reserve(50)
    assert extra is not None
    assert budget.reserved_bytes == 150
    release_all([held, extra])
    assert budget.charged_bytes_total == budget.released_bytes_total == 150
