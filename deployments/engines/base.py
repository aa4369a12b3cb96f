"""The engine's runtime: what a model replica calls on a loaded model, as one of two
capabilities declared by type.

An engine is chosen by ``model.engine`` (or ``model.task``) through
:mod:`deployments.engines.registry`. Its class is an :class:`~deployments.engines.spec.EngineSpec`
(kinds, front end, planning, profile identity: read without loading weights). An instance,
made by :meth:`Engine.open` in a model replica, holds the model and is one of:

- a :class:`PassRunner`: it runs whole forward passes, ``run_batch(requests)``, one at a time
  on the replica's inference thread; the replica's batcher decides what runs together. It may
  also be a :class:`deployments.engines.stepping.DecodeStepper` (it steps a running decode
  batch that sequences join and leave between steps: continuous batching, run by
  :class:`deployments.replica.decode_loop.DecodeLoop`);
- an :class:`AsyncScheduler`: it schedules its own batches and owns its KV cache (vLLM's
  ``AsyncLLM`` is one); the replica admits each request against the byte budget, then hands
  it over with :meth:`AsyncScheduler.submit` on the replica's event loop and holds the lease
  until the request's events end, after an ``await abort(lease_id)`` when it stopped
  reading early (:mod:`deployments.replica.scheduled`).

The replica picks its path from these types (``isinstance``), never by probing attributes or
by method names built from a kind. Either way the engine offers :meth:`Engine.profile_run`
(one inference of exactly a shape: the profiler's unit of measurement) over
:meth:`Engine.profile_ladder`, fitted with :attr:`Engine.fit_features`, and
:meth:`Engine.canary` (after an OOM: is the device's output still finite?).
:mod:`deployments.engines.runners` turns a kind's requests into batched calls on token ids
for a :class:`PassRunner`. No torch import here: the fake engine and the planner use this
module on machines without torch.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Re-exported: the front end is part of the spec (engines written before the split import it
# from here).
from deployments.engines.spec import EngineSpec, FrontEnd, FrontEndDefaults  # noqa: F401
from serve_app.admission.budget import Lease, MemoryBudget
from serve_app.config import AppArgs
from serve_app.kinds import KINDS
from serve_app.memory.cost_model import DECODER_FEATURES, ENCODER_FEATURES, CostModel, Shape
from serve_app.memory.kv_pool import KVPool
from serve_app.memory.probes import DeviceProbe
from serve_app.memory.profiler import profile_ladder
from serve_app.request import GenerationOutput, GenerationParams, InferenceRequest
from serve_app.stream_events import Finished, TextPiece

ScheduledEvent = TextPiece | Finished
"""What an :class:`AsyncScheduler` yields for a request: pieces of text, then one
:class:`~serve_app.stream_events.Finished`."""


@dataclass
class OpenedEngine:
    """A loaded engine and its device: ``probe`` measures it, ``held_bytes`` is what loading
    the model took."""

    engine: Engine
    probe: DeviceProbe
    held_bytes: int


class Engine(EngineSpec, ABC):
    """Base of every engine's runtime (module docstring). Subclass :class:`PassRunner` or
    :class:`AsyncScheduler` (not this directly): set :attr:`kinds`, implement
    :meth:`front_end` and :meth:`load` (or :meth:`open`) and the capability's calls; the
    defaults below fit a model on the replica's own CPU or GPU.

    Attributes:
        max_seq_tokens: (instances) the longest input the model accepts, tokens.
    """

    max_seq_tokens: int


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


    def runtime_status(self) -> dict[str, Any]:
        """What ``/v1/status`` shows per replica about how the loaded engine runs (merged
        into its start-up figures; may be empty), e.g. the HF engines' ``cpu_threads``."""
        return {}

    def kv_pool(self) -> KVPool | None:
        """The KV cache the engine allocated and pages itself, when it does (vLLM): the
        replica's budget is then that pool and requests are priced in its blocks
        (:mod:`serve_app.memory.kv_pool`), with no profile. ``None`` (the default): the
        replica profiles the engine and budgets its device."""
        return None

    def dead_reason(self) -> str | None:
        """Why the engine can serve nothing more (its scheduler died), or ``None`` (the
        default). The replica then answers 503 ``draining`` and fails its health check, so
        Ray Serve replaces it."""
        return None

    def kv_cache_status(self) -> dict[str, Any] | None:
        """The engine's own figures for ``/v1/status``'s ``kv_cache`` (sequences running and
        waiting, blocks in use, preemptions, the block size), or ``None`` (the default)."""
        return None

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
        """One real inference of exactly this shape (the capability gives the default)."""
        raise NotImplementedError(f"{type(self).__name__} is neither a PassRunner nor an "
                                  "AsyncScheduler")

    def canary(self) -> bool:
        """One small inference after an OOM; ``True`` when its output holds no NaN/Inf."""
        raise NotImplementedError(f"{type(self).__name__} is neither a PassRunner nor an "
                                  "AsyncScheduler")

    def close(self) -> None:
        """Free what the engine holds (idempotent)."""


def _profile_request(kinds: Sequence[str], prompt_tokens: int,
                     new_tokens: int) -> InferenceRequest:
    """A request of ``prompt_tokens`` ids (1s), generating ``new_tokens`` greedily, of the
    first of ``kinds`` that generates (``new_tokens > 0``) or not."""
    kind = next((k for k in kinds if KINDS[k].generates == bool(new_tokens)), kinds[0])
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0) if new_tokens else None
    return InferenceRequest(kind, ((1,) * prompt_tokens,), Shape(1, prompt_tokens, new_tokens),
                            params)


class PassRunner(Engine):
    """Runs whole forward passes, one at a time, on the replica's inference thread (never
    concurrently). The replica's batcher forms the passes; a generating engine that is also a
    :class:`~deployments.engines.stepping.DecodeStepper` runs completions on continuous
    batching instead."""

    @abstractmethod
    def run_batch(self, requests: Sequence[InferenceRequest]) -> list[Any]:
        """One forward pass over ``requests`` (one kind, one batch key: ``[one]`` when it
        runs alone). Returns one output per request, in order
        (:class:`serve_app.request.EmbeddingOutput`, ``GenerationOutput``, ...)."""

    def run_stream(self, request: InferenceRequest,
                   on_text: Callable[[str], bool]) -> Any:
        """Run one request whose client reads a stream (kinds that stream: ``generate``).
        ``on_text`` gets each new piece of text and returns ``False`` to stop (the client
        left).

        Raises:
            NotImplementedError: the engine streams no kind (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """One real inference of exactly this shape: by default ``batch`` requests of
        ``prompt_tokens`` ids (1s), each generating ``new_tokens`` (greedy), in one pass."""
        self.run_batch([_profile_request(self.kinds, prompt_tokens, new_tokens)] * batch)

    def canary(self) -> bool:
        """One small inference after an OOM; ``True`` when its output holds no NaN/Inf."""
        request = InferenceRequest(self.kinds[0], ((1, 2, 3),), Shape(1, 3, 0),
                                   GenerationParams(max_tokens=1, temperature=0.0))
        return all(output.finite() for output in self.run_batch([request]))


class AsyncScheduler(Engine):
    """Schedules its own batches and owns its KV cache (vLLM's ``AsyncLLM`` is the model):
    the replica admits each request against the byte budget, then :meth:`submit` s it on the
    replica's event loop, with no inference thread and no batcher of ours. Serves kinds that
    generate (its events are text).

    The lease handed to :meth:`submit` is held until the request's events end (finished,
    failed, aborted or the client gone): the engine may use ``lease.nbytes`` (the request's
    priced bytes) to bound what it gives the request."""

    @abstractmethod
    def submit(self, request: InferenceRequest, lease: Lease) -> AsyncIterator[ScheduledEvent]:
        """Start ``request``; its :data:`ScheduledEvent` s as they come: text pieces, then one
        :class:`~serve_app.stream_events.Finished` (the finish reason and token counts).
        Called and iterated on the replica's event loop; closing the iterator early is
        followed by :meth:`abort`.

        Raises:
            torch.OutOfMemoryError, RuntimeError: from the device, while iterating.
        """

    @abstractmethod
    async def abort(self, lease_id: int) -> None:
        """Stop the request submitted with the lease ``lease_id`` and free what it holds
        (the client left, or it ran past ``admission.inference_timeout_s``); the lease goes
        back once this returns. Idempotent: a request that already finished is no error.
        Async, as vLLM's ``AsyncLLM.abort`` is."""

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """``batch`` requests of exactly this shape submitted together, on an event loop of
        this (profiling) thread, to their ends (a shape of no new tokens runs as one new
        token: the prefill and the first token). An engine bound to the replica's event
        loop overrides it."""
        request = _profile_request(self.kinds, prompt_tokens, max(1, new_tokens))
        asyncio.run(self._run_together([request] * batch))

    def canary(self) -> bool:
        """One small completion after an OOM, as :meth:`profile_run` runs it; ``True`` when
        it finished."""
        outputs = asyncio.run(self._run_together([_profile_request(self.kinds, 3, 1)]))
        return all(output.finite() for output in outputs)

    async def _run_together(self, requests: Sequence[InferenceRequest],
                            ) -> list[GenerationOutput]:
        budget = MemoryBudget(1 << 62)
        return list(await asyncio.gather(*(
            collect_output(self.submit(request, budget.try_reserve(0)), request)
            for request in requests)))


async def collect_output(events: AsyncIterator[ScheduledEvent],
                         request: InferenceRequest) -> GenerationOutput:
    """The whole completion of ``request`` from an :class:`AsyncScheduler`'s ``events``, read
    to their end (so that the engine's iterator finishes, not suspended at its last event).

    Raises:
        RuntimeError: the events ended without :class:`~serve_app.stream_events.Finished`.
    """
    text: list[str] = []
    finished: Finished | None = None
    async for event in events:
        if isinstance(event, Finished):
            finished = event
        else:
            text.append(event.text)
    if finished is None:
        raise RuntimeError(f"the engine's events for a {request.kind} request ended "
                           "unfinished")
    return GenerationOutput("".join(text), finished.finish_reason, finished.prompt_tokens,
                            finished.completion_tokens)
