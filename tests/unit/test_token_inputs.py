"""Token-id inputs and truncation: ids are read as the text's tokens (the tokenizer's special
tokens added where missing), checked against the vocabulary, and cut keeping the special
tokens, through the same request factory the ingress uses."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deployments.engines.embeddings import EmbeddingEngine
from deployments.http.request_factory import RequestFactory
from serve_app.config import parse_args
from serve_app.errors import InvalidRequestError
from serve_app.kinds import KINDS
from serve_app.token_inputs import SpecialTokens

pytestmark = pytest.mark.unit

CLS, SEP = 101, 102  # the packaged MiniLM's [CLS] and [SEP]
TEXT = "LangChain sends token ids by default."


@pytest.fixture(scope="module")
def front():
    return EmbeddingEngine.front_end(parse_args({}))


def _build(front, inputs, field="input", **kwargs):
    args = parse_args({"limits": {"max_input_tokens": 12}})
    return asyncio.run(RequestFactory(args, front).build(KINDS["embed"], inputs,
                                                         field=field, **kwargs))


def test_the_packaged_tokenizer_puts_cls_and_sep_around_a_text(front) -> None:
    assert front.special == SpecialTokens((CLS,), (SEP,))
    assert front.vocab_size == 30522


def test_ids_with_or_without_special_tokens_are_the_texts_tokens(front) -> None:
    [with_special] = front.tokenize([TEXT])
    plain = with_special[1:-1]
    for ids in (with_special, plain, [CLS, *plain], [*plain, SEP]):
        assert _build(front, [ids]).input_ids == (tuple(with_special),)


def test_an_id_outside_the_vocabulary_is_a_400_naming_the_input(front) -> None:
    with pytest.raises(InvalidRequestError, match="input 1: token id 30522 at position 2") \
            as refused:
        _build(front, [[7592], [7592, 2088, 30522]])
    assert refused.value.code == "input"


def test_an_over_long_input_is_refused_unless_truncated(front) -> None:
    [ids] = front.tokenize([TEXT * 3])
    with pytest.raises(InvalidRequestError, match="input\\[0\\] has"):
        _build(front, [TEXT * 3])
    request = _build(front, [TEXT * 3, "short"], truncate=True)
    assert request.input_ids[0] == (*ids[:11], SEP)
    # ... as the tokenizer itself truncates:
    assert list(request.input_ids[0]) == front.tokenizer(TEXT * 3, truncation=True,
                                                         max_length=12)["input_ids"]
    assert request.input_ids[1] == tuple(front.tokenize(["short"])[0])
    assert request.shape.prompt_tokens == 12  # priced at the truncated length
    assert _build(front, [ids], truncate=True).input_ids == request.input_ids[:1]


def test_input_type_applies_to_text_only(front) -> None:
    with pytest.raises(InvalidRequestError, match="text inputs") as refused:
        _build(front, [[7592]], input_type="query")
    assert refused.value.code == "input_type"
    with pytest.raises(InvalidRequestError, match="not a prompt") as refused:
        _build(front, ["x"], input_type="nope")
    # The packaged model's prompts are sentence-transformers' empty defaults.
    assert _build(front, ["x"], input_type="query").input_ids == _build(front, ["x"]).input_ids


special_tokens = st.builds(SpecialTokens, st.lists(st.integers(0, 3), max_size=2).map(tuple),
                           st.lists(st.integers(0, 3), max_size=2).map(tuple))


@given(special_tokens, st.lists(st.integers(4, 9), min_size=1, max_size=20),
       st.integers(1, 24))
def test_truncation_keeps_the_special_tokens_and_the_texts_start(special, body, limit) -> None:
    ids = special.around(body)
    assert ids == [*special.prefix, *body, *special.suffix]
    assert special.around(ids) == ids  # already complete: unchanged
    cut = special.truncated(ids, limit)
    assert len(cut) == min(len(ids), limit)
    if len(ids) > limit >= len(special.prefix) + len(special.suffix) + 1:
        assert cut == [*special.prefix, *body[:limit - len(ids) + len(body)],
                       *special.suffix]
