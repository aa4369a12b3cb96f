"""A toy engine written from docs/engines.md alone: an ``embed`` engine whose cost grows with
``texts x words^2`` (every pair of words in a text gets a 512-float product vector, as
attention scores would), measured and fitted along its own axes with its own feature.

The model: a fixed random table of 16384 x 512 floats (seed 0); a text's vector is the mean of
the elementwise products of its words' rows over all pairs of its words, L2-normalised.
Padding is masked, so a text's vector does not depend on the batch it runs in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deployments.engines.runners import EmbeddingRunner
from deployments.engines.words import WordFrontEnd
from serve_app.config import AppArgs
from serve_app.memory.cost_model import Shape, register_feature

# 16384 x 512 floats: the loaded model holds 32 MiB, well above the RSS noise a saved profile
# is checked against (serve_app.memory.reuse.REUSE_HELD_TOLERANCE).
TABLE_ROWS, WIDTH = 16384, 512


def _texts_word_pairs(texts: int, words: int, unused: int) -> float:
    """The pair tensor's elements per ``WIDTH``: texts x words^2."""
    return float(texts * words * words)


register_feature("toy_texts_word_pairs", _texts_word_pairs)


class ToyEngine(EmbeddingRunner):
    """Serves ``/v1/embeddings`` (kind ``embed``) with the toy model (module docstring)."""

    kinds = ("embed",)
    shape_axes = ("texts", "words", "unused")
    fit_features = ("const", "toy_texts_word_pairs")  # type: ignore[assignment]
    max_seq_tokens = 66  # 64 words between the front end's begin and end ids

    def __init__(self, device: str = "cpu") -> None:
        generator = torch.Generator().manual_seed(0)
        self.device = device
        self.table = torch.randn(TABLE_ROWS, WIDTH, generator=generator).to(device)

    @classmethod
    def front_end(cls, args: AppArgs) -> WordFrontEnd:
        return WordFrontEnd(cls.max_seq_tokens)

    @classmethod
    def load(cls, args: AppArgs, device: str) -> ToyEngine:
        engine = cls(device)
        engine.front = cls.front_end(args)
        return engine

    @torch.inference_mode()
    def embed_ids(self, input_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 ``(len(input_ids), WIDTH)``: one padded pass holding a
        ``(texts, words, words, WIDTH)`` tensor of pair products."""
        longest = max(len(ids) for ids in input_ids)
        ids = torch.zeros(len(input_ids), longest, dtype=torch.long)
        mask = torch.zeros(len(input_ids), longest)
        for row, seq in enumerate(input_ids):
            ids[row, :len(seq)] = torch.tensor([i % TABLE_ROWS for i in seq])
            mask[row, :len(seq)] = 1.0
        x = self.table[ids.to(self.device)] * mask.to(self.device)[..., None]
        pairs = x[:, :, None, :] * x[:, None, :, :]
        counts = mask.sum(dim=1).to(self.device) ** 2
        pooled = pairs.sum(dim=(1, 2)) / counts[:, None]
        pooled = pooled / pooled.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return pooled.float().cpu().numpy()

    def profile_ladder(self, largest: Shape) -> tuple[list[Shape], list[Shape]]:
        """Texts 1, half and all of the largest x words 8, half and all of the largest,
        largest first (docs/engines.md, section 6); held out: a quarter of the texts at
        three quarters of the words, and three quarters of the texts at a third."""
        texts, words = largest[0], largest[1]
        train = sorted({Shape(t, w, 0) for t in {1, max(1, texts // 2), texts}
                        for w in {min(8, words), max(1, words // 2), words}},
                       key=lambda s: (s[0] * s[1] * s[1], s), reverse=True)
        held = {Shape(max(1, texts // 4), max(1, 3 * words // 4), 0),
                Shape(max(1, 3 * texts // 4), max(1, words // 3), 0)}
        return train, sorted(held - set(train))

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """One real pass over ``batch`` texts of exactly ``prompt_tokens`` words."""
        self.embed_ids([[3] * prompt_tokens] * batch)
