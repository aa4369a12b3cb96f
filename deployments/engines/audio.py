"""Audio files into the samples a speech model reads: decoded by libsndfile (the
``soundfile`` wheels bundle it, with MP3 since libsndfile 1.1), mixed down to mono, resampled
to 16 kHz by libsoxr (``soxr``, its "HQ" quality). No torch here: the ingress runs it."""

from __future__ import annotations

import io

import numpy as np
import soundfile
import soxr

from serve_app.errors import BodyTooLargeError, InvalidRequestError
from serve_app.request import AUDIO_SAMPLE_RATE_HZ


def decode_audio(data: bytes, max_audio_bytes: int, rate_hz: int = AUDIO_SAMPLE_RATE_HZ,
                 name: str = "the file") -> np.ndarray:
    """The file ``data`` as float32 mono samples at ``rate_hz``, shape ``(samples,)``.

    Any format libsndfile reads (WAV, FLAC, MP3, OGG/Vorbis, Opus, AIFF, ...); channels are
    averaged; other rates are resampled with libsoxr's HQ filter. ``name`` is what a refusal
    calls the file (e.g. ``the uploaded file 'a.wav' (9 bytes)``).

    Raises:
        BodyTooLargeError: ``data`` is larger than ``max_audio_bytes`` (413, code ``file``,
            naming ``limits.max_audio_bytes``).
        InvalidRequestError: ``data`` is not audio libsndfile can decode, or holds no
            samples (400, code ``file``).
    """
    if len(data) > max_audio_bytes:
        raise BodyTooLargeError(f"the file has {len(data)} bytes; the limit is "
                                f"limits.max_audio_bytes = {max_audio_bytes}", code="file")
    try:
        samples, source_rate_hz = soundfile.read(io.BytesIO(data), dtype="float32",
                                                 always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        # libsndfile's own words, without the "Error opening <_io.BytesIO object at 0x...>"
        # it puts before them.
        reason = getattr(exc, "error_string", None) or str(exc)
        raise InvalidRequestError(f"{name} is not audio that can be decoded (WAV, FLAC, "
                                  f"MP3, OGG, ...): {reason}", code="file") from None
    if samples.size == 0:
        raise InvalidRequestError(f"{name} holds no audio samples", code="file")
    mono = samples.mean(axis=1, dtype=np.float32)
    if source_rate_hz != rate_hz:
        mono = soxr.resample(mono, source_rate_hz, rate_hz, quality="HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)
