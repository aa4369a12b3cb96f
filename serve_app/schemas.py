"""Request and result types of the HTTP API (CONTRACT.md), validated by pydantic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` body (OpenAI-compatible; unknown fields are refused like
    OpenAI does). Token-id arrays are not accepted as ``input``."""

    model_config = ConfigDict(extra="forbid")

    input: StrictStr | list[StrictStr]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: StrictStr | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _strings(cls, value: object) -> object:
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError("input must be a string or a list of strings")
        if not texts:
            raise ValueError("input must contain at least one string")
        if any(not t for t in texts):
            raise ValueError("input strings must not be empty")
        return value

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


@dataclass(frozen=True)
class EmbeddingResult:
    """What a model replica returns for one embeddings request.

    Attributes:
        embeddings: float32, shape ``(n_inputs, dimensions)``, rows of unit L2 norm.
        prompt_tokens: tokens over all inputs, special tokens included.
        queue_wait_s: seconds the request waited for admission.
        queue_position: waiters ahead of it when queued (0: admitted at once).
        replica_id: the replica that served it.
    """

    embeddings: np.ndarray
    prompt_tokens: int
    queue_wait_s: float
    queue_position: int
    replica_id: str
