"""Speech to text with Whisper (``model.engine: transcribe``), through transformers:
``WhisperProcessor`` (log-mel feature extractor and tokenizer) and
``WhisperForConditionalGeneration.generate`` with timestamps, which transcribes audio longer
than 30 s window after window (transformers' sequential long-form algorithm, Radford et al.
2022, sec. 3.8). Audio is decoded at the ingress (:mod:`deployments.engines.audio`); the
replica extracts features and generates.

Its cost is not tokens: a request's shape is ``(files, audio_frames, new_tokens)``
(:attr:`TranscribeEngine.shape_axes`; audio frames are 10 ms log-mel frames, new tokens
unused: the decoder's length per window is fixed by the model, so its KV cache is part of
the per-file terms). The fit's features are registered here (:func:`register_feature`):
``files`` (one window's encoder and decoder activations per file), ``files_audio_windows``
(files x 30 s windows: measured on CPU, a 31-60 s file holds about 22 MiB more than a 30 s
one with the tiny test model, as the long-form loop keeps each window's outputs) and
``files_audio_frames`` (the log-mel features and their copies, which grow with the audio).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from deployments.engines.base import PassRunner
from deployments.engines.devices import resolve_dtype
from deployments.engines.hf import ModelDirectoryEngine
from deployments.engines.spec import FrontEndDefaults
from serve_app.config import AppArgs, config_error
from serve_app.errors import InvalidRequestError
from serve_app.kinds import AUDIO_HOP_SAMPLES, AUDIO_WINDOW_FRAMES
from serve_app.memory.cost_model import Shape, register_feature
from serve_app.request import (
    AUDIO_SAMPLE_RATE_HZ,
    InferenceRequest,
    TranscriptionOutput,
    TranscriptionParams,
    TranscriptionSegment,
)
from serve_app.token_inputs import SpecialTokens


def _files(files: int, frames: int, new_tokens: int) -> float:
    return float(files)


def _files_audio_windows(files: int, frames: int, new_tokens: int) -> float:
    return float(files * -(-frames // AUDIO_WINDOW_FRAMES))


def _files_audio_frames(files: int, frames: int, new_tokens: int) -> float:
    return float(files * frames)


register_feature("files", _files)
register_feature("files_audio_windows", _files_audio_windows)
register_feature("files_audio_frames", _files_audio_frames)


class WhisperFrontEnd(FrontEndDefaults):
    """What the ingress needs of a Whisper directory, without the weights: its tokenizer
    (for the prompt), its decoder context and the languages it knows.

    Args:
        path: the model directory (``config.json``, ``generation_config.json``, the
            processor's files).

    Raises:
        OSError: the directory lacks those files.
    """

    def __init__(self, path: Path) -> None:
        from transformers import GenerationConfig, WhisperConfig, WhisperProcessor

        self.processor = WhisperProcessor.from_pretrained(str(path))
        self.tokenizer = self.processor.tokenizer
        config = WhisperConfig.from_pretrained(str(path))
        self.max_seq_tokens = int(config.max_target_positions)
        self.vocab_size = min(int(config.vocab_size), len(self.tokenizer))
        self.special = SpecialTokens()
        generation = GenerationConfig.from_pretrained(str(path))
        self.languages = sorted(token.strip("<|>") for token in
                                (getattr(generation, "lang_to_id", None) or {}))

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text as a Whisper prompt: ``<|startofprev|>`` and the text's ids
        (``WhisperTokenizer.get_prompt_ids``). Empty text: no ids."""
        return [[int(i) for i in self.tokenizer.get_prompt_ids(text)] if text else []
                for text in texts]

    def check_language(self, language: str | None) -> str | None:
        """``language`` as the model names it (ISO-639-1, lower case), or ``None``.

        Raises:
            InvalidRequestError: the model does not know it (400, code ``language``).
        """
        if language is None or not language.strip():
            return None
        code = language.strip().lower()
        if code not in self.languages:
            raise InvalidRequestError(f"language={language!r} is not one this model "
                                      f"transcribes (ISO-639-1: {self.languages})",
                                      code="language")
        return code

    def describe(self) -> dict[str, Any]:
        return {"transcription": {"languages": self.languages,
                                  "sample_rate_hz": AUDIO_SAMPLE_RATE_HZ,
                                  "window_s": AUDIO_WINDOW_FRAMES * AUDIO_HOP_SAMPLES
                                  / AUDIO_SAMPLE_RATE_HZ}}


class TranscribeEngine(ModelDirectoryEngine, PassRunner):
    """A loaded Whisper model serving ``transcribe`` requests (see module docstring).

    Args:
        path: the model directory.
        device: ``cpu`` or ``cuda``; dtype: ``float32``, ``float16`` or ``bfloat16``.
        max_batch_files: the most files one pass may hold (``batching.max_batch_size``),
            the top of the profile's ``files`` axis.
    """

    kinds = ("transcribe",)
    shape_axes: ClassVar[tuple[str, str, str]] = ("files", "audio_frames", "new_tokens")
    fit_features = ("const", "files", "files_audio_windows",  # type: ignore[assignment]
                    "files_audio_frames")

    def __init__(self, path: Path, device: str = "cpu", dtype: str = "float32",
                 max_batch_files: int = 1) -> None:
        from transformers import WhisperForConditionalGeneration

        self.path, self.device, self.dtype = Path(path), device, getattr(torch, dtype)
        self.front = WhisperFrontEnd(self.path)
        self.processor = self.front.processor
        self.max_seq_tokens = self.front.max_seq_tokens
        self.max_batch_files = max(1, max_batch_files)
        self.model = WhisperForConditionalGeneration.from_pretrained(
            str(self.path), dtype=self.dtype).to(device).eval()

    # --- the class ---------------------------------------------------------------------

    @classmethod
    def front_end(cls, args: AppArgs) -> WhisperFrontEnd:
        return WhisperFrontEnd(args.model.resolved_path())

    @classmethod
    def check_args(cls, args: AppArgs) -> None:
        """``model.path`` must be set (the packaged model is not Whisper) and, where it
        exists here, hold a Whisper ``config.json``."""
        if not args.model.path:
            raise config_error("model.path", "the transcribe engine needs a Whisper model "
                               "directory (config.json, weights, processor files)")
        config = Path(args.model.resolved_path()) / "config.json"
        if not config.exists():
            return  # as HFEngine.check_args: the model may live on the worker nodes only
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError) as exc:
            raise config_error("model.path", f"cannot read {config}: {exc}") from None
        if model_type != "whisper":
            raise config_error("model.path", f"{config} is not a Whisper model (model_type "
                               f"{model_type!r}, not 'whisper')")

    @classmethod
    def load(cls, args: AppArgs, device: str) -> TranscribeEngine:
        threads = args.model.num_threads or max(1, int(args.deployment.num_cpus))
        if device == "cpu":
            torch.set_num_threads(threads)
        return cls(args.model.resolved_path(), device, resolve_dtype(args.model.dtype, device),
                   args.batching.max_batch_size if args.batching.enabled else 1)

    # --- the instance ------------------------------------------------------------------

    def run_batch(self, requests: Sequence[InferenceRequest]) -> list[TranscriptionOutput]:
        """One padded pass over the requests' files (they share a batch key: language,
        temperature, prompt), each transcribed as it would be alone."""
        params = [r.params for r in requests]
        assert all(isinstance(p, TranscriptionParams) for p in params)
        first = params[0]
        features, mask = self.features([p.audio for p in params])
        languages = [first.language] * len(params) if first.language else \
            self._detect(features)
        prompt = requests[0].input_ids[0]
        output = self.generate(features, mask, languages, first.temperature, prompt)
        return [self._output(p, language, segments) for p, language, segments
                in zip(params, languages, output["segments"], strict=True)]

    def features(self, audio: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features, ``(files, mel bins, frames)`` in the model's dtype, and their
        frame mask, ``(files, frames)``, of one batch of 16 kHz files: padded to the longest
        and to at least one 30 s window (3000 frames), as transformers' long-form
        transcription takes them (``truncation=False, padding="longest"``)."""
        longest = max(len(a) for a in audio)
        short = longest <= AUDIO_WINDOW_FRAMES * AUDIO_HOP_SAMPLES
        extracted = self.processor.feature_extractor(
            list(audio), sampling_rate=AUDIO_SAMPLE_RATE_HZ, return_tensors="pt",
            truncation=False, padding="max_length" if short else "longest",
            return_attention_mask=True)
        return (extracted.input_features.to(self.device, self.dtype),
                extracted.attention_mask.to(self.device))

    @torch.inference_mode()
    def generate(self, features: torch.Tensor, mask: torch.Tensor, languages: Sequence[str],
                 temperature: float, prompt_ids: Sequence[int]) -> dict[str, Any]:
        """``WhisperForConditionalGeneration.generate`` with timestamps and segments: greedy
        at temperature 0, else sampled at ``temperature``."""
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 \
            else {"do_sample": False}
        prompt = torch.tensor(list(prompt_ids), device=self.device) if prompt_ids else None
        return self.model.generate(
            features, attention_mask=mask, language=list(languages), task="transcribe",
            return_timestamps=True, return_segments=True, prompt_ids=prompt, **sampling)

    @torch.inference_mode()
    def _detect(self, features: torch.Tensor) -> list[str]:
        """The language of each file's first window (``detect_language``), as ISO-639-1."""
        ids = self.model.detect_language(features[..., :AUDIO_WINDOW_FRAMES])
        return [token.strip("<|>") for token in
                self.processor.tokenizer.convert_ids_to_tokens(ids.tolist())]

    def _output(self, params: TranscriptionParams, language: str,
                segments: Sequence[dict[str, Any]]) -> TranscriptionOutput:
        decode = self.processor.tokenizer.decode
        duration_s = params.duration_s
        pieces = tuple(TranscriptionSegment(
            min(float(s["start"]), duration_s), min(float(s["end"]), duration_s),
            decode(s["tokens"], skip_special_tokens=True),
            tuple(int(t) for t in s["tokens"])) for s in segments)
        return TranscriptionOutput("".join(p.text for p in pieces), language, duration_s,
                                   pieces)

    def profile_ladder(self, largest: Shape) -> tuple[list[Shape], list[Shape]]:
        """Files 1, half and all of ``max_batch_files`` (at most 4) x 10 s, one window,
        half the longest and the longest audio; held out: 3 s, 17 s and 45 s (those under
        the longest), at 1, 2 and 1 files. The fitted shapes come largest first, so that
        each is measured in the state the allocator is left in by the largest pass (as a
        serving replica's is): on CPU, one file of 3-30 s read 7-8 MiB (about 30 %) more
        after a 4 x 60 s pass than before it (the tiny test Whisper, host RSS). Passes of
        more files than measured (``batching.max_batch_size`` above 4) are priced by the
        fit, whose every term but ``const`` grows linearly with files (each file's windows
        hold their own activations)."""
        top_files = min(4, self.max_batch_files)
        files = sorted({1, max(1, top_files // 2), top_files})
        window, longest = AUDIO_WINDOW_FRAMES, largest[1]
        frames = sorted({f for f in (1000, window, longest // 2, longest)
                         if 0 < f <= longest})
        train = sorted((Shape(n, f, 0) for n in files for f in frames),
                       key=lambda shape: (shape[0] * shape[1], shape), reverse=True)
        held = [Shape(min(n, top_files), f, 0) for n, f in ((1, 300), (2, 1700), (1, 4500))
                if f <= longest]
        return train, [s for s in held if s not in train]

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """One real transcription of ``batch`` files of ``prompt_tokens`` audio frames each
        (noise, fixed seed), the language detected (the costlier path)."""
        samples = prompt_tokens * AUDIO_HOP_SAMPLES
        noise = np.random.default_rng(0).standard_normal(samples).astype(np.float32) * 0.1
        params = TranscriptionParams(noise)
        request = InferenceRequest(self.kinds[0], ((),), Shape(1, prompt_tokens, 0), params)
        self.run_batch([request] * batch)

    @torch.inference_mode()
    def canary(self) -> bool:
        """The encoder over one second of noise; ``True`` when its output is finite."""
        noise = np.random.default_rng(0).standard_normal(AUDIO_SAMPLE_RATE_HZ) * 0.1
        features, _ = self.features([noise.astype(np.float32)])
        encoded = self.model.get_encoder()(features).last_hidden_state
        return bool(torch.isfinite(encoded).all())

    def close(self) -> None:
        self.model = None
