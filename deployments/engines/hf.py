"""A Hugging Face model directory: its front end, its config, and the loaded model; shared
by the embedding and generation engines."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from deployments.engines.base import Engine
from deployments.engines.devices import resolve_dtype
from serve_app.config import AppArgs
from serve_app.memory.cost_model import DTYPE_BYTES, AnalyticCostModel, TransformerShape

# What the canary inference after an OOM reads: short, and tokenised alike by any vocabulary.
CANARY_TEXT = "The quick brown fox jumps over the lazy dog."


def read_config(path: Path) -> dict[str, Any]:
    """The directory's ``config.json``.

    Raises:
        OSError: no readable ``config.json``; ValueError: not JSON.
    """
    return json.loads((Path(path) / "config.json").read_text())


class HFFrontEnd:
    """The model's own tokenizer (no weights), for the ingress and the engine alike.

    Args:
        path: the model directory.
        max_seq_tokens: the model's context, tokens.

    Raises:
        OSError: the directory has no tokenizer files.
    """

    def __init__(self, path: Path, max_seq_tokens: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.max_seq_tokens = max_seq_tokens
        # A fast tokenizer changes its padding and truncation state per call ("Already
        # borrowed" when shared unguarded between threads).
        self._lock = threading.Lock()

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, special tokens included (what the model sees). Thread-safe."""
        with self._lock:
            encoded = self.tokenizer(list(texts), add_special_tokens=True, truncation=False,
                                     verbose=False)
        return [list(ids) for ids in encoded["input_ids"]]


def padded(input_ids: Sequence[Sequence[int]], pad_id: int,
           side: str = "right") -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of one batch padded to its longest row, on the
    ``right`` (encoders) or the ``left`` (decoders: every row's next token is the last
    column), as the tokenizer pads text."""
    longest = max(len(ids) for ids in input_ids)
    ids = torch.full((len(input_ids), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(input_ids):
        cols = slice(longest - len(seq), longest) if side == "left" else slice(0, len(seq))
        ids[row, cols] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, cols] = 1
    return {"input_ids": ids, "attention_mask": mask}


class HFEngine(Engine):
    """A loaded Hugging Face model directory; the embedding and generation engines build on
    it.

    Args:
        path: local model directory (``config.json``, weights, tokenizer files).
        device: ``cpu`` or ``cuda`` (already resolved).
        dtype: ``float32``, ``float16`` or ``bfloat16`` (already resolved).
        num_threads: torch intra-op threads on CPU, or ``None`` to leave torch's default.

    Raises:
        OSError: the directory lacks model or tokenizer files.
    """

    auto_class: ClassVar[Any]

    def __init__(self, path: Path, device: str = "cpu", dtype: str = "float32",
                 num_threads: int | None = None) -> None:
        self.path, self.device, self.dtype = Path(path), device, dtype
        if device == "cpu" and num_threads:
            torch.set_num_threads(num_threads)
        self.config = read_config(self.path)
        self.shape = self.model_shape(self.config, DTYPE_BYTES[dtype])
        self.max_seq_tokens = self.context_tokens(self.path, self.shape)
        self.front = HFFrontEnd(self.path, self.max_seq_tokens)
        self.tokenizer = self.front.tokenizer
        self.model = self.auto_class.from_pretrained(str(self.path),
                                                     dtype=getattr(torch, dtype))
        self.model.to(device).eval()

    # --- the class ---------------------------------------------------------------------

    @classmethod
    def model_shape(cls, config: dict[str, Any], dtype_bytes: int) -> TransformerShape:
        """The dimensions that set the model's memory use, from ``config.json``.

        Raises:
            KeyError: a dimension is missing under every known key.
        """
        return TransformerShape.from_hf_config(config, dtype_bytes)

    @classmethod
    def context_tokens(cls, path: Path, shape: TransformerShape) -> int:
        """The longest input the model accepts, tokens."""
        return shape.max_positions

    @classmethod
    def front_end(cls, args: AppArgs) -> HFFrontEnd:
        path = args.model.resolved_path()
        shape = cls.model_shape(read_config(path), 4)
        return HFFrontEnd(path, cls.context_tokens(path, shape))

    @classmethod
    def describe(cls, args: AppArgs) -> str:
        return f"{args.model.name} ({args.model.resolved_path()})"

    @classmethod
    def profile_identity(cls, args: AppArgs) -> str:
        return str(args.model.resolved_path())

    @classmethod
    def analytic_costs(cls, args: AppArgs) -> tuple[AnalyticCostModel, int]:
        """From ``config.json``, in the dtype a replica of ``args`` loads (``auto``: fp16 on
        a GPU share, fp32 on CPU)."""
        dtype = resolve_dtype(args.model.dtype, cls.device_kind(args))
        shape = cls.model_shape(read_config(args.model.resolved_path()), DTYPE_BYTES[dtype])
        model = AnalyticCostModel(shape)
        return model, model.weights_bytes()

    @classmethod
    def load(cls, args: AppArgs, device: str) -> HFEngine:
        return cls(args.model.resolved_path(), device, resolve_dtype(args.model.dtype, device),
                   args.model.num_threads or max(1, int(args.deployment.num_cpus)))

    # --- the instance ------------------------------------------------------------------

    def analytic_model(self) -> AnalyticCostModel:
        return AnalyticCostModel(self.shape)

    @property
    def is_decoder(self) -> bool:
        return self.shape.is_decoder

    @torch.inference_mode()
    def canary(self) -> bool:
        """One forward pass over :data:`CANARY_TEXT`; ``True`` when every value of the first
        output (hidden states, or logits for a causal LM) is finite. Run after an OOM: a
        device left corrupt by a failed kernel shows as NaN/Inf before it shows as an error."""
        batch = padded(self.front.tokenize([CANARY_TEXT]), 0)
        output = self.model(**{k: v.to(self.device) for k, v in batch.items()})[0]
        return bool(torch.isfinite(output).all())
