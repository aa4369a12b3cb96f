"""The engine protocol: what the system needs from a model, as one base class to subclass.

An engine is chosen by ``model.engine`` (or ``model.task``) through
:mod:`deployments.engines.registry`. Its **class** answers, without loading any weights, what
the ingress and the planner need: the request kinds it serves (:mod:`serve_app.kinds`), its
front end (tokenizer and context length, :class:`FrontEnd`), how its deployments are planned
(device kind, capacity, analytic cost model) and what its saved profiles are measured for. An
**instance**, made by :meth:`Engine.open` in a model replica, holds the model; the replica calls
it from one inference thread only (never concurrently):

- ``run_<kind>(requests)`` for each kind in :attr:`Engine.kinds`: one forward pass over
  requests of that kind that share a batch key (``[one]`` when it runs alone), returning one
  output per request (:class:`serve_app.request.EmbeddingOutput`, ``GenerationOutput``);
- ``stream_<kind>(request, on_text)`` for kinds that stream (``generate``);
- for continuous batching of a generating kind, ``decode_steps = True`` and the calls of
  :class:`deployments.engines.stepping.DecodeStepper` (``decode_step`` and its KV figures);
  without them completions run as whole passes;
- :meth:`Engine.profile_run` (one inference of exactly a shape: the profiler's unit of
  measurement), over :meth:`Engine.profile_ladder`, fitted with :attr:`Engine.fit_features`
  and cross-checked against :meth:`Engine.analytic_model`;
- :meth:`Engine.canary` (after an OOM: is the device's output still finite?).

The mixins :class:`EmbeddingRunner` and :class:`GenerationRunner` turn a kind's requests into
batched calls on token ids (``embed_ids``, ``generate_ids``, ``generate_batch_ids``). No torch
import here: the fake engine and the planner use this module on machines without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from serve_app.config import AppArgs
from serve_app.errors import InvalidRequestError
from serve_app.kinds import KINDS
from serve_app.memory.cost_model import (
    DECODER_FEATURES,
    ENCODER_FEATURES,
    TOKEN_AXES,
    CostModel,
    NoAnalyticCostModelError,
    Shape,
)
from serve_app.memory.probes import DeviceProbe
from serve_app.memory.profiler import profile_ladder
from serve_app.planning import planned_host_capacity
from serve_app.request import (
    EmbeddingOutput,
    EmbeddingParams,
    GenerationOutput,
    GenerationParams,
    InferenceRequest,
)
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


@dataclass
class OpenedEngine:
    """A loaded engine and its device: ``probe`` measures it, ``held_bytes`` is what loading
    the model took."""

    engine: Engine
    probe: DeviceProbe
    held_bytes: int


class Engine:
    """Base class of every engine (see module docstring). Subclass it, set :attr:`kinds`,
    implement :meth:`front_end`, :meth:`load` (or :meth:`open`) and each kind's runner; the
    defaults below fit a model on the replica's own CPU or GPU.

    Attributes:
        kinds: the request kinds served, e.g. ``("embed",)``.
        shape_axes: what the three slots of a :class:`Shape` mean for this engine's cost:
            the token kinds' ``("inputs", "prompt_tokens", "new_tokens")`` by default, e.g.
            ``("files", "audio_frames", "new_tokens")`` for speech. Shown with the profile
            (``python -m serve_app profile``, ``/v1/status``); see docs/engines.md.
        max_seq_tokens: (instances) the longest input the model accepts, tokens.
    """

    kinds: ClassVar[tuple[str, ...]] = ()
    shape_axes: ClassVar[tuple[str, str, str]] = TOKEN_AXES
    max_seq_tokens: int

    # --- the class: read where requests are validated and deployments planned ------------

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
    def planned_context(cls, args: AppArgs) -> tuple[int, str] | None:
        """The model's context (tokens) and where it was read, without loading the model,
        for planning and ``vramgate validate``; ``None`` (the default): unknown here."""
        return None

    @classmethod
    def open(cls, args: AppArgs) -> OpenedEngine:
        """Load the model on the replica's device and measure what it holds: the CPU's
        host memory or the replica's share of its GPU (:mod:`deployments.engines.devices`)."""
        from deployments.engines.devices import make_probe, resolve_device

        device = resolve_device(args.model.device)
        probe = make_probe(device, args)
        used_before = probe.used_bytes()
        engine = cls.load(args, device)
        return OpenedEngine(engine, probe, max(0, probe.used_bytes() - used_before))

    @classmethod
    def load(cls, args: AppArgs, device: str) -> Engine:
        """The loaded engine on ``device`` (``cpu`` or ``cuda``)."""
        raise NotImplementedError(f"{cls.__name__} has no load")

    # --- the instance: called on the replica's inference thread ---------------------------

    def run_batch(self, requests: Sequence[InferenceRequest]) -> list[Any]:
        """One forward pass over ``requests`` (one kind, one batch key): the kind's runner
        ``run_<kind>``. Returns one output per request, in order."""
        return getattr(self, f"run_{requests[0].kind}")(requests)

    def run_stream(self, request: InferenceRequest,
                   on_text: Callable[[str], bool]) -> Any:
        """Run one request whose client reads a stream: ``stream_<kind>``. ``on_text`` gets
        each new piece of text and returns ``False`` to stop (the client left)."""
        return getattr(self, f"stream_{request.kind}")(request, on_text)

    def runtime_status(self) -> dict[str, Any]:
        """What ``/v1/status`` shows per replica about how the loaded engine runs (merged
        into its start-up figures; may be empty), e.g. the HF engines' ``cpu_threads``."""
        return {}

    def analytic_model(self) -> CostModel | None:
        """The loaded model's analytic cost model, shown beside every profiled point
        (``None``: none; the profile then shows 0)."""
        return None

    @property
    def is_decoder(self) -> bool:
        """Whether the model keeps a KV cache (it serves a kind that generates)."""
        return any(KINDS[kind].generates for kind in self.kinds)

    @property
    def fit_features(self) -> tuple[str, ...]:
        """The cost model's features, by name (:data:`serve_app.memory.cost_model.FEATURES`;
        an engine may register its own with
        :func:`~serve_app.memory.cost_model.register_feature` at import of its module).
        The profiler fits at most as many as it has fitted shapes, in this order."""
        return DECODER_FEATURES if self.is_decoder else ENCODER_FEATURES

    def profile_ladder(self, largest: Shape) -> tuple[list[Shape], list[Shape]]:
        """Shapes to measure up to ``largest`` (over :attr:`shape_axes`): ``(fitted, held
        out)``; the fit's error is the largest relative error on the held-out ones. Default:
        :func:`serve_app.memory.profiler.profile_ladder`."""
        return profile_ladder(*largest)

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """One real inference of exactly this shape: by default ``batch`` requests of
        ``prompt_tokens`` ids (1s), each generating ``new_tokens`` (greedy), through the
        runner of the engine's first kind that generates (``new_tokens > 0``) or not."""
        kind = next((k for k in self.kinds if KINDS[k].generates == bool(new_tokens)),
                    self.kinds[0])
        params = GenerationParams(max_tokens=new_tokens, temperature=0.0) if new_tokens \
            else None
        ids = ((1,) * prompt_tokens,)
        request = InferenceRequest(kind, ids, Shape(1, prompt_tokens, new_tokens), params)
        self.run_batch([request] * batch)

    def canary(self) -> bool:
        """One small inference after an OOM; ``True`` when its output holds no NaN/Inf."""
        request = InferenceRequest(self.kinds[0], ((1, 2, 3),), Shape(1, 3, 0),
                                   GenerationParams(max_tokens=1, temperature=0.0))
        return all(output.finite() for output in self.run_batch([request]))

    def close(self) -> None:
        """Free what the engine holds (idempotent)."""


class EmbeddingRunner:
    """``run_embed`` from ``embed_ids``: every request's inputs in one padded pass, each
    request's rows handed back to it. Also ``embed(texts)`` for in-process use."""

    front: FrontEnd

    def embed_ids(self, input_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 ``(len(input_ids), dimensions)`` for inputs given as token ids. An engine
        whose front end applies prompts that its pooling leaves out also takes
        ``prompt_tokens`` (:class:`serve_app.request.EmbeddingParams`)."""
        raise NotImplementedError

    def run_embed(self, requests: Sequence[InferenceRequest]) -> list[EmbeddingOutput]:
        """One pass over the requests' inputs (they share a batch key, so one prompt
        length)."""
        ids = [ids for request in requests for ids in request.input_ids]
        params = requests[0].params
        prompt_tokens = params.prompt_tokens if isinstance(params, EmbeddingParams) else 0
        rows = self._embed_ids(ids, prompt_tokens)
        outputs, start = [], 0
        for request in requests:
            end = start + len(request.input_ids)
            outputs.append(EmbeddingOutput(rows[start:end], request.prompt_tokens))
            start = end
        return outputs

    def embed(self, texts: Sequence[str], input_type: str | None = None) -> np.ndarray:
        """Tokenize ``texts`` with the front end (after the prompt ``input_type`` names, or
        the model's default prompt) and embed them in one pass."""
        prompted, prompt_tokens = self.front.prompted(texts, input_type)
        return self._embed_ids(self.front.tokenize(prompted), prompt_tokens)

    def _embed_ids(self, ids: Sequence[Sequence[int]], prompt_tokens: int) -> np.ndarray:
        # Only engines whose prompts are left out of pooling know ``prompt_tokens``.
        if prompt_tokens:
            return self.embed_ids(ids, prompt_tokens=prompt_tokens)  # type: ignore[call-arg]
        return self.embed_ids(ids)


class GenerationRunner:
    """``run_generate`` and ``stream_generate`` from ``generate_ids`` (one prompt) and
    ``generate_batch_ids`` (several, sharing ``temperature`` and ``top_p``, without stop
    strings or seed; see :func:`batch_params`). Also text-level ``generate`` and
    ``generate_batch`` for in-process use."""

    front: FrontEnd

    def generate_ids(self, ids: Sequence[int], params: GenerationParams,
                     on_text: Callable[[str], bool] | None = None) -> GenerationOutput:
        """Complete the prompt ``ids``. ``on_text`` receives each new piece of text as it is
        decoded and returns ``False`` to stop early (client gone); the output then has
        ``finish_reason`` ``"cancelled"``."""
        raise NotImplementedError

    def generate_batch_ids(self, ids: Sequence[Sequence[int]],
                           params: Sequence[GenerationParams]) -> list[GenerationOutput]:
        """Complete several prompts in one padded batch, each as :meth:`generate_ids` would
        alone; ``max_tokens`` may differ (the batch generates to the largest and each row is
        cut at its own).

        Raises:
            ValueError: as :func:`batch_params`.
        """
        raise NotImplementedError

    def run_generate(self, requests: Sequence[InferenceRequest]) -> list[GenerationOutput]:
        if len(requests) == 1:  # exactly the unbatched path
            [request] = requests
            return [self.generate_ids(request.input_ids[0], request.params)]
        return self.generate_batch_ids([r.input_ids[0] for r in requests],
                                       [r.params for r in requests])

    def stream_generate(self, request: InferenceRequest,
                        on_text: Callable[[str], bool]) -> GenerationOutput:
        return self.generate_ids(request.input_ids[0], request.params, on_text)

    def generate(self, prompt: str, params: GenerationParams,
                 on_text: Callable[[str], bool] | None = None) -> GenerationOutput:
        """Tokenize ``prompt`` with the front end and complete it."""
        return self.generate_ids(self.front.tokenize([prompt])[0], params, on_text)

    def generate_batch(self, prompts: Sequence[str],
                       params: Sequence[GenerationParams]) -> list[GenerationOutput]:
        """Tokenize ``prompts`` with the front end and complete them in one batch."""
        return self.generate_batch_ids(self.front.tokenize(prompts), params)


def batch_params(params: Sequence[GenerationParams]) -> GenerationParams:
    """The parameters one batched ``generate`` runs with for rows of ``params``: their
    shared ``temperature`` and ``top_p``, and the largest ``max_tokens`` (each row is cut at
    its own afterwards: greedy decoding of a row does not depend on the other rows, so its
    first ``n`` tokens are what it would make alone with ``max_tokens = n``).

    Raises:
        ValueError: ``params`` is empty, has ``stop`` strings or a ``seed``, or mixes
            temperatures or top_p.
    """
    if not params:
        raise ValueError("generate_batch needs at least one prompt")
    if any(p.stop or p.seed is not None for p in params):
        raise ValueError("generate_batch takes no stop strings and no seed")
    if len({(p.temperature, p.top_p) for p in params}) > 1:
        raise ValueError("rows of one generate_batch must share temperature and top_p")
    return GenerationParams(max_tokens=max(p.max_tokens for p in params),
                            temperature=params[0].temperature, top_p=params[0].top_p)
