"""The speech engine's memory profile on CPU, measured in a fresh process as a replica
measures it at start-up: its own axes (files, audio frames), its own features, held-out
durations (3 s, 17 s, 45 s) predicted within the documented CPU bound, and a longer file
priced above a shorter one."""

from __future__ import annotations

import pytest

import deployments.engines.transcribe  # noqa: F401  registers the features the profile names
from serve_app.kinds import audio_frames
from serve_app.memory.cost_model import Shape, relative_error
from serve_app.memory.profiler import CPU_FIT_ERROR_BOUND
from serve_app.pricing import shape_bytes
from tests.support import build_tiny_whisper, measure_in_fresh_process


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper") / "model")
    args = {"model": {"engine": "transcribe", "path": str(path), "device": "cpu"},
            "limits": {"max_audio_s": 60}, "batching": {"max_batch_size": 4}}
    profile, max_request_bytes, budget_bytes = measure_in_fresh_process(args)
    print(f"\ntranscribe: fit error {profile.held_out_error:.1%}\n{profile.table()}\n"
          f"{profile.cost_model}")
    assert budget_bytes >= max_request_bytes
    return profile


def test_the_profile_is_over_the_engine_s_axes_and_features(profile) -> None:
    assert profile.shape_axes == ("files", "audio_frames", "new_tokens")
    assert profile.table().split()[:3] == ["files", "audio_frames", "new_tokens"]
    assert set(profile.cost_model.features) <= {"const", "files", "files_audio_windows",
                                                 "files_audio_frames"}
    assert profile.summary()["shape_axes"] == ["files", "audio_frames", "new_tokens"]


def test_held_out_durations_are_predicted_within_the_documented_bound(profile) -> None:
    held = [p for p in profile.points if p.held_out]
    assert [(p.batch, p.prompt_tokens) for p in held] == [(1, 300), (2, 1700), (1, 4500)]
    for p in held:
        assert relative_error(p.predicted_bytes, p.measured_bytes) <= CPU_FIT_ERROR_BOUND
    assert profile.held_out_error <= CPU_FIT_ERROR_BOUND


def test_a_60_s_file_is_priced_above_a_5_s_one(profile) -> None:
    model = profile.cost_model
    five, sixty = (shape_bytes(model, Shape(1, audio_frames(s * 16_000), 0)) for s in (5, 60))
    print(f"\nprice of 5 s: {five} bytes ({five / 2**20:.1f} MiB), 60 s: {sixty} bytes "
          f"({sixty / 2**20:.1f} MiB)")
    assert sixty > five > 0
