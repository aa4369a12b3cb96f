"""Budget-aware routing: pure ranking and reservations, then the Ray adapter on Ray's fakes.

The adapter tests build :class:`deployments.cluster.router.BudgetAwareRequestRouter` with Ray's own
request-router test double (``ray.serve._private.test_utils.FakeRunningReplica``, the one
Ray's pow-2 router tests use), extended only by the ``routing_stats`` property it lacks. No
Ray runtime is started (the autouse fixture makes ``ray.init`` raise).
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.memory.cost_model import Shape
from serve_app.replica_state import ROUTING_MEASURED_AT_KEY as MEASURED_AT_KEY
from serve_app.request import InferenceRequest
from serve_app.routing import (
    BudgetRouterState,
    ReplicaStats,
    estimated_bytes_of,
    headroom_bytes,
    rank_replicas,
)
from tests.unit.conftest import FakeClock

MB = 1 << 20


def replica(replica_id: str, *, free: int, queued: int = 0, budget: int = 100 * MB,
            node: str | None = None, measured_at_s: float | None = None) -> ReplicaStats:
    return ReplicaStats(replica_id=replica_id, node_id=node, budget_bytes=budget,
                        reserved_bytes=budget - free, free_bytes=free,
                        queue_depth=1 if queued else 0, queued_bytes=queued,
                        measured_at_s=measured_at_s)


# --- ranking -------------------------------------------------------------------------------


def test_replicas_that_fit_come_first_ordered_by_bytes_ahead() -> None:
    stats = [replica("a", free=50 * MB, queued=10 * MB),   # headroom 40: fits, 10 ahead
             replica("b", free=20 * MB),                    # headroom 20: does not fit
             replica("c", free=30 * MB)]                    # headroom 30: fits, 0 ahead
    assert rank_replicas(stats, 25 * MB, {}, None) == [["c", "a"], ["b"]]


def test_queued_bytes_block_a_newcomer_even_when_free_bytes_would_fit() -> None:
    # the replica's FIFO lets nothing overtake its head: 60 free but 50 already waiting
    stats = [replica("a", free=60 * MB, queued=50 * MB), replica("b", free=15 * MB)]
    assert rank_replicas(stats, 20 * MB, {}, None) == [[], ["b", "a"]]


def test_replicas_that_do_not_fit_are_ordered_by_backlog_relative_to_budget() -> None:
    stats = [replica("x", free=0, queued=50 * MB, budget=100 * MB),   # 0.5 of budget
             replica("y", free=0, queued=60 * MB, budget=200 * MB),   # 0.3
             replica("z", free=0, queued=10 * MB, budget=100 * MB),   # 0.1
             replica("w", free=5 * MB, budget=100 * MB),              # 0.0, 5 free
             replica("v", free=8 * MB, budget=100 * MB)]              # 0.0, 8 free
    assert rank_replicas(stats, 50 * MB, {}, None) == [[], ["v", "w", "z", "y", "x"]]


def test_the_local_node_wins_ties_only() -> None:
    stats = [replica("a", free=50 * MB, node="n2"), replica("b", free=50 * MB, node="n1"),
             replica("c", free=50 * MB, queued=1, node="n1")]
    assert rank_replicas(stats, 10 * MB, {}, "n1") == [["b", "a", "c"], []]
    assert rank_replicas(stats, 10 * MB, {}, None) == [["a", "b", "c"], []]
    full = [replica("a", free=0, node="n2"), replica("b", free=0, node="n1")]
    assert rank_replicas(full, 10 * MB, {}, "n1") == [[], ["b", "a"]]


def test_reservations_count_as_bytes_ahead_and_against_headroom() -> None:
    stats = [replica("a", free=50 * MB), replica("b", free=50 * MB)]
    assert rank_replicas(stats, 10 * MB, {"a": 5 * MB}, None) == [["b", "a"], []]
    assert rank_replicas(stats, 10 * MB, {"a": 45 * MB}, None) == [["b"], ["a"]]


def test_an_unpriced_request_ranks_by_bytes_ahead_only() -> None:
    stats = [replica("a", free=0, queued=30 * MB), replica("b", free=90 * MB, queued=10 * MB),
             ReplicaStats("u"), replica("c", free=1, queued=10 * MB, node="n1")]
    assert rank_replicas(stats, None, {"b": 5 * MB}, "n1") == [[], ["c", "b", "a", "u"]]


def test_replicas_without_stats_rank_last_but_are_never_dropped() -> None:
    stats = [ReplicaStats("u2"), replica("a", free=0, queued=90 * MB), ReplicaStats("u1"),
             ReplicaStats("u0", node_id="n1")]
    assert rank_replicas(stats, 10 * MB, {"u1": 0, "u2": 0, "u0": 3}, "n1") == \
        [[], ["a", "u1", "u2", "u0"]]
    assert rank_replicas([ReplicaStats("u")], 10 * MB, {}, None) == [[], ["u"]]


def test_rank_refuses_negative_sizes_and_duplicate_replicas() -> None:
    with pytest.raises(ValueError, match="request_bytes"):
        rank_replicas([replica("a", free=1)], -1, {}, None)
    with pytest.raises(ValueError, match="duplicate"):
        rank_replicas([replica("a", free=1), replica("a", free=2)], 1, {}, None)


def _route(stats: list[ReplicaStats], state: BudgetRouterState | None,
           nbytes: int) -> str:
    tiers = rank_replicas(stats, nbytes, state.pending_by_replica() if state else {}, None)
    chosen = (tiers[0] or tiers[1])[0]
    if state is not None:
        state.reserve(chosen, nbytes)
    return chosen


def test_a_burst_on_stale_stats_spreads_by_optimistic_reservations(clock: FakeClock) -> None:
    stats = [replica("r1", free=100 * MB), replica("r2", free=100 * MB),
             replica("r3", free=40 * MB)]
    state = BudgetRouterState(clock)
    chosen = [_route(stats, state, 40 * MB) for _ in range(6)]
    assert chosen == ["r1", "r2", "r3", "r1", "r2", "r3"]
    # while some replica could still take it, none got more than its free bytes
    for n in range(1, 6):
        sent = {s.replica_id: 40 * MB * chosen[:n].count(s.replica_id) for s in stats}
        assert all(sent[s.replica_id] <= s.free_bytes for s in stats), chosen[:n]
    # without reservations every request piles onto the replica that looked emptiest
    assert [_route(stats, None, 40 * MB) for _ in range(6)] == ["r1"] * 6


# --- reservations --------------------------------------------------------------------------


def test_settle_is_idempotent(clock: FakeClock) -> None:
    state = BudgetRouterState(clock)
    first, second = state.reserve("a", 10), state.reserve("a", 5)
    assert state.pending_by_replica() == {"a": 15}
    assert state.settle(first) is True
    assert state.settle(first) is False
    assert state.pending_by_replica() == {"a": 5}
    assert state.settle(second) is True
    assert state.pending_by_replica() == {} and state.live_count() == 0
    assert state.settle(second) is False


def test_a_newer_report_drops_the_reservations_it_covers(clock: FakeClock) -> None:
    state = BudgetRouterState(clock)
    old = state.reserve("a", 40)               # t = 1000
    clock.advance(1.0)
    new = state.reserve("a", 30)               # t = 1001
    other = state.reserve("b", 7)
    assert state.observe(replica("a", free=1, measured_at_s=1000.5)) == 1
    assert state.pending_by_replica() == {"a": 30, "b": 7}
    assert not state.is_live(old) and state.is_live(new) and state.is_live(other)
    assert state.settle(old) is False          # the completion arriving later changes nothing
    # the same report again, an older one, or one without a time drop nothing
    assert state.observe(replica("a", free=1, measured_at_s=1000.5)) == 0
    assert state.observe(replica("a", free=1, measured_at_s=1000.9)) == 0
    assert state.observe(replica("a", free=1, measured_at_s=999.0)) == 0
    assert state.observe(replica("a", free=1)) == 0
    assert state.pending_by_replica() == {"a": 30, "b": 7}
    assert state.observe(replica("a", free=1, measured_at_s=1001.0)) == 1
    assert state.pending_by_replica() == {"b": 7}


def test_reservations_younger_than_the_arrival_grace_survive_a_report(
        clock: FakeClock) -> None:
    state = BudgetRouterState(clock, arrival_grace_s=0.2)
    state.reserve("a", 40)                     # t = 1000
    assert state.observe(replica("a", free=1, measured_at_s=1000.1)) == 0
    assert state.observe(replica("a", free=1, measured_at_s=1000.2)) == 1


def test_reservations_expire_after_max_age(clock: FakeClock) -> None:
    state = BudgetRouterState(clock, max_age_s=30.0)
    state.reserve("a", 40)
    clock.advance(30.0)
    assert state.pending_by_replica() == {"a": 40}
    clock.advance(0.1)
    assert state.pending_by_replica() == {} and state.live_count() == 0


def test_retain_replicas_forgets_removed_ones(clock: FakeClock) -> None:
    state = BudgetRouterState(clock)
    state.reserve("a", 1)
    state.reserve("b", 2)
    state.retain_replicas(["b"])
    assert state.pending_by_replica() == {"b": 2}


def test_state_refuses_bad_arguments(clock: FakeClock) -> None:
    with pytest.raises(ValueError):
        BudgetRouterState(clock, arrival_grace_s=-1)
    with pytest.raises(ValueError):
        BudgetRouterState(clock, max_age_s=0)
    with pytest.raises(ValueError):
        BudgetRouterState(clock).reserve("a", -1)


# --- reading what a replica and a caller send ----------------------------------------------


def test_routing_stats_are_read_with_their_age_on_the_router_clock() -> None:
    report = {"budget_bytes": 100, "reserved_bytes": 30, "free_bytes": 70, "queue_depth": 2,
              "queued_bytes": 25, MEASURED_AT_KEY: 9_998.0}
    stats = ReplicaStats.from_routing_stats(report, replica_id="a", node_id="n1",
                                            now_s=500.0, unix_now_s=10_000.0)
    assert stats == ReplicaStats("a", node_id="n1", budget_bytes=100, reserved_bytes=30,
                                 free_bytes=70, queue_depth=2, queued_bytes=25,
                                 measured_at_s=498.0)
    assert stats.known
    future = ReplicaStats.from_routing_stats({MEASURED_AT_KEY: 10_005.0}, replica_id="a",
                                             now_s=500.0, unix_now_s=10_000.0)
    assert future.measured_at_s == 500.0


@pytest.mark.parametrize("report", [None, {}, {"free_bytes": 5, "queued_bytes": 0},
                                    {"budget_bytes": 0, "free_bytes": 0, "queued_bytes": 0},
                                    {"budget_bytes": 10, "free_bytes": -1, "queued_bytes": 0},
                                    {"budget_bytes": 10, "free_bytes": "5", "queued_bytes": 0},
                                    {"budget_bytes": 10, "free_bytes": True, "queued_bytes": 0},
                                    {"budget_bytes": 10, "free_bytes": float("nan"),
                                     "queued_bytes": 0, MEASURED_AT_KEY: "yesterday"}])
def test_missing_or_malformed_figures_are_unknown(report: dict | None) -> None:
    stats = ReplicaStats.from_routing_stats(report, replica_id="a", now_s=1.0, unix_now_s=2.0)
    assert not stats.known
    assert stats.measured_at_s is None
    assert headroom_bytes(stats, 0) is None


def priced(nbytes: object) -> InferenceRequest:
    """A request as the ingress sends it, carrying ``nbytes`` as its price."""
    return InferenceRequest("embed", ((1, 2),), Shape(1, 2, 0), estimated_bytes=nbytes)


def test_estimated_bytes_come_from_the_request_value() -> None:
    assert estimated_bytes_of([priced(1234)]) == 1234
    assert estimated_bytes_of(["something else", priced(1234)]) == 1234
    assert estimated_bytes_of([priced(12.9)]) == 12
    for args in (None, [], ["payload"], [priced(None)], [priced(-1)], [priced(True)],
                 [priced("1")]):
        assert estimated_bytes_of(args) is None


# --- properties ------------------------------------------------------------------------------

_figure = st.integers(min_value=0, max_value=10_000)


@st.composite
def _replicas(draw: st.DrawFn) -> list[ReplicaStats]:
    ids = draw(st.lists(st.text("abcdef", min_size=1, max_size=3), min_size=1, max_size=8,
                        unique=True))
    out = []
    for replica_id in ids:
        node = draw(st.sampled_from([None, "n1", "n2"]))
        if draw(st.booleans()) and draw(st.booleans()):
            out.append(ReplicaStats(replica_id, node_id=node))
            continue
        budget = draw(st.integers(min_value=1, max_value=10_000))
        free = draw(st.integers(min_value=0, max_value=budget))
        out.append(ReplicaStats(replica_id, node_id=node, budget_bytes=budget,
                                reserved_bytes=budget - free, free_bytes=free,
                                queue_depth=draw(_figure), queued_bytes=draw(_figure)))
    return out


@settings(max_examples=300, deadline=None)
@given(stats=_replicas(), request_bytes=st.none() | _figure,
       reserved=st.dictionaries(st.text("abcdef", min_size=1, max_size=3), _figure),
       local=st.sampled_from([None, "n1", "n2"]), seed=st.integers())
def test_ranking_is_a_permutation_with_every_fitting_replica_first(
        stats: list[ReplicaStats], request_bytes: int | None, reserved: dict[str, int],
        local: str | None, seed: int) -> None:
    fitting, rest = rank_replicas(stats, request_bytes, reserved, local)
    ids = [s.replica_id for s in stats]
    assert sorted(fitting + rest) == sorted(ids)            # a permutation: none dropped
    fits = {s.replica_id for s in stats if request_bytes is not None and s.known
            and headroom_bytes(s, reserved.get(s.replica_id, 0)) >= request_bytes}
    assert set(fitting) == fits                             # every fitting one before the rest
    # deterministic: the order of the candidates does not matter
    shuffled = list(stats)
    random.Random(seed).shuffle(shuffled)
    assert rank_replicas(shuffled, request_bytes, reserved, local) == [fitting, rest]


# --- the Ray adapter, on Ray's own fake replicas ----------------------------------------------

test_utils = pytest.importorskip("ray.serve._private.test_utils")
common = pytest.importorskip("ray.serve._private.common")


class StatsReplica(test_utils.FakeRunningReplica):
    """Ray's fake replica, answering queue-length probes with 0, plus ``routing_stats``."""

    def __init__(self, unique_id: str, stats: dict, node_id: str = "") -> None:
        super().__init__(unique_id, node_id=node_id)
        self.stats = stats
        self.set_queue_len_response(0)

    @property
    def routing_stats(self) -> dict:
        return self.stats


def _report(free: int, measured_at_unix_s: float | None = None) -> dict:
    report = {"budget_bytes": 100 * MB, "reserved_bytes": 100 * MB - free, "free_bytes": free,
              "queue_depth": 0, "queued_bytes": 0}
    if measured_at_unix_s is not None:
        report[MEASURED_AT_KEY] = measured_at_unix_s
    return report


def _router(replicas: list[StatsReplica], node_id: str | None = None):
    from deployments.cluster.router import BudgetAwareRequestRouter

    router = BudgetAwareRequestRouter(
        deployment_id=common.DeploymentID(name="model"),
        handle_source=common.DeploymentHandleSource.UNKNOWN, self_node_id=node_id,
        use_replica_queue_len_cache=False)
    router.initialize_state(arrival_grace_s=0.0)
    router.update_replicas(replicas)
    return router


def _request(internal_id: str, nbytes: int | None):
    from ray.serve.request_router import PendingRequest

    return PendingRequest(args=[priced(nbytes)], kwargs={}, metadata=common.RequestMetadata(
        request_id=internal_id, internal_request_id=internal_id))


def _ids(ranks: list[list]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def _pending(router) -> dict[str, int]:
    return router._budget_state.pending_by_replica()


async def test_adapter_returns_one_rank_per_replica_in_byte_order() -> None:
    replicas = [StatsReplica("a", _report(10 * MB)), StatsReplica("b", _report(60 * MB)),
                StatsReplica("c", {}), StatsReplica("d", _report(60 * MB), node_id="n1")]
    router = _router(replicas, node_id="n1")
    pr = _request("r1", 50 * MB)
    ranks = await router.choose_replicas(replicas, pr)
    assert _ids(ranks) == [["d"], ["b"], ["a"], ["c"]]
    assert pr.routing_context.should_backoff           # all refused: back off, do not spin
    assert _pending(router) == {"d": 50 * MB}          # tentative, on the first choice
    # the same request ranked again does not count against itself
    assert _ids(await router.choose_replicas(replicas, pr))[0] == ["d"]
    assert _pending(router) == {"d": 50 * MB}
    pr.future.cancel()                                 # caller gave up before assignment
    await asyncio.sleep(0)
    assert _pending(router) == {} and router._routed == {}


async def test_adapter_spreads_a_concurrent_burst_and_settles_on_completion() -> None:
    replicas = [StatsReplica("a", _report(100 * MB)), StatsReplica("b", _report(100 * MB))]
    router = _router(replicas)
    requests = [_request(f"r{i}", 40 * MB) for i in range(4)]
    chosen = await asyncio.gather(*(router._choose_replica_for_request(pr) for pr in requests))
    counts = {r.replica_id.unique_id: chosen.count(r) for r in replicas}
    assert counts == {"a": 2, "b": 2}
    await asyncio.sleep(0)
    assert _pending(router) == {"a": 80 * MB, "b": 80 * MB}
    for pr, replica_ in zip(requests, chosen, strict=True):
        router.on_request_completed(replica_.replica_id, pr.metadata.internal_request_id)
        router.on_request_completed(replica_.replica_id, pr.metadata.internal_request_id)
    assert _pending(router) == {} and router._routed == {}


async def test_adapter_moves_the_reservation_to_the_replica_ray_picked() -> None:
    replicas = [StatsReplica("a", _report(100 * MB)), StatsReplica("b", _report(50 * MB))]
    router = _router(replicas)
    pr = _request("r1", 30 * MB)
    # Both fit with nothing ahead: a tie, broken at random.
    assert sorted(_ids(await router.choose_replicas(replicas, pr))) == [["a"], ["b"]]
    pr.future.set_result(replicas[1])  # Ray sent it to "b" (e.g. "a" was full at Ray's check)
    await asyncio.sleep(0)
    assert _pending(router) == {"b": 30 * MB}
    router.on_request_completed(replicas[1].replica_id, "r1")
    assert _pending(router) == {} and router._routed == {}


async def test_adapter_settles_a_completion_that_beats_the_assignment_callback() -> None:
    replicas = [StatsReplica("a", _report(100 * MB))]
    router = _router(replicas)
    pr = _request("r1", 30 * MB)
    await router.choose_replicas(replicas, pr)
    pr.future.set_result(replicas[0])
    router.on_request_completed(replicas[0].replica_id, "r1")   # send failed synchronously
    await asyncio.sleep(0)
    assert _pending(router) == {} and router._routed == {}


async def test_adapter_drops_reservations_a_newer_report_covers() -> None:
    import time

    replicas = [StatsReplica("a", _report(100 * MB, time.time() - 60))]
    router = _router(replicas)
    pr = _request("r1", 30 * MB)
    await router.choose_replicas(replicas, pr)
    pr.future.set_result(replicas[0])
    await asyncio.sleep(0)
    assert _pending(router) == {"a": 30 * MB}
    await asyncio.sleep(0.01)
    replicas[0].stats = _report(70 * MB, time.time())  # the replica now shows the request
    assert _ids(await router.choose_replicas(replicas, _request("r2", None))) == [["a"]]
    assert _pending(router) == {}
    router.on_request_completed(replicas[0].replica_id, "r1")   # later completion: no-op
    assert _pending(router) == {} and router._routed == {}


async def test_adapter_rejects_unknown_router_kwargs() -> None:
    router = _router([])
    with pytest.raises(TypeError, match="unknown request_router_kwargs"):
        router.initialize_state(arrival_grace=1)


async def test_ray_loads_the_router_from_its_config_path_and_builds_it_as_ray_does() -> None:
    from ray.serve.config import RequestRouterConfig

    from deployments.cluster.router import ROUTER_CLASS_PATH

    config = RequestRouterConfig(request_router_class=ROUTER_CLASS_PATH,
                                 request_routing_stats_period_s=1.0,
                                 request_router_kwargs={"arrival_grace_s": 0.1, "max_age_s": 30})
    cls = config.get_request_router_class()        # cloudpickled, as handles receive it
    # the keyword arguments ray/serve/_private/router.py passes when it builds a router
    router = cls(deployment_id=common.DeploymentID(name="model"),
                 handle_source=common.DeploymentHandleSource.REPLICA, self_node_id="n1",
                 self_actor_id="actor", self_actor_handle=None,
                 use_replica_queue_len_cache=True, create_replica_wrapper_func=None,
                 prefer_local_node_routing=True, prefer_local_az_routing=False,
                 self_availability_zone=None)
    router.initialize_state(**config.request_router_kwargs)
    replicas = [StatsReplica("a", _report(10 * MB)), StatsReplica("b", _report(60 * MB), "n1")]
    router.update_replicas(replicas)
    assert _ids(await router.choose_replicas(replicas, _request("r1", 20 * MB))) == \
        [["b"], ["a"]]


def test_a_tie_break_orders_replicas_equal_on_everything_else() -> None:
    idle = [ReplicaStats(name, node_id="n1", budget_bytes=100 * MB, reserved_bytes=0,
                         free_bytes=100 * MB, queue_depth=0, queued_bytes=0, measured_at_s=0.0)
            for name in ("a", "b")]
    assert rank_replicas(idle, 10 * MB, {}, None) == [["a", "b"], []]
    assert rank_replicas(idle, 10 * MB, {}, None, tie_break={"a": 0.9, "b": 0.1}) == [
        ["b", "a"], []]
    # It never outranks a real difference: bytes ahead come first.
    assert rank_replicas(idle, 10 * MB, {"b": 5 * MB}, None,
                         tie_break={"a": 0.9, "b": 0.1}) == [["a", "b"], []]
