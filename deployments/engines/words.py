"""The fake engine's language: a whitespace tokenizer and a vocabulary of words.

Pure (no torch): the ingress tokenizes with :class:`WordFrontEnd` for the fake engine, and the
engine makes text from :data:`VOCAB` with :func:`decode_words`.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterator, Sequence

from deployments.engines.spec import FrontEndDefaults
from serve_app.request import GenerationParams
from serve_app.token_inputs import SpecialTokens

SPECIAL_TOKENS = 2  # like [CLS] ... [SEP] or <s> ... </s>
BOS_ID, EOS_ID = 1, 2
# Word ids lie above the special ids, below 2**31.
_FIRST_WORD_ID, _WORD_IDS = 3, (1 << 31) - 3
# The fake vocabulary: generated text is these words, one token each, space-separated.
VOCAB = tuple(
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber azure "
    "bronze cedar coral ember fern flint frost garnet hazel indigo ivory jade jasper lemon "
    "maple marble mint moss ochre olive onyx pearl pine quartz rust sable sage slate steel "
    "teal topaz umber violet willow".split())


def digest(*parts: object) -> int:
    """A 64-bit hash stable across processes (Python's ``hash`` of ``str`` is salted)."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class WordFrontEnd(FrontEndDefaults):
    """Whitespace-separated words, one token each (a stable hash of the word: CRC-32, cheap
    on the ingress's hot path), between a begin and an end token: ``len(text.split()) + 2``
    tokens per text. Thread-safe (pure).

    Args:
        max_seq_tokens: the fake model's context, tokens.
    """

    vocab_size = 1 << 31
    special = SpecialTokens((BOS_ID,), (EOS_ID,))

    def __init__(self, max_seq_tokens: int) -> None:
        self.max_seq_tokens = max_seq_tokens

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The conversation as ``role: content`` lines, then ``assistant:``, tokenized."""
        lines = [f"{m['role']}: {m['content']}" for m in messages] + ["assistant:"]
        return self.tokenize(["\n".join(lines)])[0]

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [[BOS_ID, *(_FIRST_WORD_ID + zlib.crc32(w.encode()) % _WORD_IDS
                           for w in text.split()), EOS_ID] for text in texts]


def decode_words(words: Iterator[str], params: GenerationParams,
                 on_text: Callable[[str], bool] | None,
                 step: Callable[[], None]) -> tuple[str, str, int]:
    """Append words until ``max_tokens``, a stop string, or ``on_text`` returning ``False``.

    Returns ``(text, finish_reason, tokens made)``. What ``on_text`` received, joined, is a
    prefix of ``text`` (all of it unless cancelled).
    """
    hold_back = max((len(s) for s in params.stop if s), default=1) - 1
    text, sent = "", 0
    for made in range(1, params.max_tokens + 1):
        step()
        text += (" " if text else "") + next(words)
        cut = min((i for i in (text.find(s) for s in params.stop if s) if i >= 0),
                  default=-1)
        if cut >= 0:
            text = text[:cut]
            if on_text is not None and cut > sent:
                on_text(text[sent:])
            return text, "stop", made
        safe = len(text) if made == params.max_tokens else len(text) - hold_back
        if on_text is not None and safe > sent:
            if not on_text(text[sent:safe]):
                return text, "cancelled", made
            sent = safe
    return text, "length", params.max_tokens
