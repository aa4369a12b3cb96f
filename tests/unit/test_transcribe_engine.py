"""Speech to text on a small random Whisper built at test time: the engine's transcript is
what ``WhisperForConditionalGeneration.generate`` + ``processor.batch_decode`` give for the
same audio (greedy, long-form with timestamps past 30 s), a batch gives each file its own
transcript, audio files decode as libsndfile and libsoxr make them, and the route's limits
answer 413 / 400 naming the knob."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
import soxr
from fastapi.testclient import TestClient

from deployments.engines.audio import decode_audio
from deployments.engines.registry import engine_class
from deployments.engines.transcribe import TranscribeEngine
from deployments.http.idempotency_guard import IdempotencyGuard
from deployments.http.request_factory import RequestFactory
from serve_app.config import parse_args
from serve_app.errors import BodyTooLargeError, InvalidRequestError
from serve_app.kinds import KINDS, audio_frames, build_request
from serve_app.memory.cost_model import Shape
from serve_app.metrics import ProcessMetrics
from serve_app.request import InferenceRequest, TranscriptionParams
from tests.ingress_parts import ingress_app
from tests.support import WHISPER_LANGUAGES, build_tiny_whisper, tone, whisper_reference

RATE_HZ = 16_000


AUDIO = {"5s": tone(5, 440), "17s": tone(17, 1300), "45s": tone(45, 220),
         "62s": tone(62, 3000)}


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper") / "model")


@pytest.fixture(scope="module")
def engine(whisper_dir) -> TranscribeEngine:
    return TranscribeEngine(whisper_dir, "cpu", "float32", max_batch_files=4)


def request_of(audio: np.ndarray, language: str | None = "en") -> InferenceRequest:
    params = TranscriptionParams(audio, language=language)
    return InferenceRequest("transcribe", ((),), Shape(1, audio_frames(len(audio)), 0), params)


@pytest.mark.parametrize("name", ["5s", "17s", "45s", "62s"])
def test_a_transcript_is_what_generate_and_batch_decode_give(engine, name) -> None:
    audio = AUDIO[name]
    [output] = engine.run_batch([request_of(audio)])
    assert output.text == whisper_reference(engine.path, audio, "en")
    assert output.text  # the tiny model writes text (tests/support.py: build_tiny_whisper)
    assert output.language == "en"
    assert output.duration_s == pytest.approx(len(audio) / RATE_HZ)
    windows = -(-len(audio) // (30 * RATE_HZ))
    assert len(output.segments) == windows  # one segment per window (no closing timestamp)
    assert "".join(s.text for s in output.segments) == output.text
    assert all(0 <= s.start_s <= s.end_s <= output.duration_s for s in output.segments)


def test_a_detected_language_is_generate_s_own(engine) -> None:
    audio = AUDIO["17s"]
    [output] = engine.run_batch([request_of(audio, language=None)])
    assert output.language in WHISPER_LANGUAGES
    assert output.text == whisper_reference(engine.path, audio, None)


@pytest.mark.parametrize("name", ["5s", "45s"])
def test_a_prompt_conditions_the_transcript_as_generate_s_prompt_ids(engine, name) -> None:
    audio, prompt = AUDIO[name], "hello there"
    [ids] = engine.front.tokenize([prompt])
    request = InferenceRequest("transcribe", (tuple(ids),), Shape(1, 1, 0),
                               TranscriptionParams(audio, prompt=prompt, language="en"))
    [output] = engine.run_batch([request])
    assert output.text == whisper_reference(engine.path, audio, "en", prompt)
    assert output.text != engine.run_batch([request_of(audio)])[0].text


def test_a_batch_gives_each_file_what_it_gets_alone(engine) -> None:
    requests = [request_of(AUDIO[name]) for name in ("45s", "5s", "62s", "17s")]
    alone = [engine.run_batch([r])[0] for r in requests]
    together = engine.run_batch(requests)
    assert together == alone
    assert len({o.duration_s for o in together}) == 4


def test_the_canary_reads_a_finite_encoder_output(engine) -> None:
    assert engine.canary() is True


# --- audio files ----------------------------------------------------------------------------

@pytest.mark.parametrize(("fmt", "subtype", "tolerance"), [
    ("WAV", "PCM_16", 2e-3), ("FLAC", "PCM_16", 2e-3), ("MP3", "MPEG_LAYER_III", None)])
def test_wav_flac_and_mp3_decode_to_16_khz_mono(fmt, subtype, tolerance) -> None:
    stereo = tone(3, 440, rate_hz=44_100, channels=2)
    file = io.BytesIO()
    soundfile.write(file, stereo, 44_100, format=fmt, subtype=subtype)
    decoded = decode_audio(file.getvalue(), max_audio_bytes=1 << 30)
    expected = soxr.resample(stereo.mean(axis=1), 44_100, RATE_HZ, quality="HQ")
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    if tolerance is not None:  # lossless: the samples, up to 16-bit quantisation
        assert decoded.shape == expected.shape
        assert np.abs(decoded - expected).max() < tolerance
    else:  # lossy, and MP3 adds encoder delay and padding: the length and the tone
        assert abs(len(decoded) - len(expected)) < 0.1 * RATE_HZ
        spectrum = np.abs(np.fft.rfft(decoded))
        assert np.argmax(spectrum) * RATE_HZ / len(decoded) == pytest.approx(440, abs=5)


def test_undecodable_and_oversized_files_are_refused_with_their_codes() -> None:
    with pytest.raises(InvalidRequestError) as bad:
        decode_audio(b"this is not audio at all", max_audio_bytes=1 << 20)
    assert (bad.value.status_code, bad.value.code) == (400, "file")
    assert bad.value.message == ("the file is not audio that can be decoded (WAV, FLAC, MP3, "
                                 "OGG, ...): Format not recognised.")
    file = io.BytesIO()
    soundfile.write(file, tone(1, 440), RATE_HZ, format="WAV")
    with pytest.raises(BodyTooLargeError) as big:
        decode_audio(file.getvalue(), max_audio_bytes=1000)
    assert (big.value.status_code, big.value.code) == (413, "file")
    assert "limits.max_audio_bytes = 1000" in big.value.message


# --- the route, through the ingress's own FastAPI app (no Ray: refusals come before a replica)

def wav_bytes(audio: np.ndarray, rate_hz: int = RATE_HZ) -> bytes:
    file = io.BytesIO()
    soundfile.write(file, audio, rate_hz, format="WAV")
    return file.getvalue()


@pytest.fixture(scope="module")
def http(whisper_dir):
    args = parse_args({"model": {"engine": "transcribe", "path": str(whisper_dir),
                                 "name": "tiny-whisper"},
                       "limits": {"max_audio_bytes": 400_000, "max_audio_s": 10}})
    metrics = ProcessMetrics("Ingress", "test", use_ray=False)
    front_end = engine_class(args).front_end(args)
    guard = IdempotencyGuard(None, None, 1.0, metrics)
    app = ingress_app(args, factory=RequestFactory(args, front_end), guard=guard)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def post(client: TestClient, data: bytes, **form: str):
    return client.post("/v1/audio/transcriptions", files={"file": ("a.wav", data)},
                       data={"model": "tiny-whisper", **form})


def test_the_route_refuses_what_the_limits_refuse_naming_the_knob(http) -> None:
    too_big = post(http, wav_bytes(tone(13, 440)))  # 416 kB > 400 kB
    assert too_big.status_code == 413
    assert too_big.json()["error"]["code"] == "file"
    assert "limits.max_audio_bytes" in too_big.json()["error"]["message"]
    too_long = post(http, wav_bytes(tone(11, 440, rate_hz=8000), rate_hz=8000))  # 176 kB
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "file"
    assert "limits.max_audio_s = 10 s" in too_long.json()["error"]["message"]
    garbage = post(http, b"\x00\x01 not audio")
    assert (garbage.status_code, garbage.json()["error"]["code"]) == (400, "file")
    assert garbage.json()["error"]["message"] == (  # not libsndfile's "<_io.BytesIO object>"
        "the uploaded file 'a.wav' (12 bytes) is not audio that can be decoded (WAV, FLAC, "
        "MP3, OGG, ...): Format not recognised.")
    empty = post(http, b"")
    assert (empty.status_code, empty.json()["error"]["code"]) == (400, "file")
    assert empty.json()["error"]["message"] == "the uploaded file 'a.wav' is empty (0 bytes)"


@pytest.mark.parametrize(("form", "code"), [
    ({"language": "xx"}, "language"), ({"response_format": "srt"}, "response_format"),
    ({"temperature": "1.5"}, "temperature"), ({"model": "other"}, "model_not_found"),
    ({"prompt": "word " * 40}, "prompt")])
def test_the_route_refuses_bad_fields_naming_them(http, form, code) -> None:
    response = post(http, wav_bytes(tone(1, 440)), **form)
    assert response.status_code in (400, 404)
    assert response.json()["error"]["code"] == code


def test_the_openapi_schema_declares_the_multipart_body(http) -> None:
    schema = http.get("/openapi.json").json()
    operation = schema["paths"]["/v1/audio/transcriptions"]["post"]
    body = operation["requestBody"]["content"]["multipart/form-data"]["schema"]
    ref = body["$ref"].rsplit("/", 1)[-1]
    fields = schema["components"]["schemas"][ref]
    assert set(fields["properties"]) == {"file", "model", "language", "prompt", "temperature",
                                         "response_format"}
    assert fields["required"] == ["file"]
    assert fields["properties"]["file"]["type"] == "string"
    assert fields["properties"]["file"]["contentMediaType"] == "application/octet-stream"
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/plain"}


def test_a_request_is_priced_by_its_frames_and_batched_by_language_and_prompt(
        whisper_dir) -> None:
    args = parse_args({"model": {"engine": "transcribe", "path": str(whisper_dir)}})
    kind = KINDS["transcribe"]
    one = build_request(kind, [[]], TranscriptionParams(AUDIO["17s"], language="en"), False,
                        args, 24)
    assert one.shape == Shape(1, 1700, 0)
    assert kind.pass_length(one) == 1700
    other = build_request(kind, [[]], TranscriptionParams(AUDIO["5s"], language="fr"), False,
                          args, 24)
    assert one.batch_key != other.batch_key
    assert kind.largest_shape(args.limits, 24) == Shape(1, 12_000, 0)  # 120 s


def test_replies_have_openai_s_shapes(engine) -> None:
    from deployments.http.routes.transcriptions import (
        TranscriptionForm,
        TranscriptionResponse,
        VerboseTranscriptionResponse,
        _render,
    )
    from serve_app.schemas import Admitted, InferenceResult

    [output] = engine.run_batch([request_of(AUDIO["45s"])])
    result = InferenceResult(output, Admitted(0.0, 0), "r")
    plain = _render(TranscriptionForm(file_sha256="-"), result)
    assert TranscriptionResponse(**plain).text == output.text
    assert plain["usage"] == {"type": "duration", "seconds": 45}
    verbose = _render(TranscriptionForm(file_sha256="-", response_format="verbose_json"),
                      result)
    checked = VerboseTranscriptionResponse(**verbose)
    assert (checked.task, checked.language, checked.duration) == ("transcribe", "en", 45.0)
    assert [s.seek for s in checked.segments] == [0, 3000]  # one per 30 s window
    assert "".join(s.text for s in checked.segments) == checked.text == output.text


def test_the_engine_refuses_a_config_it_cannot_serve(tmp_path, whisper_dir) -> None:
    from serve_app.config import ConfigError

    with pytest.raises(ConfigError, match="model.path: the transcribe engine needs"):
        engine_class(parse_args({"model": {"engine": "transcribe"}}))
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ConfigError, match="model_type 'bert', not 'whisper'"):
        engine_class(parse_args({"model": {"engine": "transcribe", "path": str(tmp_path)}}))
    args = parse_args({"model": {"engine": "transcribe", "path": str(whisper_dir)}})
    assert engine_class(args) is TranscribeEngine
