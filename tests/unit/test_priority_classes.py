"""Priority classes in the pure admission queue (:mod:`serve_app.admission.priority`), on a
fake clock: a batch request is admitted only while no interactive request waits, interactive
requests pass batch waiters, batch requests are positioned and predicted behind every
interactive waiter, the budget is never exceeded and nothing stays leased."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.admission.budget import Lease, MemoryBudget
from serve_app.admission.drain import DrainRateEstimator
from serve_app.admission.priority import Priority
from serve_app.admission.queue import AdmissionQueue, Outcome
from tests.unit.conftest import FakeClock

BUDGET = 1000
RATE_BYTES_PER_S = 100.0
BATCH, INTERACTIVE = Priority.BATCH, Priority.INTERACTIVE


def new_queue(clock: FakeClock | None = None) -> AdmissionQueue:
    """``BUDGET`` bytes, a drain rate of ``RATE_BYTES_PER_S`` before any is measured."""
    clock = clock or FakeClock()
    return AdmissionQueue(MemoryBudget(BUDGET), 100, 10**6, clock=clock,
                          drain=DrainRateEstimator(10.0, clock, RATE_BYTES_PER_S),
                          refuse_predicted=False)


def test_a_batch_request_waits_while_an_interactive_one_does_even_when_it_fits() -> None:
    queue = new_queue()
    held = queue.submit(800).lease
    interactive = queue.submit(500).waiter
    batch = queue.submit(100, priority=BATCH)  # 200 bytes free: it would fit
    assert batch.outcome is Outcome.QUEUED and batch.queue_position == 1
    assert [w.nbytes for w in queue.release(held)] == [500, 100]
    assert interactive.lease is not None and batch.waiter.lease is not None


def test_a_batch_request_starts_at_once_when_nothing_waits() -> None:
    queue = new_queue()
    queue.submit(800)
    assert queue.submit(100, priority=BATCH).outcome is Outcome.ADMITTED


def test_interactive_requests_pass_batch_waiters() -> None:
    queue = new_queue()
    held = queue.submit(900).lease
    batch = queue.submit(500, priority=BATCH).waiter
    assert queue.submit(50).outcome is Outcome.ADMITTED  # no interactive waiter: it fits
    interactive = queue.submit(500)
    assert interactive.outcome is Outcome.QUEUED and interactive.queue_position == 0
    assert queue.positions()[batch.waiter_id][0] == 1
    admitted = queue.release(held)
    assert [w.waiter_id for w in admitted] == [interactive.waiter.waiter_id]
    assert batch.lease is None  # 450 bytes free, but the interactive 500 came first


def test_batch_predictions_count_every_interactive_waiter_ahead() -> None:
    queue = new_queue()
    queue.submit(1000)
    queue.submit(300, priority=BATCH)
    queue.submit(400)
    # Interactive: its 100 after the 400 interactive bytes; batch: after those and the 300.
    assert queue.predicted_wait_s(100) == (400 + 100) / RATE_BYTES_PER_S
    assert queue.predicted_wait_s(100, priority=BATCH) == (400 + 300 + 100) / RATE_BYTES_PER_S
    assert queue.submit(100, priority=BATCH).queue_position == 2


def test_fifo_within_a_tenant_of_one_class_and_tenants_are_backlogged_across_classes() -> None:
    queue = new_queue()
    held = queue.submit(1000).lease
    order = [queue.submit(100, tenant="a", priority=BATCH).waiter for _ in range(3)]
    assert queue.backlog() == {"a": (3, 300)}
    queue.submit(100, tenant="a")
    assert queue.backlog() == {"a": (4, 400)}
    admitted = queue.release(held)
    assert [w.priority for w in admitted] == [INTERACTIVE, BATCH, BATCH, BATCH]
    assert [w.waiter_id for w in admitted[1:]] == [w.waiter_id for w in order]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(10, 120))
def test_batch_is_admitted_only_while_no_interactive_request_waits(seed: int,
                                                                    steps: int) -> None:
    """Random arrivals of both classes and two tenants, releases, cancellations and expiries:
    whenever a batch request is admitted no interactive one waits; the budget is never
    exceeded; once everything is released or withdrawn, nothing is leased or waiting."""
    rng, clock = random.Random(seed), FakeClock()
    queue = new_queue(clock)
    queue.max_queue_wait_s = 5.0
    leases: list[Lease] = []

    def admitted(lease: Lease, priority: Priority) -> None:
        interactive_waiting = any(w.priority is INTERACTIVE for w in queue.waiters())
        assert not (priority is BATCH and interactive_waiting)
        assert queue.budget.reserved_bytes <= BUDGET
        leases.append(lease)

    queue.on_admit = lambda waiter: admitted(waiter.lease, waiter.priority)
    for _ in range(steps):
        action = rng.random()
        if action < 0.5:
            priority = rng.choice((BATCH, INTERACTIVE))
            decision = queue.submit(rng.randint(1, 600), tenant=rng.choice("ab"),
                                    priority=priority)
            if decision.outcome is Outcome.ADMITTED:
                admitted(decision.lease, priority)
        elif action < 0.75 and leases:
            queue.release(leases.pop(rng.randrange(len(leases))))
        elif action < 0.9 and queue.waiters():
            queue.cancel(rng.choice(queue.waiters()))
        else:
            clock.advance(rng.uniform(0.0, 3.0))
            queue.expire()
    for waiter in queue.waiters():
        queue.cancel(waiter)
    while leases:
        queue.release(leases.pop())
    assert (queue.budget.reserved_bytes, queue.queue_depth, queue.queued_bytes) == (0, 0, 0)
    assert queue.backlog() == {}
