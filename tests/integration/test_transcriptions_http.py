"""``POST /v1/audio/transcriptions`` on a local Ray Serve with a tiny random Whisper built at
test time: the official ``openai`` client works unchanged (``json``, ``text``,
``verbose_json``), the transcript is transformers' own, refusals name their limit, and
concurrent transcriptions leave nothing leased."""

from __future__ import annotations

import asyncio
import collections
import io

import httpx
import numpy as np
import pytest
import soundfile
from openai import OpenAI

from deployments.engines.transcribe import TranscribeEngine
from tests.support import build_tiny_whisper, tone, whisper_reference

NAME = "tiny-whisper"
# 20 concurrent uploads of mixed durations, seconds: one window, a few, and two windows.
DURATIONS_S = (3, 17, 45, 5, 29, 8, 12, 1, 33, 21) * 2


def wav(audio: np.ndarray, rate_hz: int = 16_000, fmt: str = "WAV") -> bytes:
    file = io.BytesIO()
    soundfile.write(file, audio, rate_hz, format=fmt)
    return file.getvalue()


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper") / "model")


@pytest.fixture(scope="module")
def app(deploy, whisper_dir):
    return deploy({"model": {"engine": "transcribe", "path": str(whisper_dir), "name": NAME,
                             "device": "cpu"},
                   "limits": {"max_audio_s": 60, "max_audio_bytes": 2_000_000},
                   "batching": {"max_batch_size": 4}})


@pytest.fixture(scope="module")
def engine(whisper_dir) -> TranscribeEngine:
    return TranscribeEngine(whisper_dir, "cpu", "float32")


def test_the_openai_client_transcribes_unchanged(app, engine) -> None:
    client = OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0)
    audio = tone(12, 440)
    expected = whisper_reference(engine.path, audio, "en")
    got = client.audio.transcriptions.create(model=NAME, file=("a.wav", wav(audio)),
                                             language="en")
    assert got.text == expected and expected
    text = client.audio.transcriptions.create(model=NAME, file=("a.flac", wav(audio, fmt="FLAC")),
                                              language="en", response_format="text")
    assert text == expected
    verbose = client.audio.transcriptions.create(model=NAME, file=("a.wav", wav(audio)),
                                                 language="en", response_format="verbose_json")
    assert verbose.text == expected
    assert verbose.language == "en" and verbose.duration == pytest.approx(12.0)
    assert "".join(s.text for s in verbose.segments) == expected
    app.check_invariants()


def test_long_audio_is_transcribed_in_windows(app, engine, client) -> None:
    audio = tone(45, 220)
    response = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav(audio))},
                           data={"language": "en", "response_format": "verbose_json"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["text"] == whisper_reference(engine.path, audio, "en")
    assert len(body["segments"]) == 2  # two 30 s windows


def test_refusals_name_their_limit(app, client) -> None:
    big = client.post("/v1/audio/transcriptions",
                      files={"file": ("a.wav", wav(tone(70, 440)))})  # 2.24 MB
    assert big.status_code == 413 and "limits.max_audio_bytes" in big.json()["error"]["message"]
    long = client.post("/v1/audio/transcriptions",
                       files={"file": ("a.wav", wav(tone(61, 440, rate_hz=8000), 8000))})
    assert long.status_code == 400 and "limits.max_audio_s" in long.json()["error"]["message"]
    garbage = client.post("/v1/audio/transcriptions", files={"file": ("a.mp3", b"not audio")})
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "file"
    assert garbage.json()["error"]["message"] == (
        "the uploaded file 'a.mp3' (9 bytes) is not audio that can be decoded (WAV, FLAC, "
        "MP3, OGG, ...): Format not recognised.")
    empty = client.post("/v1/audio/transcriptions", files={"file": ("b.wav", b"")})
    assert empty.status_code == 400 and empty.json()["error"] == {
        "message": "the uploaded file 'b.wav' is empty (0 bytes)",
        "type": "invalid_request_error", "code": "file"}


async def test_concurrent_transcriptions_are_admitted_and_leave_nothing_leased(app) -> None:
    async with httpx.AsyncClient(base_url=app.base_url, timeout=300) as http:
        responses = await asyncio.gather(*(
            http.post("/v1/audio/transcriptions", data={"language": "en"},
                      files={"file": ("a.wav", wav(tone(seconds, 300 + 50 * i)))})
            for i, seconds in enumerate(DURATIONS_S)))
    print(f"\n{len(responses)} concurrent uploads: "
          f"{sorted(collections.Counter(r.status_code for r in responses).items())}")
    assert {r.status_code for r in responses} <= {200, 503}, [r.text for r in responses]
    assert any(r.status_code == 200 for r in responses)
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
    [replica] = app.check_invariants()
    assert replica["kinds"] == ["transcribe"]
    assert replica["profile"]["shape_axes"] == ["files", "audio_frames", "new_tokens"]
    assert replica["peak_reserved_bytes"] <= replica["budget_bytes"]
