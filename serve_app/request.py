"""The validated request value, and what an engine answers for it.

A request is validated, tokenized and priced once, where it enters the system (the ingress,
as the front ends of vLLM and text-embeddings-inference do), and travels to the model replica
as an :class:`InferenceRequest`: its kind, its inputs as token ids, its generation parameters
and the shape it is priced at. The replica prices that shape with its own cost model (it stays
the authority on admission) and the engine runs on the ids; nothing is tokenized twice.

Pure: numpy only (no Ray, torch or FastAPI).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace

import numpy as np

from serve_app.admission.fair import DEFAULT_TENANT
from serve_app.admission.priority import Priority
from serve_app.memory.cost_model import Shape


@dataclass(frozen=True)
class GenerationParams:
    """Sampling parameters of one completion (OpenAI names; validated by the ingress).

    Attributes:
        max_tokens: new tokens to generate at most (>= 1).
        temperature: 0 = greedy (deterministic); > 0 samples.
        top_p: nucleus sampling mass in (0, 1].
        seed: makes sampling reproducible when set.
        stop: strings that end the completion (not included in the text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class EmbeddingParams:
    """What an ``embed`` request asks beyond its inputs (validated by the ingress).

    Attributes:
        prompt_tokens: leading tokens of every input that are the model's prompt (its
            sentence-transformers ``prompts``, picked by the request's ``input_type``),
            passed to the pooling as ``prompt_length``: a pooling declared with
            ``include_prompt: false`` leaves them out, as ``SentenceTransformer.encode``
            does. 0: no prompt.
    """

    prompt_tokens: int = 0


@dataclass(frozen=True, eq=False)
class TranscriptionParams:
    """What a ``transcribe`` request carries beyond its prompt (validated by the ingress).

    Attributes:
        audio: the decoded file as float32 mono samples at :data:`AUDIO_SAMPLE_RATE_HZ`,
            shape ``(samples,)``.
        language: ISO-639-1 code of the spoken language (``en``), or ``None``: the model
            detects it.
        temperature: 0 = greedy decoding; > 0 samples at that temperature.
        response_format: ``json``, ``text`` or ``verbose_json`` (OpenAI's names).
        prompt: text the transcript continues (OpenAI's ``prompt``; its token ids are the
            request's ``input_ids[0]``); requests share a pass only with the same prompt.
    """

    audio: np.ndarray
    prompt: str = ""
    language: str | None = None
    temperature: float = 0.0
    response_format: str = "json"

    @property
    def duration_s(self) -> float:
        """The audio's length, seconds."""
        return len(self.audio) / AUDIO_SAMPLE_RATE_HZ


AUDIO_SAMPLE_RATE_HZ = 16_000
"""The rate audio is resampled to: what Whisper's log-mel front end reads (Radford et al.
2022, "Robust Speech Recognition via Large-Scale Weak Supervision", sec. 2.2)."""

RequestParams = GenerationParams | EmbeddingParams | TranscriptionParams | None
"""A request's parameters: its kind's, or ``None`` for the kind's defaults."""


@dataclass(frozen=True)
class InferenceRequest:
    """One validated request, as the ingress hands it to a model replica.

    Attributes:
        kind: the request kind (:mod:`serve_app.kinds`: ``embed``, ``generate``), which
            names the route it came from and what the engine does with it.
        input_ids: token ids per input (embeddings) or of the one prompt (completions),
            special tokens included, as the model sees them.
        shape: the shape it is priced at (:func:`serve_app.kinds.build_request`): its
            inputs, longest input and new tokens, padded where it may share a forward pass.
        params: generation parameters (``generate``), embedding parameters (``embed``), or
            ``None`` (their defaults).
        stream: the client reads the result as a stream of text pieces.
        batch_key: requests with equal keys may share a forward pass; ``None``: it runs
            alone.
        estimated_bytes: the ingress's price of ``shape`` in the admission policy's units,
            from the replicas' published cost model; read by the request router only
            (``None`` before any replica has published one).
        sent_at_s: when the ingress handed it to Ray Serve (``time.time()``); the time it
            spends reaching a replica counts as queue wait.
        wait_limit_s: the longest the client will wait before it starts, seconds, when it
            said so (``Prefer: wait``, ``X-Stainless-Read-Timeout``); ``None``: it did not;
            ``0``: it will not wait (:attr:`no_wait`).
        tenant: whose request it is (its key's tenant: ``auth.tenants``), for the fair
            order of the admission queue and the request log.
        priority: its priority class in the admission queue
            (:mod:`serve_app.admission.priority`).
    """

    kind: str
    input_ids: tuple[tuple[int, ...], ...]
    shape: Shape
    params: RequestParams = None
    _: KW_ONLY
    stream: bool = False
    batch_key: tuple | None = None
    estimated_bytes: int | None = None
    sent_at_s: float | None = None
    wait_limit_s: float | None = None
    tenant: str = DEFAULT_TENANT
    priority: Priority = Priority.INTERACTIVE

    @property
    def no_wait(self) -> bool:
        """The client will not wait: the request runs only if nothing is queued ahead of it
        (the admission gate, the inference thread, Ray Serve's handle queue), else it is
        refused at once; once let through, its hand-offs are bound as any request's."""
        return self.wait_limit_s == 0

    def wait_bound_s(self, max_queue_wait_s: float) -> float:
        """The longest this request may wait before it starts, in all, seconds: the
        replica's ``admission.max_queue_wait_s``, or the client's shorter limit (a
        :attr:`no_wait` request, admitted with nothing ahead, gets the replica's bound)."""
        return wait_bound_s(max_queue_wait_s, None if self.no_wait else self.wait_limit_s)

    @property
    def token_counts(self) -> list[int]:
        """Tokens per input."""
        return [len(ids) for ids in self.input_ids]

    @property
    def prompt_tokens(self) -> int:
        """Tokens over all inputs (what ``usage.prompt_tokens`` reports)."""
        return sum(self.token_counts)

    def sent(self, estimated_bytes: int | None, sent_at_s: float) -> InferenceRequest:
        """This request as it leaves the ingress: priced for the router, time-stamped."""
        return replace(self, estimated_bytes=estimated_bytes, sent_at_s=sent_at_s)


@dataclass(frozen=True)
class EmbeddingOutput:
    """What an engine answers for one ``embed`` request.

    Attributes:
        embeddings: float32, shape ``(inputs, dimensions)``, rows of unit L2 norm (or as the
            model's pooling defines them).
        prompt_tokens: tokens over all inputs.
    """

    embeddings: np.ndarray
    prompt_tokens: int

    def finite(self) -> bool:
        """Whether every value is finite (NaN/Inf means a corrupted device)."""
        return bool(np.isfinite(self.embeddings).all())


@dataclass(frozen=True)
class GenerationOutput:
    """A finished completion: its text, why it ended (``stop``, ``length`` or, when the
    consumer left, ``cancelled``), token counts."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    def finite(self) -> bool:
        """Text carries no NaN: always ``True``."""
        return True


@dataclass(frozen=True)
class TranscriptionSegment:
    """One piece of a transcript: its start and end in the audio (seconds), its text and
    its token ids (timestamps included, as Whisper wrote them)."""

    start_s: float
    end_s: float
    text: str
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class TranscriptionOutput:
    """What an engine answers for one ``transcribe`` request.

    Attributes:
        text: the whole transcript.
        language: the language it was transcribed in (ISO-639-1), asked for or detected.
        duration_s: the audio's length, seconds.
        segments: the transcript in pieces with their times (Whisper's timestamped
            segments).
    """

    text: str
    language: str
    duration_s: float
    segments: tuple[TranscriptionSegment, ...] = ()

    def finite(self) -> bool:
        """Text carries no NaN: always ``True``."""
        return True


def wait_bound_s(max_queue_wait_s: float, wait_limit_s: float | None) -> float:
    """The longest a request may wait before it starts, seconds: ``max_queue_wait_s``
    (``admission.max_queue_wait_s``), or the client's shorter ``wait_limit_s``."""
    return max_queue_wait_s if wait_limit_s is None else min(max_queue_wait_s, wait_limit_s)
