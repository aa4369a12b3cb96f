"""An engine's class-level spec: what the ingress, the planner and ``vramgate validate`` read
of an engine without loading its weights.

:class:`EngineSpec` answers the request kinds served (:mod:`serve_app.kinds`), the front end
(tokenizer and context length, :class:`FrontEnd`), how deployments are planned (device kind,
capacity, analytic cost model) and what its saved profiles are measured for. Every engine
class is one (:class:`deployments.engines.base.Engine` derives from it); the HTTP side only
ever holds the class, typed as this. No torch import: the fake engine and the planner use it
on machines without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from serve_app.config import AppArgs
from serve_app.errors import InvalidRequestError
from serve_app.memory.cost_model import TOKEN_AXES, CostModel, NoAnalyticCostModelError
from serve_app.planning import planned_host_capacity
from serve_app.token_inputs import SpecialTokens


class FrontEnd(Protocol):
    """What the ingress needs of a model to validate and price requests: its tokenizer, its
    context length, its vocabulary and special tokens (for token-id inputs,
    :mod:`serve_app.token_inputs`) and its prompts. Loaded without the weights; methods must
    be thread-safe. :class:`FrontEndDefaults` gives the optional parts."""

    max_seq_tokens: int
    vocab_size: int
    special: SpecialTokens

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, special tokens included, as the model will see them."""

    def prompted(self, texts: Sequence[str], input_type: str | None) -> tuple[list[str], int]:
        """``texts`` with the model's prompt for ``input_type`` applied, and how many leading
        tokens the pooling must leave out (0: none).

        Raises:
            InvalidRequestError: ``input_type`` names no prompt of the model.
        """

    def describe(self) -> dict[str, Any]:
        """What ``/v1/status`` shows about how the model reads its inputs (may be empty)."""

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The token ids of a conversation (``{"role", "content"}`` dicts) rendered as the
        model's chat template renders it, with the assistant's turn opened.

        Raises:
            InvalidRequestError: the model has no chat template.
        """


class FrontEndDefaults:
    """The optional parts of :class:`FrontEnd` for a model without prompts or chat."""

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        raise InvalidRequestError("this model has no chat template", code="messages")

    def prompted(self, texts: Sequence[str], input_type: str | None) -> tuple[list[str], int]:
        if input_type is not None:
            raise InvalidRequestError(
                f"input_type={input_type!r}: this model defines no prompts", code="input_type")
        return list(texts), 0

    def describe(self) -> dict[str, Any]:
        return {}




class EngineSpec:
    """The class-level half of an engine (module docstring); every method is a classmethod
    and loads nothing.

    Attributes:
        kinds: the request kinds served, e.g. ``("embed",)``.
        shape_axes: what the three slots of a :class:`~serve_app.memory.cost_model.Shape`
            mean for this engine's cost: the token kinds' ``("inputs", "prompt_tokens",
            "new_tokens")`` by default, e.g. ``("files", "audio_frames", "new_tokens")`` for
            speech. Shown with the profile (``python -m serve_app profile``, ``/v1/status``);
            see docs/engines.md.
    """

    kinds: ClassVar[tuple[str, ...]] = ()
    shape_axes: ClassVar[tuple[str, str, str]] = TOKEN_AXES
    profiled: ClassVar[bool] = True
    """Whether a replica profiles the engine's memory at start-up (``vramgate profile``
    measures it the same way); ``False``: the engine sizes and pages its own KV cache, and the
    replica's budget is that pool (``Engine.kv_pool``)."""

    @classmethod
    def check_args(cls, args: AppArgs) -> None:
        """Checks of ``args`` this engine needs (beyond the config's own).

        Raises:
            serve_app.config.ConfigError: naming the key to change.
        """

    @classmethod
    def front_end(cls, args: AppArgs) -> FrontEnd:
        """The tokenizer and context length, loaded without the weights (the ingress)."""
        raise NotImplementedError(f"{cls.__name__} has no front_end")

    @classmethod
    def describe(cls, args: AppArgs) -> str:
        """What is loaded, in words (the ``profile`` command's progress line)."""
        return f"{args.model.name} ({cls.__name__})"

    @classmethod
    def profile_identity(cls, args: AppArgs) -> str:
        """What a profile of this engine records as its ``model_path``."""
        return args.model.path or cls.__qualname__

    @classmethod
    def device_kind(cls, args: AppArgs) -> str:
        """``cpu`` or ``cuda``: the device a replica of ``args`` gets (Ray hides GPUs from
        replicas without ``num_gpus``)."""
        cpu = args.deployment.num_gpus == 0 or args.model.device == "cpu"
        return "cpu" if cpu else "cuda"

    @classmethod
    def device_identity(cls, args: AppArgs) -> tuple[str, int]:
        """``(name, total bytes)`` of the card (or host) a replica of ``args`` gets, read in
        this process without loading the model (what a cached measurement must match).

        Raises:
            DeviceUnavailableError: the config asks for CUDA and this process has none.
        """
        from deployments.engines.devices import device_identity, resolve_device

        return device_identity(resolve_device(args.model.device))

    @classmethod
    def planned_capacity(cls, args: AppArgs) -> tuple[int | None, str]:
        """A replica's capacity as known where the app is built: a CPU replica's share of
        the RAM here; a GPU's is unknown (``None``) until the replica measures it."""
        if cls.device_kind(args) == "cpu":
            return planned_host_capacity(args)
        return None, ""

    @classmethod
    def analytic_costs(cls, args: AppArgs) -> tuple[CostModel, int]:
        """The analytic cost model and the weights' bytes, for planning.

        Raises:
            NoAnalyticCostModelError: none is known (the default; planning then leaves the
                prices to the replicas' measurements).
            OSError, KeyError, ValueError: the model's config cannot be read.
        """
        raise NoAnalyticCostModelError(f"the {args.model.engine_name} engine")

    @classmethod
    def planned_budget_bytes(cls, args: AppArgs, budget_bytes: int) -> int:
        """The budget a replica will derive where the formula gives ``budget_bytes``: that
        budget (an engine that sizes its own KV pool overrides this)."""
        return budget_bytes

    @classmethod
    def planned_context(cls, args: AppArgs) -> tuple[int, str] | None:
        """The model's context (tokens) and where it was read, without loading the model,
        for planning and ``vramgate validate``; ``None`` (the default): unknown here."""
        return None

