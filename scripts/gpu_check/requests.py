"""Requests for the check, built as the ingress builds them
(:func:`serve_app.kinds.build_request`: validated against the limits and priced), from random
token ids of the model's vocabulary; and what the replica answers for each."""

from __future__ import annotations

import random
from typing import Any

from serve_app.config import AppArgs
from serve_app.errors import ServeAppError
from serve_app.kinds import KINDS, build_request
from serve_app.memory.cost_model import Shape
from serve_app.request import GenerationParams, InferenceRequest
from serve_app.stream_events import Admitted

FIRST_ID = 4  # clear of the special tokens at the start of every vocabulary built here


def largest(kind: str, engine: Any, args: AppArgs) -> Shape:
    """The largest request of ``kind`` the limits allow on this engine."""
    return KINDS[kind].largest_shape(args.limits, engine.max_seq_tokens)


def make_request(kind: str, shape: Shape, engine: Any, args: AppArgs, rng: random.Random,
                 stream: bool = False) -> InferenceRequest:
    """A request of ``kind`` with ``shape.inputs`` inputs of ``shape.prompt_tokens`` random
    ids each (greedy completions of ``shape.new_tokens`` tokens)."""
    vocab = engine.front.vocab_size
    ids = [[rng.randrange(FIRST_ID, vocab) for _ in range(shape.prompt_tokens)]
           for _ in range(shape.inputs)]
    params = (GenerationParams(max_tokens=shape.new_tokens, temperature=0.0)
              if KINDS[kind].generates else None)
    return build_request(kind, ids, params, stream, args, engine.max_seq_tokens)


def mixed_burst(kinds: tuple[str, ...], count: int, engine: Any, args: AppArgs,
                rng: random.Random) -> list[InferenceRequest]:
    """``count`` requests of mixed sizes, each dimension uniform up to the limits; a third
    of the completions streamed."""
    requests = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        top = largest(kind, engine, args)
        shape = Shape(rng.randint(1, top.inputs), rng.randint(2, top.prompt_tokens),
                      rng.randint(1, top.new_tokens) if top.new_tokens else 0)
        stream = KINDS[kind].generates and rng.random() < 1 / 3
        requests.append(make_request(kind, shape, engine, args, rng, stream))
    return requests


async def answer(lifecycle: Any, request: InferenceRequest) -> tuple[str, bool]:
    """``("ok", queued)`` when the replica answered ``request`` (``queued``: it waited behind
    others for its lease), else ``("<status> <code>", False)`` for the refusal or failure a
    client would get (e.g. ``"503 oom"``), or ``("error <type>: <message>", False)``."""
    try:
        if not request.stream:
            result = await lifecycle.infer(request)
            return "ok", result.admitted.queue_position > 0
        queued = False
        async for item in lifecycle.infer_stream(request):
            if isinstance(item, Admitted):
                queued = item.queue_position > 0
        return "ok", queued
    except ServeAppError as exc:
        return f"{exc.status_code} {exc.code}", False
    except Exception as exc:  # a bug: shown in the table (500 on a real replica), not raised
        return f"error {type(exc).__name__}: {str(exc)[:60]}", False
