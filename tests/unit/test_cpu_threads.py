"""A CPU replica's torch thread count (:mod:`deployments.engines.cpu_threads`): the fewest
threads within the tolerance of the best measured throughput, unmeasured when
``model.num_threads`` is set, and shown in the replica's status."""

from __future__ import annotations

import pytest
import torch

from deployments.engines.cpu_threads import (
    MIN_ROUNDS,
    TOLERANCE,
    candidate_threads,
    choose_threads,
    pick_threads,
    probe_shape,
    time_candidates,
)
from deployments.replica.profiling import measure_replica
from serve_app.config import parse_args
from serve_app.memory.cost_model import Shape
from tests.embedding_dirs import build_sentence_transformer
from tests.unit.conftest import FakeClock


class FakeMachine:
    """A run whose time depends only on the threads set: the clock moves by
    ``seconds[threads]`` per run (slower on the first run of each count: its warm-up)."""

    def __init__(self, seconds: dict[int, float], clock: FakeClock) -> None:
        self.seconds, self.clock = seconds, clock
        self.threads, self.runs, self.settings = 1, [], []
        self.warm: set[int] = set()

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.settings.append(n)

    def run(self, *_: object) -> None:
        first = self.threads not in self.warm
        self.warm.add(self.threads)
        self.runs.append(self.threads)
        self.clock.advance(self.seconds[self.threads] * (5 if first else 1))


def test_candidates_double_up_to_the_cores() -> None:
    assert candidate_threads(1) == [1]
    assert candidate_threads(2) == [1, 2]
    assert candidate_threads(8) == [1, 2, 4, 8]
    assert candidate_threads(6) == [1, 2, 4, 6]


@pytest.mark.parametrize(("seconds", "expected"), [
    ({1: 1.0, 2: 0.52, 4: 0.50, 8: 0.51}, 2),    # 2 threads: 96 % of the best
    ({1: 1.0, 2: 0.60, 4: 0.50, 8: 0.55}, 4),    # 2: 83 %, 8: 91 %, below the 4's
    ({1: 1.0, 2: 1.3}, 1),                        # more threads slower (a busy node)
    ({1: 1.0, 2: 0.5 / (1 - TOLERANCE)}, 2),      # exactly at the tolerance: kept
    ({1: 1.0, 2: 0.5, 4: 0.5 / (1 - TOLERANCE) * 1.001}, 2),
])
def test_the_fewest_threads_within_the_tolerance_of_the_best_are_kept(seconds, expected):
    assert pick_threads(seconds) == expected


def test_each_candidate_is_warmed_then_timed_in_interleaved_rounds(clock) -> None:
    machine = FakeMachine({1: 0.4, 2: 0.21, 4: 0.2, 8: 0.3}, clock)
    seconds = time_candidates(machine.run, [1, 2, 4, 8], machine.set_threads, clock,
                              budget_s=1.0)
    # The warm-up runs (5x slower) are not counted; every candidate's time is its run's.
    assert seconds == pytest.approx({1: 0.4, 2: 0.21, 4: 0.2, 8: 0.3})
    assert machine.runs[:4] == [1, 2, 4, 8]
    assert machine.runs[4:] == [1, 2, 4, 8] * MIN_ROUNDS  # over budget after the minimum
    assert pick_threads(seconds) == 2


def test_the_chooser_measures_sets_and_reports(clock) -> None:
    machine = FakeMachine({1: 1.0, 2: 0.55, 4: 0.5, 8: 0.5}, clock)
    args = parse_args({"model": {"task": "fake"}})
    shape = Shape(16, 128, 0)
    choice = choose_threads(args, machine.run, shape, machine.set_threads, cores=8,
                            clock=clock)
    assert (choice.threads, choice.chosen_by, choice.cores) == (4, "measured", 8)
    assert machine.settings[-1] == 4  # what the replica computes with from now on
    status = choice.describe()
    assert status["probe"] == {"inputs": 16, "prompt_tokens": 128, "new_tokens": 0}
    assert [c["threads"] for c in status["candidates"]] == [1, 2, 4, 8]
    assert status["candidates"][0]["items_per_s"] == 16.0
    assert "items/s by threads {1: 16.0, 2: 29.1, 4: 32.0, 8: 32.0}" in choice.summary()


def test_an_explicit_num_threads_is_used_unmeasured(clock) -> None:
    machine = FakeMachine({3: 1.0}, clock)
    args = parse_args({"model": {"task": "fake", "num_threads": 3}})
    choice = choose_threads(args, machine.run, Shape(16, 128, 0), machine.set_threads,
                            cores=8)
    assert machine.runs == []
    assert machine.settings == [3]
    assert (choice.threads, choice.chosen_by) == (3, "model.num_threads")
    assert choice.describe()["candidates"] == []


def test_one_core_leaves_nothing_to_measure(clock) -> None:
    machine = FakeMachine({1: 1.0}, clock)
    choice = choose_threads(parse_args({"model": {"task": "fake"}}), machine.run,
                            Shape(1, 1, 0), machine.set_threads, cores=1)
    assert (choice.threads, choice.chosen_by, machine.runs) == (1, "one core", [])


def test_the_probe_is_a_typical_request_within_the_limits() -> None:
    args = parse_args({"limits": {"max_inputs": 4, "max_input_tokens": 64, "max_tokens": 4}})
    assert probe_shape(args, 512, is_decoder=False) == Shape(4, 64, 0)
    assert probe_shape(args, 512, is_decoder=True) == Shape(1, 64, 4)
    assert probe_shape(parse_args({}), 100, is_decoder=True) == Shape(1, 92, 8)
    # The P95 request the deployment is planned for (deployment.p95_inputs x p95_input_tokens).
    assert probe_shape(parse_args({}), 512, is_decoder=False) == Shape(8, 128, 0)
    p95 = parse_args({"deployment": {"p95_inputs": 16, "p95_input_tokens": 20}})
    assert probe_shape(p95, 512, is_decoder=False) == Shape(16, 20, 0)


@pytest.fixture
def torch_threads():
    """Whatever a replica measured here, the rest of the session keeps torch's setting."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [None, 1])
def test_a_cpu_replica_reports_its_choice(tmp_path, torch_threads, num_threads) -> None:
    path = build_sentence_transformer(tmp_path / "model")
    args = parse_args({"model": {"task": "embed", "path": str(path), "device": "cpu",
                                 "num_threads": num_threads},
                       "memory": {"capacity_bytes": 1 << 30, "reserve_bytes": 0},
                       "limits": {"max_inputs": 16, "max_input_tokens": 32},
                       "deployment": {"p95_inputs": 16}})
    measured = measure_replica(args, on_progress=lambda _: None)
    status = measured.memory_status(args)["cpu_threads"]
    assert torch.get_num_threads() == status["threads"]
    if num_threads is None:
        assert status["chosen_by"] in ("measured", "one core")
        assert status["probe"] == {"inputs": 16, "prompt_tokens": 32, "new_tokens": 0}
        assert [c["threads"] for c in status["candidates"]][:1] in ([1], [])
        assert all(c["items_per_s"] > 0 for c in status["candidates"])
    else:
        assert (status["threads"], status["chosen_by"]) == (1, "model.num_threads")
