"""Start-up profiling of real models on CPU: the fitted cost model predicts held-out sizes
within the documented error, and the analytic estimate agrees within its documented factor.

Each profile is measured in a fresh process, as a replica measures at start-up: host-RSS peaks
taken inside the test runner would also count what its other threads allocate meanwhile (a
Ray driver's, once the integration tests have run)."""

from __future__ import annotations

import pytest

from deployments.replica.profiling import measure_replica
from serve_app.config import parse_args
from serve_app.memory.profiler import ANALYTIC_FACTOR_BOUND, CPU_FIT_ERROR_BOUND
from tests.support import build_tiny_causal_lm, measure_in_fresh_process


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    # Wide enough that its smallest held-out peak (about 4.7 MiB) stands above RSS page noise
    # (256 wide it was 1.1 MiB, and the fit error reached 41 %: see CPU_FIT_ERROR_BOUND).
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-lm") / "model", num_layers=4,
                                hidden_size=1024)


def _check(args: dict) -> None:
    profile, max_request_bytes, budget_bytes = measure_in_fresh_process(args)
    print(f"\n{args['model'].get('task', 'embed')}: fit error {profile.held_out_error:.1%}, "
          f"analytic/measured {profile.analytic_ratio_range}\n{profile.table()}")
    assert [p.held_out for p in profile.points].count(True) == 2
    assert profile.held_out_error <= CPU_FIT_ERROR_BOUND
    low, high = profile.analytic_ratio_range
    assert 1 / ANALYTIC_FACTOR_BOUND <= low <= high <= ANALYTIC_FACTOR_BOUND
    largest = max(profile.points, key=lambda p: p.measured_bytes)
    assert max_request_bytes >= largest.predicted_bytes
    assert budget_bytes >= max_request_bytes


def test_minilm_profile_is_within_the_documented_error() -> None:
    _check({"model": {"device": "cpu"}, "limits": {"max_inputs": 64, "max_input_tokens": 256}})


def test_causal_lm_profile_is_within_the_documented_error(tiny_lm) -> None:
    _check({"model": {"task": "generate", "path": str(tiny_lm), "device": "cpu"},
            "limits": {"max_input_tokens": 256, "max_tokens": 128}})


def test_fake_engine_profile_is_exact_and_budgets_its_share() -> None:
    args = parse_args({"model": {"task": "fake"}, "deployment": {"num_gpus": 0.5},
                       "fake": {"device_capacity_bytes": 16 << 30, "weights_bytes": 1 << 30},
                       "limits": {"max_inputs": 4, "max_input_tokens": 64, "max_tokens": 32}})
    measured = measure_replica(args, on_progress=lambda _: None)
    assert measured.probe.capacity_bytes() == 8 << 30
    assert measured.profile.held_bytes == 1 << 30
    assert measured.budget_bytes == int(((8 << 30) - (1 << 30)) * 0.9)
    assert measured.profile.held_out_error < 1e-6
    # bytes_per_token (1 MiB) x 4 x (64 + 32) tokens
    assert abs(measured.max_request_bytes - 4 * 96 * (1 << 20)) <= 1
