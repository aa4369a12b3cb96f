"""How a model directory turns token embeddings into one vector: its sentence-transformers
modules, read without loading weights.

A directory saved by sentence-transformers declares its pipeline in ``modules.json``: a
``Transformer`` (the Hugging Face model), a ``Pooling`` (``1_Pooling/config.json``: mean, CLS,
max, last token, mean-sqrt-len or weighted-mean), optionally ``Dense`` layers and a
``Normalize``; ``config_sentence_transformers.json`` names its prompts (``"query: "``) and the
default one; ``sentence_bert_config.json`` its ``max_seq_length`` and ``do_lower_case``
(https://sbert.net/docs/sentence_transformer/usage/custom_models.html). The module configs
are read by sentence-transformers' own ``Pooling.load`` and ``Transformer.load_config``; the
two top-level JSON files are read as the library reads them (it has no reader that skips the
weights), and a test checks this reading against a loaded ``SentenceTransformer``. A plain
Hugging Face directory (no ``modules.json``) is mean-pooled, as sentence-transformers loads
such a directory, and L2-normalised (``encode(normalize_embeddings=True)``), as this server
has always served it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODULES = ("Transformer", "Pooling", "Dense", "Normalize", "LayerNorm")
"""Module types served: a ``Transformer`` first, then these (token-free) modules."""


EMPTY_PROMPTS = {"query": "", "document": ""}
"""The prompts every ``SentenceTransformer`` has, empty unless the directory sets them
(``SentenceTransformer._default_prompts``)."""


class UnsupportedLayout(ValueError):
    """The directory's sentence-transformers pipeline is not one this engine serves."""


@dataclass(frozen=True, kw_only=True)
class EmbeddingLayout:
    """A model directory's embedding pipeline.

    Attributes:
        transformer_dir: the directory holding the Hugging Face model and tokenizer (the
            ``Transformer`` module's path; the directory itself for a plain one).
        modules: the module types, in order (``("Transformer", "Pooling", "Normalize")``).
        pooling: the pooling mode(s), ``+``-joined when several are concatenated.
        include_prompt: whether prompt tokens are pooled.
        normalize: whether a ``Normalize`` module ends the pipeline (unit L2 norm vectors).
        prompts: prompt name -> text prepended to an input.
        default_prompt_name: the prompt applied when a request names none, or ``None``.
        max_seq_length: tokens the model reads at most, or ``None`` (the model's own limit).
        do_lower_case: inputs are lower-cased before tokenizing.
        source: ``sentence-transformers`` (declared by the directory) or ``default``.
    """

    transformer_dir: Path
    modules: tuple[str, ...] = ("Transformer", "Pooling", "Normalize")
    pooling: str = "mean"
    include_prompt: bool = True
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=lambda: dict(EMPTY_PROMPTS))
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False
    source: str = "default"

    def describe(self) -> dict[str, Any]:
        """What ``/v1/status`` shows (``embedding``)."""
        return {"source": self.source, "modules": list(self.modules), "pooling": self.pooling,
                "include_prompt": self.include_prompt, "normalize": self.normalize,
                "prompts": sorted(self.prompts), "default_prompt_name": self.default_prompt_name,
                "do_lower_case": self.do_lower_case}


def read_layout(path: Path) -> EmbeddingLayout:
    """The embedding pipeline ``path`` declares (see module docstring).

    Raises:
        UnsupportedLayout: a module type outside :data:`SUPPORTED_MODULES`, no
            ``Transformer`` first, or no ``Pooling``; the message names the module.
        OSError, ValueError: unreadable or malformed JSON.
    """
    path = Path(path)
    modules_json = path / "modules.json"
    if not modules_json.exists():
        return EmbeddingLayout(transformer_dir=path)
    entries = json.loads(modules_json.read_text())
    types = tuple(str(entry["type"]).rsplit(".", 1)[-1] for entry in entries)
    _check_modules(path, types)
    by_type = {kind: str(entry.get("path", "")) for kind, entry in zip(types, entries,
                                                                       strict=True)}
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    pooling = Pooling.load(str(path), subfolder=by_type["Pooling"], local_files_only=True)
    transformer = Transformer.load_config(str(path), subfolder=by_type["Transformer"],
                                          local_files_only=True)
    mode = pooling.pooling_mode
    top = _read_json(path / "config_sentence_transformers.json")
    return EmbeddingLayout(
        transformer_dir=path / by_type["Transformer"], modules=types,
        pooling=mode if isinstance(mode, str) else "+".join(mode),
        include_prompt=bool(pooling.include_prompt), normalize=types[-1] == "Normalize",
        prompts={**EMPTY_PROMPTS, **(top.get("prompts") or {})},
        default_prompt_name=top.get("default_prompt_name") or None,
        max_seq_length=transformer.get("max_seq_length"),
        do_lower_case=bool(transformer.get("do_lower_case", False)),
        source="sentence-transformers")


def _check_modules(path: Path, types: tuple[str, ...]) -> None:
    unsupported = [t for t in types if t not in SUPPORTED_MODULES]
    if unsupported:
        raise UnsupportedLayout(
            f"{path}/modules.json: module type(s) {unsupported} are not supported (served: "
            f"{list(SUPPORTED_MODULES)}, a Transformer first)")
    if not types or types[0] != "Transformer" or "Pooling" not in types:
        raise UnsupportedLayout(f"{path}/modules.json declares {list(types)}; a Transformer "
                                "first and a Pooling are needed")
    if types.count("Transformer") > 1 or types.count("Pooling") > 1:
        raise UnsupportedLayout(f"{path}/modules.json declares {list(types)}; one Transformer "
                                "and one Pooling are supported")


def _read_json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.exists() else {}
