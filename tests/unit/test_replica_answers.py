"""What a model replica hands Ray Serve (``ModelServer.infer``/``infer_stream`` call
:meth:`deployments.replica.parts.Replica.answer` / ``answer_stream``), on real parts without Ray.

A typed error (a refusal: 400, 503) is returned as a value, not raised, and is one INFO line
of the request log: an exception escaping a Ray Serve method is logged ``ERROR ... Request
failed.`` with its traceback, and a refusal is the product working. A stream whose consumer
leaves half-way (Ray cancels it, or closes it at an item) is counted once as
``cancelled``/``client_gone``, with one INFO line.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest

from serve_app.admission.fair import DEFAULT_TENANT
from serve_app.errors import RequestTooLargeError
from serve_app.request import GenerationParams, InferenceRequest
from serve_app.schemas import InferenceResult
from serve_app.stream_events import StreamError, TextPiece
from tests.unit.test_batcher import LABELS, PER_TOKEN_BYTES, Replica, words

GONE = {**LABELS, "outcome": "cancelled", "reason": "client_gone"}


def _lines(caplog: pytest.LogCaptureFixture, start: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "ray.serve" and r.getMessage().startswith(start)]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ray.serve" and r.levelno >= logging.WARNING]


def _exact_bytes(request: InferenceRequest) -> int:
    """The fake engine's exact price of ``request``'s shape (no bytes per request)."""
    shape = request.shape
    return shape.inputs * (shape.prompt_tokens + shape.new_tokens) * PER_TOKEN_BYTES


async def test_a_refusal_is_returned_as_its_typed_error_and_logged_at_info(caplog) -> None:
    replica = Replica(budget_bytes=20 * PER_TOKEN_BYTES, max_batch_size=4)
    caplog.set_level(logging.INFO, logger="ray.serve")
    try:
        fits = await replica.parts.answer(replica.request("embed", [words(3, 0)]))
        too_large = replace(replica.request("embed", [words(30, 1)]),  # 32 tokens padded:
                            tenant="team-a")  # 32 000 bytes
        refused = await replica.parts.answer(too_large)
        streamed_request = replica.request("generate", [words(30, 2)],
                                           GenerationParams(max_tokens=8), True)
        streamed = [item async for item in replica.parts.answer_stream(streamed_request)]
    finally:
        replica.close()
    assert isinstance(fits, InferenceResult)
    assert isinstance(refused, RequestTooLargeError)
    assert (refused.status_code, refused.code) == (400, "request_too_large")
    assert refused.message.startswith(
        "the request needs an estimated 32000 bytes of device memory, more than the "
        "replica's whole budget of 20000 bytes")
    [last] = streamed  # refused before its first item: only the error
    assert isinstance(last, StreamError) and isinstance(last.error, RequestTooLargeError)
    lines = _lines(caplog, "request refused:")
    assert [r.levelno for r in lines] == [logging.INFO, logging.INFO]
    assert [(r.code, r.status, r.estimated_bytes, r.tenant) for r in lines] == [
        ("request_too_large", 400, _exact_bytes(too_large), "team-a"),
        ("request_too_large", 400, _exact_bytes(streamed_request), DEFAULT_TENANT)]
    assert _warnings(caplog) == []


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("leaves", ["closes the stream", "is cancelled"])
async def test_a_consumer_that_leaves_mid_stream_is_counted_gone_once(
        caplog, continuous: bool, leaves: str) -> None:
    replica = Replica(budget_bytes=64 * 64 * PER_TOKEN_BYTES, max_batch_size=8,
                      latency_per_token_s=0.002, continuous=continuous)
    caplog.set_level(logging.INFO, logger="ray.serve")
    request = replica.request("generate", [words(4, 3)],
                              GenerationParams(max_tokens=50, temperature=0.0), True)
    stream = replica.parts.answer_stream(request)
    two_pieces = asyncio.Event()

    async def consume() -> None:
        pieces = 0
        async for item in stream:
            pieces += isinstance(item, TextPiece)
            if pieces == 2:
                two_pieces.set()
                if leaves == "closes the stream":
                    return

    try:
        consumer = asyncio.create_task(consume())
        await two_pieces.wait()
        if leaves == "is cancelled":  # as Ray Serve cancels it when the ingress lets go
            consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await stream.aclose()
    finally:
        replica.close()
    assert replica.metrics.registry.get_sample_value(
        "vramgate_admission_decisions_total", GONE) == 1.0
    [line] = _lines(caplog, "request client gone:")
    assert (line.levelno, line.estimated_bytes) == (logging.INFO, _exact_bytes(request))
    assert _warnings(caplog) == []
