"""Runners: a :class:`~deployments.engines.base.PassRunner` for a kind, written over batched
calls on token ids.

:class:`EmbeddingRunner` needs ``embed_ids``; :class:`GenerationRunner` needs ``generate_ids``
and ``generate_batch_ids``. An engine serving one kind subclasses its runner; one serving
several (the fake engine) subclasses each and picks in its own ``run_batch``
(``run_embed``/``run_generate``). No torch import here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from deployments.engines.base import PassRunner
from deployments.engines.spec import FrontEnd
from serve_app.request import (
    EmbeddingOutput,
    EmbeddingParams,
    GenerationOutput,
    GenerationParams,
    InferenceRequest,
)


class EmbeddingRunner(PassRunner):
    """A :class:`~deployments.engines.base.PassRunner` of ``embed`` requests from
    ``embed_ids``: every request's inputs in one padded pass, each request's rows handed back
    to it. Also ``embed(texts)`` for in-process use."""

    front: FrontEnd

    def embed_ids(self, input_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 ``(len(input_ids), dimensions)`` for inputs given as token ids. An engine
        whose front end applies prompts that its pooling leaves out also takes
        ``prompt_tokens`` (:class:`serve_app.request.EmbeddingParams`)."""
        raise NotImplementedError

    def run_batch(self, requests: Sequence[InferenceRequest]) -> list[EmbeddingOutput]:
        """One pass over the requests' inputs (they share a batch key, so one prompt
        length)."""
        return self.run_embed(requests)

    def run_embed(self, requests: Sequence[InferenceRequest]) -> list[EmbeddingOutput]:
        """:meth:`run_batch` of ``embed`` requests (for an engine serving several kinds)."""
        ids = [ids for request in requests for ids in request.input_ids]
        params = requests[0].params
        prompt_tokens = params.prompt_tokens if isinstance(params, EmbeddingParams) else 0
        rows = self._embed_ids(ids, prompt_tokens)
        outputs, start = [], 0
        for request in requests:
            end = start + len(request.input_ids)
            outputs.append(EmbeddingOutput(rows[start:end], request.prompt_tokens))
            start = end
        return outputs

    def embed(self, texts: Sequence[str], input_type: str | None = None) -> np.ndarray:
        """Tokenize ``texts`` with the front end (after the prompt ``input_type`` names, or
        the model's default prompt) and embed them in one pass."""
        prompted, prompt_tokens = self.front.prompted(texts, input_type)
        return self._embed_ids(self.front.tokenize(prompted), prompt_tokens)

    def _embed_ids(self, ids: Sequence[Sequence[int]], prompt_tokens: int) -> np.ndarray:
        # Only engines whose prompts are left out of pooling know ``prompt_tokens``.
        if prompt_tokens:
            return self.embed_ids(ids, prompt_tokens=prompt_tokens)  # type: ignore[call-arg]
        return self.embed_ids(ids)


class GenerationRunner(PassRunner):
    """A :class:`~deployments.engines.base.PassRunner` of ``generate`` requests (``run_batch``
    and ``run_stream``) from ``generate_ids`` (one prompt) and
    ``generate_batch_ids`` (several, sharing ``temperature`` and ``top_p``, without stop
    strings or seed; see :func:`batch_params`). Also text-level ``generate`` and
    ``generate_batch`` for in-process use."""

    front: FrontEnd

    def generate_ids(self, ids: Sequence[int], params: GenerationParams,
                     on_text: Callable[[str], bool] | None = None) -> GenerationOutput:
        """Complete the prompt ``ids``. ``on_text`` receives each new piece of text as it is
        decoded and returns ``False`` to stop early (client gone); the output then has
        ``finish_reason`` ``"cancelled"``."""
        raise NotImplementedError

    def generate_batch_ids(self, ids: Sequence[Sequence[int]],
                           params: Sequence[GenerationParams]) -> list[GenerationOutput]:
        """Complete several prompts in one padded batch, each as :meth:`generate_ids` would
        alone; ``max_tokens`` may differ (the batch generates to the largest and each row is
        cut at its own).

        Raises:
            ValueError: as :func:`batch_params`.
        """
        raise NotImplementedError

    def run_batch(self, requests: Sequence[InferenceRequest]) -> list[GenerationOutput]:
        """One batch of completions (alone: exactly the unbatched path)."""
        return self.run_generate(requests)

    def run_generate(self, requests: Sequence[InferenceRequest]) -> list[GenerationOutput]:
        """:meth:`run_batch` of ``generate`` requests (for an engine serving several
        kinds)."""
        if len(requests) == 1:  # exactly the unbatched path
            [request] = requests
            return [self.generate_ids(request.input_ids[0], request.params)]
        return self.generate_batch_ids([r.input_ids[0] for r in requests],
                                       [r.params for r in requests])

    def run_stream(self, request: InferenceRequest,
                   on_text: Callable[[str], bool]) -> GenerationOutput:
        """One completion whose client reads a stream (:meth:`generate_ids` with
        ``on_text``)."""
        return self.generate_ids(request.input_ids[0], request.params, on_text)

    def generate(self, prompt: str, params: GenerationParams,
                 on_text: Callable[[str], bool] | None = None) -> GenerationOutput:
        """Tokenize ``prompt`` with the front end and complete it."""
        return self.generate_ids(self.front.tokenize([prompt])[0], params, on_text)

    def generate_batch(self, prompts: Sequence[str],
                       params: Sequence[GenerationParams]) -> list[GenerationOutput]:
        """Tokenize ``prompts`` with the front end and complete them in one batch."""
        return self.generate_batch_ids(self.front.tokenize(prompts), params)


def batch_params(params: Sequence[GenerationParams]) -> GenerationParams:
    """The parameters one batched ``generate`` runs with for rows of ``params``: their
    shared ``temperature`` and ``top_p``, and the largest ``max_tokens`` (each row is cut at
    its own afterwards: greedy decoding of a row does not depend on the other rows, so its
    first ``n`` tokens are what it would make alone with ``max_tokens = n``).

    Raises:
        ValueError: ``params`` is empty, has ``stop`` strings or a ``seed``, or mixes
            temperatures or top_p.
    """
    if not params:
        raise ValueError("generate_batch needs at least one prompt")
    if any(p.stop or p.seed is not None for p in params):
        raise ValueError("generate_batch takes no stop strings and no seed")
    if len({(p.temperature, p.top_p) for p in params}) > 1:
        raise ValueError("rows of one generate_batch must share temperature and top_p")
    return GenerationParams(max_tokens=max(p.max_tokens for p in params),
                            temperature=params[0].temperature, top_p=params[0].top_p)
