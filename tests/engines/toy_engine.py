"""The toy engine, written from docs/engines.md alone: an ``embed`` model whose memory grows
as texts x words^2, along axes of its own and with a cost feature it registers.

A text's vector is the mean, over every (ordered) pair of its tokens, of the elementwise
product of the two tokens' rows of a fixed random table (``ROWS x WIDTH`` float32, seed 0:
32 MiB, well above the host probe's noise), L2-normalised. The pass holds a float32
``(texts, words, words, WIDTH)`` pair tensor: ``4 x WIDTH`` bytes per word pair. Padding is
zeroed before the product, so a text's vector does not depend on the pass it runs in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deployments.engines.runners import EmbeddingRunner
from deployments.engines.words import WordFrontEnd
from serve_app.config import AppArgs
from serve_app.memory.cost_model import Shape, register_feature

ROWS, WIDTH = 16384, 512
MAX_SEQ_TOKENS = 66  # 64 words between the begin and end ids


def _texts_word_pairs(texts: int, words: int, unused: int) -> float:
    return float(texts * words * words)


register_feature("toy_texts_word_pairs", _texts_word_pairs)


class ToyEngine(EmbeddingRunner):
    """Embeds texts by the mean product of their token pairs (module docstring), on
    ``cpu`` or ``cuda``. Its shape is ``(texts, words, unused)``; a profile run is one
    pass, through ``run_batch``, of ``texts`` texts of ``words`` ids each (the default)."""

    kinds = ("embed",)
    shape_axes = ("texts", "words", "unused")
    fit_features = ("const", "toy_texts_word_pairs")

    def __init__(self, device: str) -> None:
        self.front = WordFrontEnd(MAX_SEQ_TOKENS)
        self.max_seq_tokens = MAX_SEQ_TOKENS
        self.device = device
        generator = torch.Generator().manual_seed(0)
        self.table = torch.randn(ROWS, WIDTH, generator=generator).to(device)

    @classmethod
    def front_end(cls, args: AppArgs) -> WordFrontEnd:
        return WordFrontEnd(MAX_SEQ_TOKENS)

    @classmethod
    def load(cls, args: AppArgs, device: str) -> ToyEngine:
        return cls(device)

    def profile_ladder(self, largest: Shape) -> tuple[list[Shape], list[Shape]]:
        """Fitted: texts in {1, half, all} x words in {8, half, all} of ``largest``, largest
        first; held out: (a quarter, three quarters) and (three quarters, a third)."""
        texts, words = largest.inputs, largest.prompt_tokens
        fitted = sorted({Shape(t, w, 0) for t in (1, max(1, texts // 2), texts)
                         for w in (min(8, words), max(1, words // 2), words)},
                        key=lambda s: (_texts_word_pairs(*s), s), reverse=True)
        held_out = [Shape(max(1, texts // 4), max(1, words * 3 // 4), 0),
                    Shape(max(1, texts * 3 // 4), max(1, words // 3), 0)]
        return fitted, [s for s in dict.fromkeys(held_out) if s not in fitted]

    @torch.inference_mode()
    def embed_ids(self, input_ids: Sequence[Sequence[int]]) -> np.ndarray:
        length = max(len(ids) for ids in input_ids)
        ids = torch.zeros(len(input_ids), length, dtype=torch.long)
        mask = torch.zeros(len(input_ids), length)
        for row, text in enumerate(input_ids):
            ids[row, :len(text)] = torch.tensor(text) % ROWS
            mask[row, :len(text)] = 1.0
        ids, mask = ids.to(self.device), mask.to(self.device)
        rows = self.table[ids] * mask[..., None]  # padding rows are zero
        pairs = rows[:, :, None, :] * rows[:, None, :, :]  # (texts, words, words, WIDTH)
        mean = pairs.sum(dim=(1, 2)) / (mask.sum(dim=1) ** 2)[:, None]
        return torch.nn.functional.normalize(mean, dim=1).float().cpu().numpy()

    def close(self) -> None:
        self.table = torch.empty(0)
