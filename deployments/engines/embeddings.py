"""Sentence embeddings with transformers: mean-pooled, L2-normalised, like sentence-transformers.

The pooling follows the ``1_Pooling`` (mean) and ``Normalize`` modules that
sentence-transformers' all-MiniLM-L6-v2 declares in its ``modules.json``; a test checks the
vectors against ``SentenceTransformer.encode`` for the same directory.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel

from deployments.engines.base import EmbeddingRunner
from deployments.engines.hf import HFEngine, padded
from serve_app.memory.cost_model import TransformerShape


class EmbeddingEngine(EmbeddingRunner, HFEngine):
    """A loaded encoder model and its tokenizer (arguments: :class:`HFEngine`), serving
    ``embed`` requests. ``embed_ids`` and ``profile_run`` must be called from one thread."""

    kinds = ("embed",)
    auto_class = AutoModel

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dimensions = self.shape.hidden_size

    @classmethod
    def context_tokens(cls, path: Path, shape: TransformerShape) -> int:
        """sentence-transformers' ``max_seq_length`` if the directory declares one, else the
        model's position limit."""
        st_config = Path(path) / "sentence_bert_config.json"
        if st_config.exists():
            declared = json.loads(st_config.read_text()).get("max_seq_length")
            if declared:
                return min(int(declared), shape.max_positions)
        return shape.max_positions

    def embed_ids(self, input_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Embed inputs given as token ids in one padded batch.

        Returns:
            float32 array of shape ``(len(input_ids), dimensions)``, each row of unit L2 norm.
        """
        return self._forward(padded(input_ids, self.tokenizer.pad_token_id or 0))

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """One real forward pass over ``batch`` inputs of exactly ``prompt_tokens`` tokens
        (the profiler's unit of measurement; ``new_tokens`` is ignored by encoders)."""
        ids = torch.full((batch, prompt_tokens), self.tokenizer.unk_token_id or 100)
        self._forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    @torch.inference_mode()
    def _forward(self, batch: dict[str, torch.Tensor]) -> np.ndarray:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        token_embeddings = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(token_embeddings.dtype)
        pooled = (token_embeddings * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        normalised = torch.nn.functional.normalize(pooled.float(), p=2, dim=1)
        return normalised.cpu().numpy()
