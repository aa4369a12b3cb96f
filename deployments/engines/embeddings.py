"""Sentence embeddings with transformers: mean-pooled, L2-normalised, like sentence-transformers.

The pooling follows the ``1_Pooling`` (mean) and ``Normalize`` modules that
sentence-transformers' all-MiniLM-L6-v2 declares in its ``modules.json``; a test checks the
vectors against ``SentenceTransformer.encode`` for the same directory.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel

from deployments.engines.hf import HFEngine
from serve_app.memory.cost_model import DTYPE_BYTES, TransformerShape

logger = logging.getLogger(__name__)


@dataclass
class EmbeddingEngine(HFEngine):
    """A loaded encoder model and its tokenizer (arguments: :class:`HFEngine`). ``embed`` and
    ``profile_run`` must be called from one thread; ``count_tokens`` is thread-safe."""

    task = "embed"
    auto_class = AutoModel

    def __post_init__(self) -> None:
        super().__post_init__()
        self.shape = TransformerShape.from_hf_config(self.config, DTYPE_BYTES[self.dtype])
        self.max_seq_tokens = _max_seq_tokens(self.path, self.shape.max_positions)
        self.dimensions = self.shape.hidden_size

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens per text, special tokens included (what the model will see)."""
        encoded = self.tokenize(texts, add_special_tokens=True, truncation=False,
                                 verbose=False)
        return [len(ids) for ids in encoded["input_ids"]]

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts`` in one padded batch.

        Returns:
            float32 array of shape ``(len(texts), dimensions)``, each row of unit L2 norm.
        """
        batch = self.tokenize(texts, padding=True, truncation=True,
                               max_length=self.max_seq_tokens, return_tensors="pt")
        return self._forward(dict(batch))

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


def _max_seq_tokens(path: Path, max_positions: int) -> int:
    """sentence-transformers' ``max_seq_length`` if the directory declares one, else the
    model's position limit."""
    st_config = path / "sentence_bert_config.json"
    if st_config.exists():
        declared = json.loads(st_config.read_text()).get("max_seq_length")
        if declared:
            return min(int(declared), max_positions)
    return max_positions
