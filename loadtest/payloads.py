"""Seeded request bodies for the load test. Pure: no locust, no HTTP.

Texts are space-separated words from :data:`WORDS`, each of which is one token for both
tokenizers the service uses: the fake engine counts whitespace-separated words (+2 special
tokens), and all-MiniLM-L6-v2's WordPiece vocabulary holds every word of :data:`WORDS` as a
single token (checked with its tokenizer when this list was made). So a text of ``n`` words is
``n + 2`` tokens on either engine, and request sizes are known exactly.

Sizes (tokens per input include the 2 special tokens):

============== ======================================= =======================================
kind           body                                    tokens
============== ======================================= =======================================
short          1 input of 6-14 words                   8-16
long           4 inputs of 200-220 words               202-222 each (priced padded to 208-224)
mixed          1-8 inputs of 4-220 words each          heterogeneous within the request
completion     a 8-24 word prompt, ``max_tokens`` 32-64 10-26 prompt + 32-64 new
chat           a system message of 4-12 words and a    fake engine: 17-41 prompt + 8-256 new
               user message of 8-24, ``max_tokens``
               8-256, about half ``stream: true``
============== ======================================= =======================================

A chat prompt is what the model's chat template renders: the fake engine's is one ``role:
content`` line per message and a closing ``assistant:``, so ``s`` system and ``u`` user words
are ``s + u + 3`` words, ``s + u + 5`` tokens. All fit the load-test configs' limits
(``limits.max_inputs: 8``, ``max_input_tokens: 256``, ``max_tokens: 256``) and the fake
engine's context (``fake.max_seq_tokens``, 2048 by default).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from serve_app.request import GenerationParams

if TYPE_CHECKING:
    from deployments.engines.spec import FrontEnd

WORDS = tuple("""the a man woman child dog cat house car tree river city road water light day
night time year people world life hand part place case week company system program question
work government number point home room mother area money story fact month lot right study book
eye job word business issue side kind head service friend father power hour game line end
member law community name president team minute idea kid body information back parent face
others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education red blue green small large old new good
great long little high young early open public bad able sure free full hot cold happy simple
runs walks reads writes eats sees holds finds takes makes gives""".split())

SHORT_WORDS = (6, 14)
LONG_INPUTS = 4
LONG_WORDS = (200, 220)
MIXED_INPUTS = (1, 8)
MIXED_WORDS = (4, 220)
PROMPT_WORDS = (8, 24)
COMPLETION_MAX_TOKENS = (32, 64)
SYSTEM_WORDS = (4, 12)
USER_WORDS = (8, 24)
CHAT_MAX_TOKENS = (8, 256)  # issue 15: a chat mix "with mixed max_tokens (8-256)"
STREAM_PROBABILITY = 0.5  # share of chat bodies with ``stream: true``


def text(rng: random.Random, min_words: int, max_words: int) -> str:
    """A text of ``min_words..max_words`` words (inclusive) drawn from :data:`WORDS`."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))


def short_body(rng: random.Random) -> dict[str, Any]:
    """``/v1/embeddings``: one short sentence."""
    return {"input": text(rng, *SHORT_WORDS)}


def long_body(rng: random.Random) -> dict[str, Any]:
    """``/v1/embeddings``: :data:`LONG_INPUTS` long texts (the request the gate must pace)."""
    return {"input": [text(rng, *LONG_WORDS) for _ in range(LONG_INPUTS)]}


def mixed_body(rng: random.Random) -> dict[str, Any]:
    """``/v1/embeddings``: 1-8 inputs whose lengths differ (padded to the longest)."""
    return {"input": [text(rng, *MIXED_WORDS) for _ in range(rng.randint(*MIXED_INPUTS))]}


def completion_body(rng: random.Random) -> dict[str, Any]:
    """``/v1/completions``: a greedy completion of a short prompt."""
    return {"prompt": text(rng, *PROMPT_WORDS),
            "max_tokens": rng.randint(*COMPLETION_MAX_TOKENS), "temperature": 0}


def chat_body(rng: random.Random) -> dict[str, Any]:
    """``/v1/chat/completions``: a greedy reply to a system and a user message, streamed
    with :data:`STREAM_PROBABILITY`."""
    return {"messages": [{"role": "system", "content": text(rng, *SYSTEM_WORDS)},
                         {"role": "user", "content": text(rng, *USER_WORDS)}],
            "max_tokens": rng.randint(*CHAT_MAX_TOKENS), "temperature": 0,
            "stream": rng.random() < STREAM_PROBABILITY}


BODIES = {"short": short_body, "long": long_body, "mixed": mixed_body,
          "completion": completion_body, "chat": chat_body}
ROUTES = {"short": "/v1/embeddings", "long": "/v1/embeddings", "mixed": "/v1/embeddings",
          "completion": "/v1/completions", "chat": "/v1/chat/completions"}


def _params(body: dict[str, Any]) -> GenerationParams:
    return GenerationParams(max_tokens=int(body.get("max_tokens", 16)),
                            temperature=float(body.get("temperature", 1.0)))


def request_of(body: dict[str, Any]) -> tuple[str, list[str], GenerationParams | None]:
    """``(request kind, texts, generation parameters)`` of an embeddings or completions
    body, as the ingress reads it (then tokenized and priced by
    :func:`serve_app.kinds.build_request`); a chat body's text is the chat template's, see
    :func:`tokenized`."""
    if "prompt" in body:
        return "generate", [body["prompt"]], _params(body)
    texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
    return "embed", list(texts), None


def tokenized(front: FrontEnd, body: dict[str, Any],
              ) -> tuple[str, list[list[int]], GenerationParams | None, bool]:
    """``(request kind, input ids, generation parameters, stream)`` of any body, as the
    ingress makes them with the engine's front end ``front``: a chat body's messages rendered
    by its chat template (``front.chat_ids``, as ``RequestFactory.build_chat``), other texts
    by its tokenizer."""
    stream = bool(body.get("stream", False))
    if "messages" in body:
        return "generate", [front.chat_ids(body["messages"])], _params(body), stream
    kind, texts, params = request_of(body)
    return kind, front.tokenize(texts), params, stream
