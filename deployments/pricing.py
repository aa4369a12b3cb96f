"""The ingress's estimate of a request's bytes, for the budget-aware router.

The model replica stays the authority (it counts tokens and prices again before admitting);
the ingress prices only to tell the router (:mod:`deployments.router`) how large a request
is. It counts tokens with the model's own tokenizer (loaded here without the weights) and
prices with the cost model the replicas measured and publish to the registry, times their
OOM correction (:class:`serve_app.memory.cost_model.CorrectedCostModel`), taking the largest
price over replicas (they profiled separately).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

from deployments.engines.fake import SPECIAL_TOKENS
from serve_app.config import AppArgs
from serve_app.memory.cost_model import FittedCostModel


class IngressPricer:
    """Counts tokens and prices requests at the ingress.

    Args:
        args: the app's validated args (``model.task`` and ``model.path`` pick the tokenizer).

    Raises:
        OSError: the model directory has no tokenizer files.
    """

    def __init__(self, args: AppArgs) -> None:
        self._tokenizer = None
        self._lock = threading.Lock()  # a fast tokenizer is not safe to share unguarded
        if args.model.task != "fake":
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(args.model.resolved_path()))

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text, special tokens included, as the replica will count them.
        Blocking (call it off the event loop)."""
        if self._tokenizer is None:  # the fake engine: words + 2 special tokens
            return [len(text.split()) + SPECIAL_TOKENS for text in texts]
        with self._lock:
            encoded = self._tokenizer(list(texts), add_special_tokens=True, truncation=False,
                                      verbose=False)
        return [len(ids) for ids in encoded["input_ids"]]

    @staticmethod
    def price(statuses: Sequence[dict[str, Any]], batch: int, prompt_tokens: int,
              new_tokens: int = 0) -> int | None:
        """Bytes of a request of this shape: the largest price over the replicas' published
        cost models (``None`` before any replica has published one)."""
        prices = []
        for status in statuses:
            raw = status.get("profile", {}).get("cost_model")
            if not raw or raw.get("kind") != "fitted":
                continue
            base = FittedCostModel.from_dict(raw).request_bytes(batch, prompt_tokens,
                                                                new_tokens)
            prices.append(math.ceil(base * float(status.get("cost_correction_factor", 1.0))))
        return max(prices) if prices else None
