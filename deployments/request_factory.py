"""Where a request becomes an :class:`~serve_app.request.InferenceRequest`: validated against
the limits, tokenized once with the model's own tokenizer, and priced
(:func:`serve_app.kinds.build_request`). The ingress does this, as the front ends of vLLM and
text-embeddings-inference do; the replica runs the engine on the ids it is given."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from deployments.engines.base import FrontEnd
from serve_app.config import AppArgs
from serve_app.kinds import KINDS, build_request
from serve_app.request import GenerationParams, InferenceRequest


class RequestFactory:
    """Builds requests for one model.

    Args:
        args: the config (limits, batching).
        front_end: the engine's front end (tokenizer, context length).
    """

    def __init__(self, args: AppArgs, front_end: FrontEnd) -> None:
        self._args, self._front = args, front_end

    def check(self, kind: str, inputs: int, params: GenerationParams | None = None) -> None:
        """The checks that need no tokens (``limits.max_inputs``, ``limits.max_tokens``).

        Raises:
            InvalidRequestError: naming the field.
        """
        KINDS[kind].check_inputs(inputs, params, self._args.limits)

    async def build(self, kind: str, texts: Sequence[str],
                    params: GenerationParams | None = None,
                    stream: bool = False) -> InferenceRequest:
        """Validate, tokenize (off the event loop) and price one request of ``kind``.

        Raises:
            InvalidRequestError: a limit is exceeded (``code`` names the field).
        """
        self.check(kind, len(texts), params)
        ids = await asyncio.to_thread(self._front.tokenize, texts)
        return build_request(kind, ids, params, stream, self._args,
                             self._front.max_seq_tokens)
