"""Transcriptions through a model replica's own lifecycle (no Ray): built and priced at the
ingress from audio files, leased at the router's estimate, batched by their batch key into
one padded pass priced as a whole, each answered what it gets alone, nothing leased after."""

from __future__ import annotations

import asyncio
import io
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import soundfile

from deployments.engines.devices import make_probe
from deployments.engines.transcribe import TranscribeEngine
from deployments.http.request_factory import RequestFactory
from deployments.replica.parts import Replica
from serve_app.admission.policy import policy_class
from serve_app.config import parse_args
from serve_app.kinds import KINDS
from serve_app.memory.cost_model import FittedCostModel, Shape
from serve_app.metrics import ProcessMetrics
from serve_app.pricing import estimate_units, shape_bytes
from tests.support import build_tiny_whisper, tone
from tests.unit.conftest import assert_idle

# A cost model over the engine's own features (coefficients as a CPU profile measured them,
# rounded): 16 MiB + 3 MiB per file + 17 MiB per file and window + 450 B per file and frame.
COST_MODEL = FittedCostModel(("const", "files", "files_audio_windows", "files_audio_frames"),
                             (16e6, 3e6, 17e6, 450.0))


def wav(seconds: float, frequency_hz: float) -> bytes:
    file = io.BytesIO()
    soundfile.write(file, tone(seconds, frequency_hz), 16_000, format="WAV")
    return file.getvalue()


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper") / "model")


async def _serve(whisper_dir, files: list[tuple[float, float, str]]):
    args = parse_args({"model": {"engine": "transcribe", "path": str(whisper_dir),
                                 "device": "cpu"},
                       "batching": {"max_batch_size": 4, "max_wait_ms": 300},
                       "limits": {"max_audio_s": 60}})
    engine = TranscribeEngine.load(args, "cpu")
    executor = ThreadPoolExecutor(max_workers=1)
    replica = Replica(engine, make_probe("cpu", args), COST_MODEL, 1 << 40, args, executor,
                      ProcessMetrics("ModelServer", "test", use_ray=False))
    factory = RequestFactory(args, TranscribeEngine.front_end(args))  # the ingress's
    published = replica.state().cost_model
    try:
        kind = KINDS["transcribe"]
        requests = [await factory.build_transcription(kind, wav(s, f), "", language, 0.0,
                                                      "json")
                    for s, f, language in files]
        estimates = [estimate_units([published], r.shape, policy_class("budget"))
                     for r in requests]
        charged = replica.gate.budget.charged_bytes_total
        results = await asyncio.gather(*(replica.lifecycle.infer(r.sent(e, time.time()))
                                          for r, e in zip(requests, estimates, strict=True)))
        leased = replica.gate.budget.charged_bytes_total - charged
        await asyncio.get_running_loop().run_in_executor(executor, lambda: None)
        assert_idle(replica.gate.queue)
        return engine, requests, estimates, leased, results, replica.batcher.passes
    finally:
        replica.close()
        executor.shutdown(wait=True)


def test_transcriptions_are_leased_their_estimate_and_share_one_pass(whisper_dir) -> None:
    files = [(3, 440, "en"), (25, 220, "en"), (17, 1300, "en")]
    engine, requests, estimates, leased, results, passes = asyncio.run(
        _serve(whisper_dir, files))
    assert [r.shape for r in requests] == [Shape(1, 300, 0), Shape(1, 2500, 0),
                                           Shape(1, 1700, 0)]
    assert estimates == [shape_bytes(COST_MODEL, r.shape) for r in requests]
    assert leased == sum(estimates)
    # One pass of 3 files padded to 2500 frames (one window each) fits their leases.
    assert shape_bytes(COST_MODEL, Shape(3, 2500, 0)) <= sum(estimates)
    assert passes == 1
    alone = [engine.run_batch([r])[0] for r in requests]
    assert [r.output for r in results] == alone


def test_a_pass_that_would_cost_more_than_its_leases_is_not_formed(whisper_dir) -> None:
    """A 3 s file padded to a 45 s one's two windows would cost more than both leases."""
    files = [(3, 440, "en"), (45, 220, "en")]
    engine, requests, estimates, _, results, passes = asyncio.run(_serve(whisper_dir, files))
    assert shape_bytes(COST_MODEL, Shape(2, 4500, 0)) > sum(estimates)
    assert passes == 2
    assert [r.output for r in results] == [engine.run_batch([r])[0] for r in requests]


def test_another_language_runs_in_its_own_pass(whisper_dir) -> None:
    files = [(5, 440, "en"), (6, 880, "fr")]
    _, requests, _, _, results, passes = asyncio.run(_serve(whisper_dir, files))
    assert requests[0].batch_key != requests[1].batch_key
    assert passes == 2
    assert [r.output.language for r in results] == ["en", "fr"]
