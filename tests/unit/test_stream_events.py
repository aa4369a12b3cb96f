"""The items of a streamed request (:mod:`serve_app.stream_events`): they cross Ray Serve
pickled, and the ingress writes them as server-sent events in one place
(:func:`deployments.http.routes.generation.render`), byte for byte as a client reads them."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from deployments.http.model_client import _raised
from deployments.http.routes.chat import _ChatReply
from deployments.http.routes.completions import _Completion
from deployments.http.routes.generation import GenerationRoute, render
from serve_app.errors import InferenceTimeoutError, OverloadedError
from serve_app.schemas import Admitted
from serve_app.stream_events import Finished, Queued, StreamError, TextPiece

HEAD = '"id":"cmpl-1","object":"text_completion","created":17,"model":"m"'


def _piece(text: str, finish_reason: str | None) -> str:
    reason = "null" if finish_reason is None else f'"{finish_reason}"'
    return (f'data: {{{HEAD},"choices":[{{"index":0,"text":"{text}","logprobs":null,'
            f'"finish_reason":{reason}}}]}}\n\n')


class _Client:
    """A model client whose stream is ``first``, then ``rest`` (items, or lists of items as
    the replica groups them: an item alone is a list of one), then ``error`` raised."""

    def __init__(self, first, rest, error=None) -> None:
        self.first, self.rest, self.error = first, rest, error
        self.closed = False

    async def stream(self, inference):
        async def rest():
            try:
                for batch in self.rest:
                    yield batch if isinstance(batch, list) else [batch]
                if self.error is not None:
                    raise self.error
            finally:
                self.closed = True
        return self.first, rest()


async def _streamed(client: _Client, reply, include_usage: bool):
    route = SimpleNamespace(context=SimpleNamespace(client=client))
    response = await GenerationRoute._stream(route, None,
                                             SimpleNamespace(include_usage=include_usage), reply)
    return response.headers, [chunk async for chunk in response.body_iterator]


@pytest.mark.parametrize("event", [
    Queued(3, 1500), Queued(0, None), Admitted(0.25, 2), TextPiece("é\n"),
    Finished("length", 7, 4),
    StreamError(OverloadedError("full", code="queue_full", retry_after_s=2.5,
                                queue_position=1)),
])
def test_an_event_crosses_pickled_unchanged(event) -> None:
    back = pickle.loads(pickle.dumps(event))
    assert type(back) is type(event)
    if isinstance(event, StreamError):
        assert (type(back.error), back.error.code, back.error.retry_after_ms,
                back.error.queue_position) == (OverloadedError, "queue_full", 2500, 1)
    else:
        assert back == event
    with pytest.raises(AttributeError):
        event.extra = 1  # frozen


def test_a_stream_error_is_raised_again_at_the_ingress() -> None:
    error = OverloadedError("gone", code="draining")
    with pytest.raises(OverloadedError) as raised:
        _raised(StreamError(error))
    assert raised.value is error
    piece = TextPiece("a")
    assert _raised(piece) is piece


async def test_a_queued_stream_is_written_as_clients_read_it() -> None:
    client = _Client(Queued(2, 1500), [Queued(1, 700), Queued(0, None), Admitted(1.2, 2),
                                       TextPiece("Hel"), TextPiece("lo"),
                                       Finished("length", 3, 2)])
    headers, chunks = await _streamed(client, _Completion("cmpl-1", 17, "m"), True)
    assert headers["x-queue-position"] == "2" and "x-queue-wait-ms" not in headers
    assert headers["cache-control"] == "no-cache"
    assert headers["content-type"].startswith("text/event-stream")
    assert chunks == [
        ": queued position=2 eta_ms=1500\n\n", ": queued position=1 eta_ms=700\n\n",
        ": queued position=0\n\n", _piece("Hel", None), _piece("lo", None),
        _piece("", "length")  # the finish and the usage: one item, one chunk
        + f'data: {{{HEAD},"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":2,'
        '"total_tokens":5}}\n\n',
        "data: [DONE]\n\n"]
    assert client.closed


async def test_an_admitted_stream_has_no_usage_unless_asked_and_errors_in_band() -> None:
    headers, chunks = await _streamed(
        _Client(Admitted(0.0104, 0), [TextPiece("x"), Finished("stop", 5, 1)]),
        _Completion("cmpl-1", 17, "m"), False)
    assert (headers["x-queue-wait-ms"], headers["x-queue-position"]) == ("10", "0")
    assert chunks == [_piece("x", None), _piece("", "stop"), "data: [DONE]\n\n"]
    refused = OverloadedError("waited 1 s", code="queue_timeout", retry_after_s=2.5)
    _, chunks = await _streamed(_Client(Queued(0, None), [Queued(0, None)], refused),
                                _Completion("cmpl-1", 17, "m"), True)
    assert chunks == [": queued position=0\n\n", ": queued position=0\n\n",
                      'data: {"error":{"message":"waited 1 s","type":"overloaded",'
                      '"code":"queue_timeout","retry_after_ms":2500}}\n\n', "data: [DONE]\n\n"]
    _, chunks = await _streamed(
        _Client(Admitted(0.0, 0), [], InferenceTimeoutError("inference ran longer than 1 s")),
        _Completion("cmpl-1", 17, "m"), True)
    assert chunks == ['data: {"error":{"message":"inference ran longer than 1 s",'
                      '"type":"timeout","code":"inference_timeout"}}\n\n', "data: [DONE]\n\n"]


async def test_a_chat_stream_opens_with_the_role() -> None:
    _, chunks = await _streamed(_Client(Admitted(0.0, 0), [TextPiece("Hi"),
                                                           Finished("stop", 2, 1)]),
                                _ChatReply("chatcmpl-1", 17, "m"), False)
    head = '"id":"chatcmpl-1","object":"chat.completion.chunk","created":17,"model":"m"'
    assert chunks == [
        f'data: {{{head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
        '"logprobs":null,"finish_reason":null}]}\n\n',
        f'data: {{{head},"choices":[{{"index":0,"delta":{{"content":"Hi"}},"logprobs":null,'
        '"finish_reason":null}]}\n\n',
        f'data: {{{head},"choices":[{{"index":0,"delta":{{}},"logprobs":null,'
        '"finish_reason":"stop"}]}\n\n',
        "data: [DONE]\n\n"]


def test_render_refuses_what_is_not_an_event() -> None:
    with pytest.raises(TypeError):
        render({"text": "a"}, _Completion("cmpl-1", 17, "m"), False)


async def test_a_batch_of_items_is_one_chunk_of_their_events_and_an_error_item_ends_it(
        ) -> None:
    # The replica groups a stream's pieces in time (batching.stream_interval_ms): each
    # group is one chunk of the body, each piece still its own event; its StreamError item
    # (an error on the replica after the first byte) is written in-band.
    refused = OverloadedError("draining", code="draining", retry_after_s=1.0)
    _, chunks = await _streamed(
        _Client(Admitted(0.0, 0), [[TextPiece("a")], [TextPiece("b"), TextPiece("c")],
                                   [Admitted(0.0, 0)], [TextPiece("d"), StreamError(refused)]]),
        _Completion("cmpl-1", 17, "m"), False)
    assert chunks == [
        _piece("a", None), _piece("b", None) + _piece("c", None),
        _piece("d", None) + 'data: {"error":{"message":"draining","type":"overloaded",'
        '"code":"draining","retry_after_ms":1000}}\n\n', "data: [DONE]\n\n"]
