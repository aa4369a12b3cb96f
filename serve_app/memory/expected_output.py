"""How many tokens completions really generate, per ``max_tokens`` range: what
``admission.kv_lease: expected`` leases instead of ``max_tokens``.

Clients set ``max_tokens`` as a ceiling and most completions stop well before it (a stop
string, the end-of-sequence token). Leasing the ceiling (``guaranteed``, TensorRT-LLM's
``GUARANTEED_NO_EVICT``) never preempts but holds blocks that are never written; leasing a
high percentile of the lengths observed (``expected``) admits more at once and lets the engine
preempt the rare request that outgrows its lease (vLLM recomputes it: Kwon et al., SOSP 2023,
sec. 4.5). vLLM's own scheduler leases nothing ahead: it allocates blocks as tokens come and
preempts under pressure.

Observed lengths are kept per range of ``max_tokens``, ranges being powers of two
(``(64, 128]`` and so on), the last :data:`WINDOW` completions of each. A range with fewer than
:data:`MIN_SAMPLES` completions expects ``max_tokens`` (nothing is known yet: start from the
guarantee); then the ``quantile``-th of its window by nearest rank, never more than the
request's own ``max_tokens``. Pure: no Ray, torch or vLLM; not thread-safe (the replica's
event loop).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from serve_app.memory.cost_model import CorrectedCostModel, CostModel, FittedCostModel

WINDOW = 256
"""Completions remembered per ``max_tokens`` range: enough for a 0.95 quantile to rest on 13
of them, few enough to follow a change of traffic within minutes."""
MIN_SAMPLES = 32
"""Completions a range needs before it expects less than ``max_tokens``."""


def max_tokens_range(max_tokens: int) -> int:
    """The range ``max_tokens`` falls in, named by its upper end: the next power of two
    (``100 -> 128``, ``128 -> 128``)."""
    return 1 << max(0, max_tokens - 1).bit_length()


class ExpectedOutput:
    """Expected completion tokens per ``max_tokens`` range (module docstring).

    Args:
        quantile: the share of observed completions the expectation covers, in (0, 1]
            (``admission.kv_lease_quantile``).

    Raises:
        ValueError: ``quantile`` outside (0, 1].
    """

    def __init__(self, quantile: float = 0.95) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self._windows: dict[int, deque[int]] = {}
        self._expected: dict[int, int] = {}

    def tokens(self, max_tokens: int) -> int:
        """The new tokens a request of ``max_tokens`` is leased: its range's expectation,
        at most ``max_tokens`` (``max_tokens`` while the range has too few completions)."""
        if max_tokens <= 0:
            return max_tokens
        return min(max_tokens, self._expected.get(max_tokens_range(max_tokens), max_tokens))

    def observe(self, max_tokens: int, completion_tokens: int) -> None:
        """A completion of ``max_tokens`` that generated ``completion_tokens`` and finished
        (finished only: an aborted one says nothing of how long it would have run)."""
        key = max_tokens_range(max_tokens)
        window = self._windows.setdefault(key, deque(maxlen=WINDOW))
        window.append(min(completion_tokens, max_tokens))
        if len(window) >= MIN_SAMPLES:
            ordered = sorted(window)
            self._expected[key] = ordered[math.ceil(self.quantile * len(ordered)) - 1]

    def table(self) -> dict[int, int]:
        """The expectations in force, by range (published with the cost model, so that the
        ingress and the router price as the replica does)."""
        return dict(self._expected)

    @classmethod
    def from_table(cls, table: Mapping[int | str, int], quantile: float = 0.95,
                   ) -> ExpectedOutput:
        """The expectations :meth:`table` gave (a published copy: it observes nothing).

        Raises:
            ValueError: a key or value that is not a whole number.
        """
        expected = cls(quantile)
        expected._expected = {int(key): int(value) for key, value in table.items()}
        return expected


EXPECTED_KEY = "expected_new_tokens"
"""Where a published cost model carries its expectations
(:meth:`ExpectedOutputCostModel.to_dict`)."""


class ExpectedOutputCostModel:
    """``base``'s prices with a request's ``max_tokens`` replaced by what ``expected``
    expects it to generate (``admission.kv_lease: expected``).

    Args:
        base: the KV pool's blocks model (:meth:`serve_app.memory.kv_pool.KVPool.cost_model`).
        expected: the replica's own expectations (it observes), or a published copy.
    """

    def __init__(self, base: FittedCostModel, expected: ExpectedOutput) -> None:
        self.base, self.expected = base, expected

    def request_bytes(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> int:
        return self.base.request_bytes(batch, prompt_tokens, self.expected.tokens(new_tokens))

    def to_dict(self) -> dict[str, Any]:
        """``base``'s :meth:`~FittedCostModel.to_dict` and the expectations by range (JSON
        keys are text)."""
        table = {str(key): value for key, value in sorted(self.expected.table().items())}
        return {**self.base.to_dict(), EXPECTED_KEY: table}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ExpectedOutputCostModel:
        """The model :meth:`to_dict` wrote.

        Raises:
            KeyError, ValueError: ``raw`` is not one.
        """
        return cls(FittedCostModel.from_dict(raw), ExpectedOutput.from_table(raw[EXPECTED_KEY]))


def published_model(raw: dict[str, Any]) -> CorrectedCostModel:
    """The cost model a replica published (:meth:`CorrectedCostModel.published`), with its
    expectations when it leases expected output: it prices as that replica does.

    Raises:
        KeyError, ValueError: ``raw`` is not a published model.
    """
    base: CostModel = ExpectedOutputCostModel.from_dict(raw) if EXPECTED_KEY in raw \
        else FittedCostModel.from_dict(raw)
    return CorrectedCostModel.from_published(raw, base)
