"""Continuous batching for a transformers causal LM: one left-padded batch whose rows come
and go between decode steps (:class:`deployments.engines.stepping.DecodeStepper`).

The running sequences share one ``DynamicCache`` of shape ``(rows, kv_heads, columns,
head_dim)`` per layer, every row right-aligned (left padding, masked out of attention; each
row's position ids count its own tokens only, as ``generate`` counts them under left
padding). A step feeds every running row its last token, prefills the joining prompts as
one left-padded batch of their own, and appends their cache rows, the shorter side padded
on the left; rows that finish or leave are cut out and all-padding columns trimmed. This is
TGI's original (pre-paged-attention) design: ``concatenate`` and ``filter`` of a padded
batch (github.com/huggingface/text-generation-inference, ``server/.../causal_lm.py``).

Why not transformers' own continuous batching (``generation/continuous_batching``,
``ContinuousBatchingManager``), tried first: in transformers 5.24 it runs its own background
thread and scheduler (the replica's budget would not decide what joins a step, and an error
in a step stops its loop and fails every request); ``do_sample`` is one setting for the
whole manager (greedy and sampled requests cannot share it) and a seed is per manager, not
per request. Its paged cache avoids the padding this one holds; :meth:`kv_tokens_for` tells
the scheduler that padding, so that it is never more than the leases of the batch cover.

Greedy rows give exactly the tokens ``generate`` gives each prompt alone (the masked
columns add exact zeros to attention). Sampling applies ``temperature``, the model's
``generation_config.top_k`` and ``top_p`` in ``generate``'s order, with a per-sequence
``torch.Generator`` when the request has a seed. ``generation_config`` penalties are not
applied (the API refuses penalty fields).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field

import torch
from transformers import DynamicCache, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from deployments.engines.hf import padded
from deployments.engines.stepping import SequenceStart, SequenceUpdate, StopStrings


@dataclass(eq=False)
class _Row:
    """One running sequence: what it generated and how its text is released."""

    start: SequenceStart
    stop: StopStrings
    streamer: object  # generation._Streamer: the token -> text decoder of the lone path
    _: KW_ONLY
    pieces: list[str] = field(default_factory=list)
    generator: torch.Generator | None = None
    tokens: int = 0
    cached: int = 0  # tokens of this row in the cache
    last_token: int = 0  # generated, not yet fed to the model


class DenseDecodeBatch:
    """The running batch of one :class:`deployments.engines.generation.GenerationEngine`
    (see module docstring). Call from the inference thread only.

    Args:
        engine: the loaded engine (model, tokenizer, stop ids, pad id, device).
    """

    def __init__(self, engine) -> None:
        self._engine = engine
        self._rows: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # (rows, columns) 1 = a real token
        # transformers 5.24 names the forward's cache ``cache``; before (e.g. 5.17) it was
        # ``past_key_values``, and an unknown ``cache`` keyword is silently ignored there.
        forward = inspect.signature(engine.model.forward).parameters
        self._cache_keyword = "cache" if "cache" in forward else "past_key_values"
        top_k = engine.model.generation_config.top_k
        self._top_k = int(top_k) if top_k else 0

    # --- what the scheduler reads -------------------------------------------------------

    def kv_tokens_held(self) -> int:
        return 0 if self._mask is None else int(self._mask.numel())

    @staticmethod
    def kv_tokens_for(rows: Sequence[tuple[int, int]]) -> int:
        """The padded cache's peak over the rows' remaining steps: ``k`` steps from now the
        rows still running (``coming >= k``) hold ``their count x (the longest held + k)``
        slots; that product peaks just before a row leaves, so it is evaluated at ``k = 0``
        and at each row's last step (an upper bound: a row ends no later than its
        ``max_tokens``; one that stops early only lowers it)."""
        peak = 0
        for k in {0, *(coming for _, coming in rows)}:
            alive = [held for held, coming in rows if coming >= k]
            if alive:
                peak = max(peak, len(alive) * (max(alive) + k))
        return peak

    # --- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, joining: Sequence[SequenceStart],
             leaving: Sequence[int]) -> dict[int, SequenceUpdate]:
        try:
            return self._step(joining, leaving)
        except BaseException:
            self.clear()
            raise

    def clear(self) -> None:
        """Drop every sequence and free the cache."""
        self._rows, self._cache, self._mask = [], None, None

    def _step(self, joining: Sequence[SequenceStart],
              leaving: Sequence[int]) -> dict[int, SequenceUpdate]:
        gone = set(leaving)
        self._keep([i for i, row in enumerate(self._rows) if row.start.seq_id not in gone])
        logits = []
        if self._rows:
            logits.append(self._decode())
        if joining:
            logits.append(self._prefill(joining))
        if not logits:
            return {}
        last = torch.cat(logits)
        greedy = last.argmax(dim=-1).tolist()  # one device sync for the whole batch
        updates = {row.start.seq_id: self._advance(row, last[i], greedy[i])
                   for i, row in enumerate(self._rows)}
        self._keep([i for i, row in enumerate(self._rows)
                    if updates[row.start.seq_id].finish_reason is None])
        return updates

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: DynamicCache) -> torch.Tensor:
        model = self._engine.model
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    use_cache=True, logits_to_keep=1, **{self._cache_keyword: cache})
        return out.logits[:, -1, :].float()

    def _decode(self) -> torch.Tensor:
        """Feed every running row its last token; the logits of each row's next one."""
        device = self._engine.device
        ids = torch.tensor([[row.last_token] for row in self._rows], device=device)
        positions = torch.tensor([[row.cached] for row in self._rows], device=device)
        self._mask = torch.cat([self._mask, torch.ones_like(ids)], dim=1)
        logits = self._forward(ids, self._mask, positions, self._cache)
        for row in self._rows:
            row.cached += 1
        return logits

    def _prefill(self, joining: Sequence[SequenceStart]) -> torch.Tensor:
        """Prefill the joining prompts as one left-padded batch and append their rows."""
        engine = self._engine
        inputs = {k: v.to(engine.device)
                  for k, v in padded([s.ids for s in joining], engine.pad_id,
                                     side="left").items()}
        mask = inputs["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=engine.model.config)
        logits = self._forward(inputs["input_ids"], mask, positions, cache)
        rows = [self._new_row(start) for start in joining]
        self._append(cache, mask, rows)
        return logits

    def _new_row(self, start: SequenceStart) -> _Row:
        params = start.params
        stop, pieces = StopStrings(params.stop), []
        row = _Row(start, stop, self._engine.text_streamer(stop, pieces.append), pieces=pieces,
                   cached=len(start.ids))
        if params.temperature > 0 and params.seed is not None:
            row.generator = torch.Generator(device=self._engine.device)
            row.generator.manual_seed(params.seed)
        return row

    def _append(self, cache: DynamicCache, mask: torch.Tensor, rows: list[_Row]) -> None:
        if self._cache is None:
            self._cache, self._mask, self._rows = cache, mask, rows
            return
        columns = max(self._mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, columns, 2),
                                   _left_pad(theirs.keys, columns, 2)])
            mine.values = torch.cat([_left_pad(mine.values, columns, 2),
                                     _left_pad(theirs.values, columns, 2)])
        self._mask = torch.cat([_left_pad(self._mask, columns, 1), _left_pad(mask, columns, 1)])
        self._rows = self._rows + rows

    def _keep(self, indices: list[int]) -> None:
        """Keep only these rows, then trim the columns that are padding in every row."""
        if len(indices) == len(self._rows):
            return
        if not indices:
            self.clear()
            return
        index = torch.tensor(indices, device=self._mask.device)
        mask = self._mask.index_select(0, index)
        first = int(mask.any(dim=0).nonzero()[0])
        self._mask = mask[:, first:]
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        self._rows = [self._rows[i] for i in indices]

    # --- tokens to text -------------------------------------------------------------------

    def _advance(self, row: _Row, logits: torch.Tensor, greedy: int) -> SequenceUpdate:
        """Pick the row's next token (``greedy``: its argmax), release its text, and say
        whether it finished."""
        token = greedy if row.start.params.temperature <= 0 else self._sample(row, logits)
        row.tokens += 1
        row.last_token = token
        row.streamer.put(torch.tensor([token]))
        ended_by_eos = token in self._engine.stop_ids
        reason = "stop" if ended_by_eos or row.stop.hit else (
            "length" if row.tokens >= row.start.params.max_tokens else None)
        if reason is not None and not row.stop.hit:
            row.streamer.end()  # flushes the last word: it may complete a stop string
            reason = "stop" if row.stop.hit else reason
        text, row.pieces[:] = "".join(row.pieces), []
        return SequenceUpdate(text, row.tokens, reason)

    def _sample(self, row: _Row, logits: torch.Tensor) -> int:
        params = row.start.params
        scores = logits.unsqueeze(0)
        warpers = [TemperatureLogitsWarper(params.temperature)]
        if self._top_k:
            warpers.append(TopKLogitsWarper(self._top_k))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
        for warper in warpers:
            scores = warper(None, scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=row.generator))


def _left_pad(tensor: torch.Tensor, columns: int, dim: int) -> torch.Tensor:
    """``tensor`` padded with zeros on the left of ``dim`` to ``columns``."""
    missing = columns - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
