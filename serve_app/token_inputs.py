"""Inputs given as token ids, and truncation: the same rule for every front end.

OpenAI's embeddings and completions APIs accept token ids in place of text, and clients send
them (LangChain's ``OpenAIEmbeddings`` tokenizes before it sends). Ids are read as the text's
tokens: the special tokens the model's tokenizer puts around a text (``[CLS]`` ... ``[SEP]``,
a BOS token) are added where the ids do not already carry them, so the ids of
``tokenizer.encode(text)`` and of ``tokenizer.encode(text, add_special_tokens=False)`` are
both served as ``text`` would be.

Pure: no torch, Ray or FastAPI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.errors import InvalidRequestError


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens a tokenizer puts before and after every text.

    Attributes:
        prefix: ids before the text's tokens (e.g. ``[CLS]``, BOS), possibly empty.
        suffix: ids after them (e.g. ``[SEP]``, ``</s>``), possibly empty.
    """

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def _ends(self, ids: Sequence[int]) -> tuple[int, int]:
        """How many of ``ids``'s first and last ids are this prefix and suffix."""
        n = len(ids)
        head = len(self.prefix) if tuple(ids[:len(self.prefix)]) == self.prefix else 0
        tail = len(self.suffix) if (self.suffix and n - head >= len(self.suffix)
                                    and tuple(ids[n - len(self.suffix):]) == self.suffix) else 0
        return head, tail

    def around(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with the prefix and suffix added where missing."""
        head, tail = self._ends(ids)
        return [*(() if head else self.prefix), *ids, *(() if tail else self.suffix)]

    def truncated(self, ids: Sequence[int], limit: int) -> list[int]:
        """``ids`` cut to ``limit`` tokens at the end of the text, keeping the prefix and the
        suffix (as a Hugging Face tokenizer's ``truncation=True, max_length=limit`` cuts)."""
        if len(ids) <= limit:
            return list(ids)
        head, tail = self._ends(ids)
        keep = limit - head - tail
        if keep < 1:
            return list(ids[:limit])
        return [*ids[:head + keep], *ids[len(ids) - tail:]]


def token_id_inputs(inputs: Sequence[Sequence[int]], vocab_size: int,
                    special: SpecialTokens, field: str) -> list[list[int]]:
    """Ids as the model sees them (:meth:`SpecialTokens.around`), each checked against the
    vocabulary.

    Args:
        inputs: token ids per input.
        vocab_size: ids must lie in ``[0, vocab_size)``.
        special: the tokenizer's special tokens.
        field: the request field, for messages (``input``, ``prompt``).

    Raises:
        InvalidRequestError: an id outside the vocabulary (``code`` = ``field``; the message
            names the input and the position).
    """
    for i, ids in enumerate(inputs):
        for j, token in enumerate(ids):
            if not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"{field} {i}: token id {token} at position {j} is outside the model's "
                    f"vocabulary (0..{vocab_size - 1})", code=field)
    return [special.around(ids) for ids in inputs]
