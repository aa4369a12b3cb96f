"""Where a request becomes an :class:`~serve_app.request.InferenceRequest`: validated against
the limits, tokenized once with the model's own tokenizer (or taken as token ids,
:mod:`serve_app.token_inputs`), truncated when asked, and priced
(:func:`serve_app.kinds.build_request`). The ingress does this, as the front ends of vLLM and
text-embeddings-inference do; the replica runs the engine on the ids it is given."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from deployments.engines.audio import decode_audio
from deployments.engines.spec import FrontEnd
from serve_app.config import AppArgs
from serve_app.errors import InvalidRequestError
from serve_app.kinds import RequestKind, build_request
from serve_app.request import (
    EmbeddingParams,
    GenerationParams,
    InferenceRequest,
    RequestParams,
    TranscriptionParams,
)
from serve_app.token_inputs import token_id_inputs


class RequestFactory:
    """Builds requests for one model.

    Args:
        args: the config (limits, batching).
        front_end: the engine's front end (tokenizer, context length, vocabulary).
    """

    def __init__(self, args: AppArgs, front_end: FrontEnd) -> None:
        self._args, self._front = args, front_end

    async def build(self, kind: RequestKind, inputs: Sequence[str | Sequence[int]],
                    params: RequestParams = None, stream: bool = False, *,
                    field: str | None = None, truncate: bool = False,
                    input_type: str | None = None) -> InferenceRequest:
        """Validate, tokenize (off the event loop) and price one request of ``kind``: the
        checks that need no tokens (``limits.max_inputs``, ``limits.max_tokens``:
        :meth:`RequestKind.check_inputs`) first, once, then the rest
        (:func:`serve_app.kinds.build_request`).

        Args:
            inputs: texts, or token-id lists (not mixed).
            field: the request field ``inputs`` came from, for messages (default: the
                kind's, ``input`` or ``prompt``).
            truncate: cut inputs over the token limit at their end (special tokens kept)
                instead of refusing them.
            input_type: the model's prompt to apply to text inputs (front end
                ``prompted``); a prompt the pooling leaves out makes ``params``
                :class:`~serve_app.request.EmbeddingParams`.

        Raises:
            InvalidRequestError: a limit is exceeded, a token id is outside the vocabulary,
                or ``input_type`` is not the model's (``code`` names the field).
        """
        kind.check_inputs(len(inputs), params, self._args.limits)
        front = self._front
        if all(isinstance(item, str) for item in inputs):
            texts, prompt_tokens = front.prompted(inputs, input_type)
            ids = await asyncio.to_thread(front.tokenize, texts)
            params = EmbeddingParams(prompt_tokens) if prompt_tokens else params
        elif input_type is not None:
            raise InvalidRequestError("input_type applies to text inputs, not token ids",
                                      code="input_type")
        else:
            ids = token_id_inputs(inputs, front.vocab_size, front.special,
                                  field or kind.field)
        if truncate:
            limit = min(self._args.limits.max_input_tokens, front.max_seq_tokens)
            ids = [front.special.truncated(one, limit) for one in ids]
        return build_request(kind, ids, params, stream, self._args, front.max_seq_tokens,
                             field, inputs_checked=True)

    async def build_chat(self, kind: RequestKind, messages: Sequence[dict[str, str]],
                         params: GenerationParams, stream: bool = False) -> InferenceRequest:
        """A request of ``kind`` (a generating one) of the conversation ``messages``
        rendered by the model's chat template (front end ``chat_ids``, off the event loop),
        taken as it renders it (no special tokens added); checked as :meth:`build`.

        Raises:
            InvalidRequestError: no chat template, or a limit is exceeded.
        """
        kind.check_inputs(1, params, self._args.limits)
        ids = await asyncio.to_thread(self._front.chat_ids, messages)
        return build_request(kind, [ids], params, stream, self._args,
                             self._front.max_seq_tokens, field="messages", inputs_checked=True)

    async def build_transcription(self, kind: RequestKind, data: bytes, prompt: str,
                                  language: str | None, temperature: float,
                                  response_format: str,
                                  name: str = "the file") -> InferenceRequest:
        """A request of ``kind`` (``transcribe``) for the audio file ``data``: decoded and
        resampled to 16 kHz (:func:`deployments.engines.audio.decode_audio`, off the event
        loop; ``name``: what its refusals call the file), its ``language`` checked (front
        end ``check_language``), its ``prompt`` tokenized, priced by its length
        (:func:`serve_app.kinds.build_request`, as every kind).

        Raises:
            BodyTooLargeError: the file is over ``limits.max_audio_bytes`` (413).
            InvalidRequestError: undecodable audio, audio over ``limits.max_audio_s``, an
                unknown language or too long a prompt (400 naming the field).
        """
        limits = self._args.limits
        language = self._front.check_language(language)  # type: ignore[attr-defined]
        audio = await asyncio.to_thread(decode_audio, data, limits.max_audio_bytes,
                                        name=name)
        [ids] = await asyncio.to_thread(self._front.tokenize, [prompt])
        params = TranscriptionParams(audio, prompt, language, temperature, response_format)
        return build_request(kind, [ids], params, False, self._args,
                             self._front.max_seq_tokens)
