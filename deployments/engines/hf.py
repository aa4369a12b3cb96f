"""Loading a Hugging Face model directory: shared by the embedding and generation engines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer


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
