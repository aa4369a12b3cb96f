"""Loading a Hugging Face model directory: shared by the embedding and generation engines."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import AutoTokenizer

# What the canary inference after an OOM reads: short, and tokenised alike by any vocabulary.
CANARY_TEXT = "The quick brown fox jumps over the lazy dog."


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when CUDA is usable in this process, else ``cpu``.

    Raises:
        RuntimeError: ``cuda`` was asked for but is not available.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is 'cuda' but CUDA is not available to this replica")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` -> float16 on CUDA, float32 on CPU."""
    if dtype == "auto":
        return "float16" if device == "cuda" else "float32"
    return dtype


def load_pretrained(auto_class: Any, path: Path, device: str, dtype: str,
                    num_threads: int | None) -> tuple[Any, torch.nn.Module, dict[str, Any]]:
    """``(tokenizer, model in eval mode on device, config.json as a dict)``.

    Args:
        auto_class: e.g. ``transformers.AutoModel`` or ``AutoModelForCausalLM``.
        num_threads: torch intra-op threads on CPU, or ``None`` to leave torch's default.

    Raises:
        OSError: the directory lacks model or tokenizer files.
    """
    if device == "cpu" and num_threads:
        torch.set_num_threads(num_threads)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = auto_class.from_pretrained(str(path), dtype=getattr(torch, dtype))
    model.to(device).eval()
    return tokenizer, model, json.loads((Path(path) / "config.json").read_text())


@dataclass
class HFEngine:
    """A loaded Hugging Face model directory; the engines build on it.

    Args:
        path: local model directory (``config.json``, weights, tokenizer files).
        device: ``cpu`` or ``cuda`` (already resolved).
        dtype: ``float32``, ``float16`` or ``bfloat16`` (already resolved).
        num_threads: torch intra-op threads on CPU, or ``None`` to leave torch's default.

    Raises:
        OSError: the directory lacks model or tokenizer files.
    """

    path: Path
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int | None = None

    auto_class: ClassVar[Any]

    def __post_init__(self) -> None:
        self.tokenizer, self.model, self.config = load_pretrained(
            self.auto_class, self.path, self.device, self.dtype, self.num_threads)
        self._tokenizer_lock = threading.Lock()

    @torch.inference_mode()
    def canary(self) -> bool:
        """One forward pass over :data:`CANARY_TEXT`; ``True`` when every value of the first
        output (hidden states, or logits for a causal LM) is finite. Run after an OOM: a
        device left corrupt by a failed kernel shows as NaN/Inf before it shows as an error."""
        inputs = self.tokenize(CANARY_TEXT, return_tensors="pt")
        output = self.model(**{k: v.to(self.device) for k, v in inputs.items()})[0]
        return bool(torch.isfinite(output).all())

    def tokenize(self, *args: Any, **kwargs: Any) -> Any:
        """Call the tokenizer under a lock: ``count_tokens`` runs on a helper thread while the
        inference thread tokenizes too, and a fast tokenizer changes its padding and
        truncation state per call ("Already borrowed" when shared unguarded)."""
        with self._tokenizer_lock:
            return self.tokenizer(*args, **kwargs)
