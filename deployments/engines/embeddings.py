"""Sentence embeddings as sentence-transformers defines them for the model directory.

The directory's own pipeline (:mod:`deployments.engines.st_layout`: its pooling mode,
``Dense`` layers, ``Normalize``, prompts, ``max_seq_length``, ``do_lower_case``) is loaded by
sentence-transformers itself and run on the token ids the ingress made, so served vectors are
``SentenceTransformer.encode``'s (tests compare every pooling mode, max abs difference below
1e-4 on CPU). A plain Hugging Face directory is mean-pooled and L2-normalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel

from deployments.engines.hf import CANARY_TEXT, HFEngine, HFFrontEnd, padded
from deployments.engines.runners import EmbeddingRunner
from deployments.engines.st_layout import EmbeddingLayout, UnsupportedLayout, read_layout
from serve_app.config import AppArgs, config_error
from serve_app.errors import InvalidRequestError
from serve_app.memory.cost_model import TransformerShape


class EmbeddingFrontEnd(HFFrontEnd):
    """The tokenizer as the directory's ``Transformer`` module reads text
    (``do_lower_case``), and its prompts (``input_type`` picks one by name).

    Args:
        layout: the directory's embedding pipeline.
        max_seq_tokens, vocab_size: as :class:`HFFrontEnd`.
    """

    def __init__(self, layout: EmbeddingLayout, max_seq_tokens: int, vocab_size: int) -> None:
        super().__init__(layout.transformer_dir, max_seq_tokens, vocab_size)
        self.layout = layout
        # sentence-transformers' max_seq_length: the declared one, else the tokenizer's
        # model_max_length capped at the model's positions (``Transformer.__init__``).
        declared = layout.max_seq_length or self.tokenizer.model_max_length
        self.max_seq_tokens = min(int(declared), max_seq_tokens)
        if layout.do_lower_case:
            self._lower_case()
        self._prompt_lengths: dict[str, int] = {}

    def _lower_case(self) -> None:
        """What sentence-transformers' ``Transformer(do_lower_case=True)`` does: a
        ``Lowercase`` normaliser ahead of the tokenizer's own."""
        from tokenizers import normalizers

        backend = self.tokenizer.backend_tokenizer
        current = backend.normalizer
        backend.normalizer = normalizers.Sequence(
            [normalizers.Lowercase(), *([current] if current is not None else [])])
        self.special = self._special_tokens()

    def prompted(self, texts: Sequence[str], input_type: str | None) -> tuple[list[str], int]:
        """Each text after the prompt ``input_type`` names (else the default prompt), as
        ``SentenceTransformer.encode(prompt_name=...)`` prepends it; and the prompt's tokens
        when the pooling leaves them out (``include_prompt: false``), else 0.

        Raises:
            InvalidRequestError: ``input_type`` names no prompt of the model.
        """
        prompts = self.layout.prompts
        if input_type is not None and input_type not in prompts:
            known = sorted(prompts) or "none"
            raise InvalidRequestError(f"input_type={input_type!r} is not a prompt of this "
                                      f"model (its prompts: {known})", code="input_type")
        prompt = prompts.get(input_type or self.layout.default_prompt_name or "", "")
        if not prompt:
            return list(texts), 0
        skipped = 0 if self.layout.include_prompt else self._prompt_length(prompt)
        return [prompt + text for text in texts], skipped

    def _prompt_length(self, prompt: str) -> int:
        """The prompt's tokens, a trailing special token excluded (sentence-transformers'
        ``Transformer._get_prompt_length``)."""
        if prompt not in self._prompt_lengths:
            [ids] = self.tokenize([prompt])
            trailing_special = bool(ids) and ids[-1] in self.tokenizer.all_special_ids
            self._prompt_lengths[prompt] = len(ids) - trailing_special
        return self._prompt_lengths[prompt]

    def describe(self) -> dict[str, Any]:
        return {"embedding": {**self.layout.describe(), "max_seq_tokens": self.max_seq_tokens}}


class EmbeddingEngine(EmbeddingRunner, HFEngine):
    """A loaded embedding model (arguments: :class:`HFEngine`), serving ``embed`` requests.
    ``embed_ids`` and ``profile_run`` must be called from one thread."""

    kinds = ("embed",)
    auto_class = AutoModel

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dimensions = int(self.model.get_embedding_dimension())

    @classmethod
    def model_dir(cls, path: Path) -> Path:
        return read_layout(path).transformer_dir

    @classmethod
    def make_front_end(cls, path: Path, shape: TransformerShape) -> EmbeddingFrontEnd:
        return EmbeddingFrontEnd(read_layout(path), shape.max_positions, shape.vocab_size)

    @classmethod
    def planned_context(cls, args: AppArgs) -> tuple[int, str] | None:
        """:meth:`HFEngine.planned_context`, or the sentence-transformers
        ``max_seq_length`` when it is shorter (what the front end reads at most)."""
        found = super().planned_context(args)
        try:
            declared = read_layout(args.model.resolved_path()).max_seq_length
        except (UnsupportedLayout, OSError, ValueError, KeyError):
            return found
        if found is not None and declared is not None and int(declared) < found[0]:
            return int(declared), "max_seq_length in its sentence_bert_config.json"
        return found

    @classmethod
    def check_args(cls, args: AppArgs) -> None:
        path = args.model.resolved_path()
        if not path.exists():
            return  # as HFEngine.check_args: left to the replicas
        try:
            read_layout(path)
        except (UnsupportedLayout, OSError, ValueError, KeyError) as exc:
            raise config_error("model.path", str(exc)) from None
        super().check_args(args)

    def load_model(self, dtype: torch.dtype) -> Any:
        """The directory's sentence-transformers pipeline; for a plain directory, its model
        with mean pooling and normalisation."""
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import (
            Normalize,
            Pooling,
            Transformer,
        )

        if self.front.layout.source == "default":
            transformer = Transformer(str(self.path), model_kwargs={"dtype": dtype})
            modules = [transformer, Pooling(transformer.get_embedding_dimension(), "mean"),
                       Normalize()]
            model = SentenceTransformer(modules=modules, device=self.device)
        else:
            model = SentenceTransformer(str(self.path), device=self.device,
                                        local_files_only=True, model_kwargs={"dtype": dtype})
        return model.eval()

    def embed_ids(self, input_ids: Sequence[Sequence[int]],
                  prompt_tokens: int = 0) -> np.ndarray:
        """Embed inputs given as token ids in one padded batch; ``prompt_tokens``: leading
        prompt tokens of each (see :class:`serve_app.request.EmbeddingParams`).

        Returns:
            float32 array of shape ``(len(input_ids), dimensions)``.
        """
        features = padded(input_ids, self.tokenizer.pad_token_id or 0)
        return self._forward(features, prompt_tokens)

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """One real forward pass over ``batch`` inputs of exactly ``prompt_tokens`` tokens
        (the profiler's unit of measurement; ``new_tokens`` is ignored by encoders)."""
        ids = torch.full((batch, prompt_tokens), self.tokenizer.unk_token_id or 100)
        self._forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def canary(self) -> bool:
        return bool(np.isfinite(self.embed([CANARY_TEXT])).all())

    @torch.inference_mode()
    def _forward(self, features: dict[str, Any], prompt_tokens: int = 0) -> np.ndarray:
        features = {k: v.to(self.device) for k, v in features.items()}
        if prompt_tokens:
            features["prompt_length"] = prompt_tokens
        return self.model(features)["sentence_embedding"].float().cpu().numpy()
