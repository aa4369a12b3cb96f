"""A Hugging Face model directory: its front end, its config, and the loaded model; shared
by the embedding and generation engines."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from deployments.engines.base import OpenedEngine, PassRunner
from deployments.engines.cpu_threads import ThreadChoice, choose_threads, probe_shape
from deployments.engines.devices import resolve_dtype
from deployments.engines.spec import EngineSpec, FrontEndDefaults
from serve_app.config import AppArgs, config_error
from serve_app.errors import InvalidRequestError
from serve_app.memory.cost_model import DTYPE_BYTES, AnalyticCostModel, TransformerShape
from serve_app.memory.model_shape import max_positions_key
from serve_app.token_inputs import SpecialTokens

logger = logging.getLogger(__name__)

# What the canary inference after an OOM reads: short, and tokenised alike by any vocabulary.
CANARY_TEXT = "The quick brown fox jumps over the lazy dog."


def read_config(path: Path) -> dict[str, Any]:
    """The directory's ``config.json``.

    Raises:
        OSError: no readable ``config.json``; ValueError: not JSON.
    """
    return json.loads((Path(path) / "config.json").read_text())


class HFFrontEnd(FrontEndDefaults):
    """The model's own tokenizer (no weights), for the ingress and the engine alike.

    Args:
        path: the directory holding the tokenizer files.
        max_seq_tokens: the model's context, tokens.
        vocab_size: the model's embedding rows (``config.json``); token-id inputs must lie
            below it and below the tokenizer's size.

    Raises:
        OSError: the directory has no tokenizer files.
    """

    def __init__(self, path: Path, max_seq_tokens: int, vocab_size: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.max_seq_tokens = max_seq_tokens
        self.vocab_size = min(vocab_size, len(self.tokenizer))
        # A fast tokenizer changes its padding and truncation state per call ("Already
        # borrowed" when shared unguarded between threads).
        self._lock = threading.Lock()
        self.special = self._special_tokens()

    chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's own (``model.chat_template``)."""

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, special tokens included (what the model sees). Thread-safe."""
        return self._encode(texts, True)

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """``apply_chat_template`` with the generation prompt added, with
        :attr:`chat_template` or the tokenizer's own. Thread-safe.

        Raises:
            InvalidRequestError: neither exists (400 naming ``model.chat_template``); the
                template refuses the messages (its ``raise_exception``, as Gemma's refuses a
                system message, or a message it cannot render: 400 ``messages`` with the
                template's own words). A template that does not parse is the operator's
                error and leaves as the ``TemplateSyntaxError`` it is.
        """
        from jinja2 import TemplateError, TemplateSyntaxError

        template = self.chat_template or self.tokenizer.chat_template
        if not template:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template: set model.chat_template to a "
                "Jinja template file to serve /v1/chat/completions", code="chat_template")
        try:
            with self._lock:
                encoded = self.tokenizer.apply_chat_template(
                    list(messages), chat_template=template, add_generation_prompt=True,
                    tokenize=True, return_dict=True)
        except TemplateSyntaxError:
            raise
        except TemplateError as exc:
            raise InvalidRequestError(f"the model's chat template refuses these messages: "
                                      f"{exc}", code="messages") from None
        return list(encoded["input_ids"])

    def _encode(self, texts: Sequence[str], special: bool) -> list[list[int]]:
        with self._lock:
            encoded = self.tokenizer(list(texts), add_special_tokens=special,
                                     truncation=False, verbose=False)
        return [list(ids) for ids in encoded["input_ids"]]

    def _special_tokens(self) -> SpecialTokens:
        """What the tokenizer puts around a text: a probe text's ids with and without
        special tokens, compared."""
        [plain], [full] = self._encode(["a"], False), self._encode(["a"], True)
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return SpecialTokens(tuple(full[:start]), tuple(full[start + len(plain):]))
        logger.warning("could not locate the text between the special tokens of %s; token-id "
                       "inputs are taken as they are", type(self.tokenizer).__name__)
        return SpecialTokens()


def unsupported_config(config: dict[str, Any]) -> str:
    """Why a ``config.json`` cannot be served as it should, or ``""``: quantised weights
    (``quantization_config``) and architectures transformers does not ship (``auto_map``:
    the model's own code) are refused rather than loaded wrong or run from the directory."""
    from transformers import CONFIG_MAPPING

    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        return (f"quantised weights (quantization_config: {method}) are not supported; serve "
                "the unquantised model (float32, float16 or bfloat16)")
    model_type = config.get("model_type")
    if config.get("auto_map") and model_type not in CONFIG_MAPPING:
        return (f"model_type {model_type!r} needs the model's own code (auto_map, "
                "trust_remote_code), which is not run; use an architecture transformers ships")
    return ""


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


class ModelDirectoryEngine(EngineSpec):
    """The spec of an engine that loads the model directory ``model.path``: it is named, and its
    profiles recorded, by that directory."""

    @classmethod
    def describe(cls, args: AppArgs) -> str:
        return f"{args.model.name} ({args.model.resolved_path()})"

    @classmethod
    def profile_identity(cls, args: AppArgs) -> str:
        return str(args.model.resolved_path())


class HFEngine(ModelDirectoryEngine, PassRunner):
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
        self.config = read_config(self.model_dir(self.path))
        self.shape = self.model_shape(self.config, DTYPE_BYTES[dtype])
        self.front = self.make_front_end(self.path, self.shape)
        self.max_seq_tokens = self.front.max_seq_tokens
        self.tokenizer = self.front.tokenizer
        self.model = self.load_model(getattr(torch, dtype))

    def load_model(self, dtype: torch.dtype) -> Any:
        """The model on :attr:`device`, in eval mode."""
        model = self.auto_class.from_pretrained(str(self.model_dir(self.path)), dtype=dtype)
        return model.to(self.device).eval()

    # --- the class ---------------------------------------------------------------------

    @classmethod
    def model_shape(cls, config: dict[str, Any], dtype_bytes: int) -> TransformerShape:
        """The dimensions that set the model's memory use, from ``config.json``.

        Raises:
            KeyError: a dimension is missing under every known key.
        """
        return TransformerShape.from_hf_config(config, dtype_bytes)

    @classmethod
    def model_dir(cls, path: Path) -> Path:
        """The directory holding ``config.json`` and the weights (``path`` itself)."""
        return Path(path)

    @classmethod
    def make_front_end(cls, path: Path, shape: TransformerShape) -> HFFrontEnd:
        """The front end of the model directory ``path`` of dimensions ``shape``."""
        return HFFrontEnd(cls.model_dir(path), shape.max_positions, shape.vocab_size)

    @classmethod
    def front_end(cls, args: AppArgs) -> HFFrontEnd:
        path = args.model.resolved_path()
        return cls.make_front_end(path, cls.model_shape(read_config(cls.model_dir(path)), 4))

    @classmethod
    def check_args(cls, args: AppArgs) -> None:
        """Refuses at start-up what would be served wrong: quantised weights, a model that
        needs its own code (``trust_remote_code``), a ``config.json`` whose dimensions
        cannot be read. A directory absent here (the model may live on the worker nodes
        only) is left to the replicas, which fail to load it with the reason."""
        path = cls.model_dir(args.model.resolved_path())
        if not (path / "config.json").exists():
            return
        try:
            config = read_config(path)
            cls.model_shape(config, 4)
        except (OSError, ValueError, KeyError) as exc:
            raise config_error("model.path", f"cannot read {path}/config.json: {exc}") from None
        refusal = unsupported_config(config)
        if refusal:
            raise config_error("model.path", f"{path}: {refusal}")

    @classmethod
    def analytic_costs(cls, args: AppArgs) -> tuple[AnalyticCostModel, int]:
        """From ``config.json``, in the dtype a replica of ``args`` loads (``auto``: fp16 on
        a GPU share, fp32 on CPU)."""
        dtype = resolve_dtype(args.model.dtype, cls.device_kind(args))
        config = read_config(cls.model_dir(args.model.resolved_path()))
        shape = cls.model_shape(config, DTYPE_BYTES[dtype])
        model = AnalyticCostModel(shape)
        return model, model.weights_bytes()

    @classmethod
    def planned_context(cls, args: AppArgs) -> tuple[int, str] | None:
        """``config.json``'s positions (``None`` where it cannot be read here)."""
        try:
            config = read_config(cls.model_dir(args.model.resolved_path()))
            positions = cls.model_shape(config, 4).max_positions
        except (OSError, KeyError, ValueError):
            return None
        return positions, f"{max_positions_key(config)} in its config.json"

    @classmethod
    def load(cls, args: AppArgs, device: str) -> HFEngine:
        return cls(args.model.resolved_path(), device, resolve_dtype(args.model.dtype, device),
                   args.model.num_threads or max(1, int(args.deployment.num_cpus)))

    @classmethod
    def open(cls, args: AppArgs) -> OpenedEngine:
        """:meth:`Engine.open`; on CPU, then the thread count is chosen
        (:mod:`deployments.engines.cpu_threads`), after what loading held was measured."""
        opened = super().open(args)
        engine = opened.engine
        if engine.device == "cpu":
            shape = probe_shape(args, engine.max_seq_tokens, engine.is_decoder)
            engine.cpu_threads = choose_threads(args, lambda s: engine.profile_run(*s), shape)
        return opened

    # --- the instance ------------------------------------------------------------------

    cpu_threads: ThreadChoice | None = None
    """On CPU, after :meth:`open`: the threads chosen and the timings they came from."""

    def runtime_status(self) -> dict[str, Any]:
        return {"cpu_threads": self.cpu_threads.describe()} if self.cpu_threads else {}

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
