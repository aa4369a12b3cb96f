"""Request kinds: what each route asks of a model, and how its size is read.

A kind names one route's request (``embed``: ``/v1/embeddings``; ``generate``:
``/v1/completions``) and owns what depends on it alone: its limits, which requests of it may
share a forward pass, the shape it is priced at, the largest and the P95 shape the limits
allow (the profile's ladder and the plan's estimate), and whether a forward pass of it fits
the model's context. Engines say which kinds they serve (:mod:`deployments.engines`); a new
kind is a new class here plus a route, registered in :data:`KINDS`.

Pure: no Ray, torch or FastAPI.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from serve_app.config import AppArgs, BatchingConfig, LimitsConfig
from serve_app.errors import InvalidRequestError
from serve_app.memory.cost_model import Shape
from serve_app.pricing import priced_tokens
from serve_app.request import (
    AUDIO_SAMPLE_RATE_HZ,
    EmbeddingParams,
    InferenceRequest,
    RequestParams,
    TranscriptionParams,
)


def _check_tokens(tokens: int, limit: int, what: str, code: str, hint: str = "") -> None:
    if tokens > limit:
        raise InvalidRequestError(f"{what} has {tokens} tokens; the limit is {limit}{hint}",
                                  code=code)


class RequestKind:
    """What one kind of request asks of a model (see module docstring)."""

    name: ClassVar[str]
    generates: ClassVar[bool] = False  # its requests ask for new tokens (a KV cache)

    def check_inputs(self, inputs: int, params: RequestParams,
                     limits: LimitsConfig) -> None:
        """Checks that need no tokens (before tokenizing). Raises InvalidRequestError."""

    field: ClassVar[str]  # the request field its inputs come from

    def check_tokens(self, token_counts: Sequence[int], params: RequestParams,
                     max_input_tokens: int, max_seq_tokens: int,
                     field: str | None = None) -> None:
        """Checks of the token counts. Raises InvalidRequestError naming ``field`` (default:
        the kind's :attr:`field`; a chat request's prompt is its ``messages``)."""
        raise NotImplementedError

    def batch_key(self, inputs: int, params: RequestParams, stream: bool,
                  batching: BatchingConfig) -> tuple | None:
        """What requests must share to run in one pass, or ``None`` (it runs alone)."""
        raise NotImplementedError

    def new_tokens(self, params: RequestParams) -> int:
        """Tokens the request generates at most (0: none)."""
        return 0

    def largest_shape(self, limits: LimitsConfig, max_seq_tokens: int) -> Shape:
        """The largest request the limits allow on a model of ``max_seq_tokens``."""
        raise NotImplementedError

    def p95_shape(self, args: AppArgs, context: int | None = None) -> Shape:
        """A P95-sized request of the traffic (``deployment.p95_*``), for planning, within
        the model's ``context`` (tokens; ``None``: unknown)."""
        raise NotImplementedError

    def context_problem(self, limits: LimitsConfig, context: int, source: str) -> str | None:
        """What of ``limits`` a model whose context is ``context`` tokens (read from
        ``source``) cannot hold, in words naming the keys; ``None``: it holds all of it."""
        return None

    def fits_context(self, prompt_tokens: int, new_tokens: int, max_seq_tokens: int) -> bool:
        """Whether a pass padded to ``prompt_tokens`` generating ``new_tokens`` fits the
        model's context."""
        return prompt_tokens + new_tokens <= max_seq_tokens

    def pass_length(self, request: InferenceRequest) -> int:
        """The length ``request`` pads a pass to, along its shape's second slot (tokens of
        its longest input)."""
        return max(request.token_counts)

    def priced_shape(self, token_counts: Sequence[int], params: RequestParams,
                     batchable: bool, args: AppArgs, max_input_tokens: int) -> Shape:
        """The shape a request of ``token_counts`` is priced at: its inputs, its longest
        input and its new tokens, padded (:func:`serve_app.pricing.priced_tokens`) when it
        is ``batchable``, so that requests of similar length share a pass within their
        leases."""
        pad, new = args.batching.pad_to_multiple_of, self.new_tokens(params)
        return Shape(len(token_counts),
                     priced_tokens(token_counts, batchable, pad, max_input_tokens),
                     priced_tokens([new], batchable, pad, args.limits.max_tokens) if new else 0)


class EmbedKind(RequestKind):
    """``POST /v1/embeddings``: 1..``limits.max_inputs`` inputs, embedded in one pass."""

    name = "embed"
    field = "input"

    def check_inputs(self, inputs: int, params: RequestParams,
                     limits: LimitsConfig) -> None:
        if inputs > limits.max_inputs:
            raise InvalidRequestError(f"{inputs} inputs; the limit is {limits.max_inputs}",
                                      code="input")

    def check_tokens(self, token_counts: Sequence[int], params: RequestParams,
                     max_input_tokens: int, max_seq_tokens: int,
                     field: str | None = None) -> None:
        field = field or self.field
        for i, n in enumerate(token_counts):
            _check_tokens(n, max_input_tokens, f"{field}[{i}]", field,
                          " (send truncate: true to cut it there)")

    def batch_key(self, inputs: int, params: RequestParams, stream: bool,
                  batching: BatchingConfig) -> tuple | None:
        if not batching.enabled or inputs > batching.max_batch_size:
            return None
        # One pass pools with one prompt length (sentence-transformers' ``prompt_length``).
        prompt_tokens = params.prompt_tokens if isinstance(params, EmbeddingParams) else 0
        return (self.name, prompt_tokens)

    def largest_shape(self, limits: LimitsConfig, max_seq_tokens: int) -> Shape:
        return Shape(limits.max_inputs, min(limits.max_input_tokens, max_seq_tokens), 0)

    def p95_shape(self, args: AppArgs, context: int | None = None) -> Shape:
        tokens = min(args.deployment.p95_input_tokens, args.limits.max_input_tokens)
        return Shape(min(args.deployment.p95_inputs, args.limits.max_inputs),
                     min(tokens, context) if context else tokens, 0)

    def context_problem(self, limits: LimitsConfig, context: int, source: str) -> str | None:
        if limits.max_input_tokens <= context:
            return None
        return (f"limits.max_input_tokens ({limits.max_input_tokens}) exceeds the model's "
                f"context of {context} tokens ({source}): an input holds at most {context} "
                "tokens (more is refused with 400, or cut with truncate)")


class GenerateKind(RequestKind):
    """``POST /v1/completions`` and ``/v1/chat/completions``: one prompt, priced with the
    ``max_tokens`` its KV cache grows to. On continuous batching (``batching.continuous``)
    every completion shares decode steps and its ``batch_key`` is not read; otherwise it is
    batched with others of the same ``temperature`` and ``top_p`` when not streamed and
    without stop strings or seed (one left-padded ``generate``)."""

    name = "generate"
    field = "prompt"
    generates = True

    def check_inputs(self, inputs: int, params: RequestParams,
                     limits: LimitsConfig) -> None:
        assert params is not None
        if params.max_tokens > limits.max_tokens:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} exceeds the limit of {limits.max_tokens}",
                code="max_tokens")

    def check_tokens(self, token_counts: Sequence[int], params: RequestParams,
                     max_input_tokens: int, max_seq_tokens: int,
                     field: str | None = None) -> None:
        assert params is not None
        field = field or self.field
        [prompt_tokens] = token_counts
        _check_tokens(prompt_tokens, max_input_tokens, field, field)
        _check_tokens(prompt_tokens + params.max_tokens, max_seq_tokens,
                      f"{field} + max_tokens", "max_tokens")

    def batch_key(self, inputs: int, params: RequestParams, stream: bool,
                  batching: BatchingConfig) -> tuple | None:
        assert params is not None
        if (not batching.enabled or not batching.completions or stream or params.stop
                or params.seed is not None or inputs > batching.max_batch_size):
            return None
        return (self.name, params.temperature, params.top_p)

    def new_tokens(self, params: RequestParams) -> int:
        assert params is not None
        return params.max_tokens

    def largest_shape(self, limits: LimitsConfig, max_seq_tokens: int) -> Shape:
        prompt = min(limits.max_input_tokens, max_seq_tokens, max_seq_tokens - 1)
        return Shape(1, prompt, min(limits.max_tokens, max_seq_tokens - prompt))

    def p95_shape(self, args: AppArgs, context: int | None = None) -> Shape:
        # A completion is charged for the max_tokens it asks for, and no knob says what the
        # traffic asks: this is the most it may ask (as much as the context leaves a prompt
        # of one token), with the prompt cut to what the context leaves it.
        limits = args.limits
        new = min(limits.max_tokens, context - 1) if context else limits.max_tokens
        tokens = min(args.deployment.p95_input_tokens, limits.max_input_tokens,
                     context - new if context else limits.max_input_tokens)
        return Shape(1, tokens, new)

    def context_problem(self, limits: LimitsConfig, context: int, source: str) -> str | None:
        if limits.max_input_tokens + limits.max_tokens <= context:
            return None
        return (f"limits.max_input_tokens ({limits.max_input_tokens}) + limits.max_tokens "
                f"({limits.max_tokens}) exceed the model's context of {context} tokens "
                f"({source}): a prompt and its completion together hold at most {context} "
                "tokens (more is refused with 400)")


# Whisper's log-mel front end: 10 ms hops at 16 kHz, 30 s windows (Radford et al. 2022, sec.
# 2.2; transformers' WhisperFeatureExtractor: hop_length 160, chunk_length 30).
AUDIO_HOP_SAMPLES = 160
AUDIO_WINDOW_FRAMES = 3000


def audio_frames(samples: int) -> int:
    """Log-mel frames of ``samples`` audio samples at 16 kHz (10 ms each, at least 1)."""
    return max(1, -(-samples // AUDIO_HOP_SAMPLES))


class TranscribeKind(RequestKind):
    """``POST /v1/audio/transcriptions``: one audio file, priced by its length in log-mel
    frames (shape: files, audio frames, 0; ``Engine.shape_axes`` of a speech engine). Files
    of the same language, temperature and prompt share a pass (one padded batch; a pass
    costs its files x its longest file, as the engine's fit prices it)."""

    name = "transcribe"
    field = "file"

    def check_inputs(self, inputs: int, params: RequestParams,
                     limits: LimitsConfig) -> None:
        assert isinstance(params, TranscriptionParams)
        if params.duration_s > limits.max_audio_s:
            raise InvalidRequestError(
                f"the audio is {params.duration_s:.1f} s long; the limit is "
                f"limits.max_audio_s = {limits.max_audio_s:g} s", code="file")

    def check_tokens(self, token_counts: Sequence[int], params: RequestParams,
                     max_input_tokens: int, max_seq_tokens: int,
                     field: str | None = None) -> None:
        # Whisper reads at most half its decoder context as previous text (the prompt):
        # transformers' WhisperForConditionalGeneration.generate refuses more.
        [prompt_tokens] = token_counts
        _check_tokens(prompt_tokens, max_seq_tokens // 2 - 1, "prompt", "prompt")

    def batch_key(self, inputs: int, params: RequestParams, stream: bool,
                  batching: BatchingConfig) -> tuple | None:
        assert isinstance(params, TranscriptionParams)
        if not batching.enabled:
            return None
        return (self.name, params.language, params.temperature, params.prompt)

    def largest_shape(self, limits: LimitsConfig, max_seq_tokens: int) -> Shape:
        return Shape(1, audio_frames(int(limits.max_audio_s * AUDIO_SAMPLE_RATE_HZ)), 0)

    def p95_shape(self, args: AppArgs, context: int | None = None) -> Shape:
        # No knob says how long the traffic's audio is: one 30 s window, or the limit.
        seconds = min(30.0, args.limits.max_audio_s)
        return Shape(1, audio_frames(int(seconds * AUDIO_SAMPLE_RATE_HZ)), 0)

    def fits_context(self, prompt_tokens: int, new_tokens: int, max_seq_tokens: int) -> bool:
        return True  # audio of any length runs in 30 s windows; its limit is max_audio_s

    def pass_length(self, request: InferenceRequest) -> int:
        assert isinstance(request.params, TranscriptionParams)
        return audio_frames(len(request.params.audio))

    def priced_shape(self, token_counts: Sequence[int], params: RequestParams,
                     batchable: bool, args: AppArgs, max_input_tokens: int) -> Shape:
        assert isinstance(params, TranscriptionParams)
        return Shape(1, audio_frames(len(params.audio)), 0)


KINDS: dict[str, RequestKind] = {kind.name: kind
                                 for kind in (EmbedKind(), GenerateKind(), TranscribeKind())}
"""Every request kind, by name."""


def largest_shape(kinds: Sequence[str], limits: LimitsConfig, max_seq_tokens: int) -> Shape:
    """The largest request the limits allow over ``kinds``: in each dimension the largest
    of any kind, with the prompt no longer than a generating kind allows (so that its new
    tokens still fit the context)."""
    shapes = [KINDS[k].largest_shape(limits, max_seq_tokens) for k in kinds]
    generating = [s for s in shapes if s.new_tokens]
    prompt = min(s.prompt_tokens for s in generating) if generating else \
        max(s.prompt_tokens for s in shapes)
    return Shape(max(s.inputs for s in shapes), prompt, max(s.new_tokens for s in shapes))


def context_problems(limits: LimitsConfig, kinds: Sequence[str],
                     context: tuple[int, str] | None) -> list[str]:
    """What of ``limits`` a model serving ``kinds`` cannot hold within its ``context``
    (tokens, and where it was read; ``None``: unknown, nothing is said), one line per kind
    (:meth:`RequestKind.context_problem`): the replicas refuse such requests, and the plan
    prices requests within the context."""
    if context is None:
        return []
    return [problem for kind in kinds
            if (problem := KINDS[kind].context_problem(limits, *context))]


def build_request(kind: RequestKind | str, input_ids: Sequence[Sequence[int]],
                  params: RequestParams, stream: bool, args: AppArgs,
                  max_seq_tokens: int, field: str | None = None, *,
                  inputs_checked: bool = False) -> InferenceRequest:
    """Validate a tokenized request and price it: the one place a request of any kind
    becomes an :class:`InferenceRequest`. ``kind``: the :class:`RequestKind` (or its name);
    ``max_seq_tokens``: the model's context (tokens); inputs are limited to
    ``min(limits.max_input_tokens, max_seq_tokens)``; ``field``: the request field the inputs
    came from, for messages (default: the kind's); ``inputs_checked``: the caller ran the
    kind's :meth:`~RequestKind.check_inputs` before tokenizing (the ingress's request
    factory), so it is not run twice.

    A batchable request is priced padded (:meth:`RequestKind.priced_shape`).

    Raises:
        InvalidRequestError: a limit is exceeded (``code`` names the field).
    """
    spec = KINDS[kind] if isinstance(kind, str) else kind
    limits = args.limits
    if not inputs_checked:
        spec.check_inputs(len(input_ids), params, limits)
    max_input_tokens = min(limits.max_input_tokens, max_seq_tokens)
    counts = [len(ids) for ids in input_ids]
    spec.check_tokens(counts, params, max_input_tokens, max_seq_tokens, field)
    key = spec.batch_key(len(counts), params, stream, args.batching)
    # A completion on continuous batching shares steps whatever its key: priced padded too,
    # so that its lease covers whole KV blocks (deployments.engines.stepping).
    batchable = key is not None or (spec.generates and args.batching.continuous)
    shape = spec.priced_shape(counts, params, batchable, args, max_input_tokens)
    return InferenceRequest(spec.name, tuple(tuple(ids) for ids in input_ids), shape, params,
                            stream=stream, batch_key=key)
