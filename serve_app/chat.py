"""``POST /v1/chat/completions`` request and response bodies (OpenAI-compatible subset).

Messages are rendered into one prompt by the model's chat template at the ingress (the front
end's ``chat_ids``) and completed like any prompt. Fields OpenAI defines that are not served
(tools, response formats, log-probabilities, penalties, several choices) are refused with a
400 naming the field rather than ignored; a neutral value (``null``, ``false``, ``0``, ``n: 1``)
is accepted as the default it is.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from serve_app.schemas import CompletionUsage, GenerationFields


class TextPart(BaseModel):
    """One part of a message's ``content`` given as a list (only text parts are served)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def rendered(self) -> dict[str, str]:
        """``{"role", "content"}`` as chat templates read it (text parts joined)."""
        text = self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions`` body. ``max_completion_tokens`` (or the older
    ``max_tokens``) is bounded by ``limits.max_tokens``, and is that limit when neither is
    given (a chat reply is leased the KV cache it may grow to)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    # Accepted only at their neutral values (refused naming the field otherwise).
    logprobs: StrictBool | None = Field(False, description="Not supported: false only.")
    presence_penalty: StrictFloat | None = Field(0.0, description="Not supported: 0 only.")
    frequency_penalty: StrictFloat | None = Field(0.0, description="Not supported: 0 only.")

    @field_validator("logprobs", "presence_penalty", "frequency_penalty")
    @classmethod
    def _not_supported(cls, value: object, info: ValidationInfo) -> object:
        if value:
            raise ValueError(f"{info.field_name} is not supported (only its default)")
        return value

    def new_tokens(self, default: int) -> int:
        """Tokens the reply may have: ``max_completion_tokens``, else ``max_tokens``, else
        ``default``."""
        return self.max_completion_tokens or self.max_tokens or default

    def rendered_messages(self) -> list[dict[str, str]]:
        return [message.rendered() for message in self.messages]


# --- Response bodies, as declared in the OpenAPI schema (the ingress renders them itself) -----


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Literal["stop", "length", "cancelled"]


class ChatCompletionResponse(BaseModel):
    """``POST /v1/chat/completions`` body (``stream: false``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage

