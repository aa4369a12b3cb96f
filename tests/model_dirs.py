"""Causal LM directories of each tokenizer family, built offline at test time.

``build_causal_lm(path, family)`` saves a tiny random-weight model of the family's
architecture and a tokenizer trained on :data:`tests.support.TINY_LM_CORPUS` that follows the
family's conventions as its real checkpoints ship them (special token names and order, pad
token or none, BOS added or not, byte-level or SentencePiece-style pieces, one or several EOS
ids). What each family ships is recorded in :data:`CONVENTIONS`; the tests check the built
tokenizer against it. Each directory takes about a second to build.

Byte-level families (GPT-2, Qwen2, Llama-3) have all 256 single-byte pieces, and
SentencePiece-style ones (Llama-2, Mistral, Gemma) have the 256 ``<0xNN>`` byte-fallback
pieces, as the real vocabularies do: a random model then emits byte sequences that are not
UTF-8, which decode to U+FFFD, so different ids can decode to the same text. Tests that
compare completions must compare token ids, not only text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tests.support import TINY_LM_CORPUS

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "gemma", "gpt2")


@dataclass(frozen=True)
class Convention:
    """What a family's released tokenizer and generation config define.

    Attributes:
        pad: the pad token, or ``None`` when the family ships none.
        bos: the BOS token, or ``None`` (Qwen2 defines none).
        eos: the tokenizer's EOS token.
        adds_bos: whether encoding a text prepends ``bos``.
        stop: every token ``generation_config.json`` stops on (its ``eos_token_id``).
        source: the checkpoint whose files this mirrors.
    """

    pad: str | None
    bos: str | None
    eos: str
    adds_bos: bool
    stop: tuple[str, ...]
    source: str


CONVENTIONS = {
    "llama": Convention(None, "<s>", "</s>", True, ("</s>",), "meta-llama/Llama-2-7b-hf"),
    "llama3": Convention(None, "<|begin_of_text|>", "<|eot_id|>", True,
                         ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
                         "meta-llama/Llama-3.1-8B-Instruct"),
    "mistral": Convention(None, "<s>", "</s>", True, ("</s>",), "mistralai/Mistral-7B-v0.1"),
    "qwen2": Convention("<|endoftext|>", None, "<|im_end|>", False,
                        ("<|im_end|>", "<|endoftext|>"), "Qwen/Qwen2.5-0.5B-Instruct"),
    "gemma": Convention("<pad>", "<bos>", "<eos>", True, ("<eos>",), "google/gemma-2b"),
    "gpt2": Convention(None, "<|endoftext|>", "<|endoftext|>", False, ("<|endoftext|>",),
                       "openai-community/gpt2"),
}

_BYTE_PIECES = tuple(f"<0x{i:02X}>" for i in range(256))
_LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>")
_QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _train(pre_tokenizer, specials: tuple[str, ...], alphabet: list[str],
           vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """BPE ``(vocab, merges)`` trained on the corpus; ``specials`` take the first ids."""
    from tokenizers import Tokenizer, models, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=list(specials), initial_alphabet=alphabet)
    tokenizer.train_from_iterator(TINY_LM_CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], [tuple(pair) for pair in model["merges"]]


def _sentencepiece_vocab(specials: tuple[str, ...], dummy_prefix: bool):
    """Llama-2/Mistral/Gemma layout: ``specials``, the 256 byte-fallback pieces, then
    ``▁``-prefixed pieces (``dummy_prefix``: a ``▁`` is prepended to the text, as Llama's
    SentencePiece model does and Gemma's does not)."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.Metaspace(prepend_scheme="first" if dummy_prefix else "never")
    return _train(pre, specials + _BYTE_PIECES, [], 420)


def _byte_level_vocab(specials: tuple[str, ...]):
    """GPT-2/Qwen2/Llama-3 layout: the 256 byte pieces and merges, then ``specials``."""
    from tokenizers import pre_tokenizers

    vocab, merges = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), (),
                           pre_tokenizers.ByteLevel.alphabet(), 400)
    return {**vocab, **{s: len(vocab) + i for i, s in enumerate(specials)}}, merges


def _llama_tokenizer(family: str):
    """Llama-2 and Mistral ship ``LlamaTokenizer``: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, byte
    fallback, BOS added, no pad token."""
    from transformers import LlamaTokenizer

    vocab, merges = _sentencepiece_vocab(("<unk>", "<s>", "</s>"), True)
    return LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False)


def _gemma_tokenizer(family: str):
    """Gemma ships ``GemmaTokenizer``: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3,
    ``<mask>`` 4, byte fallback, no dummy prefix, BOS added, and a real pad token."""
    from transformers import GemmaTokenizer

    vocab, merges = _sentencepiece_vocab(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"), False)
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False)


def _gpt2_tokenizer(family: str):
    """GPT-2 ships ``GPT2Tokenizer``: byte-level, ``<|endoftext|>`` (the last id) as BOS, EOS
    and unk, no BOS added, no pad token."""
    from transformers import GPT2Tokenizer

    vocab, merges = _byte_level_vocab(("<|endoftext|>",))
    return GPT2Tokenizer(vocab=vocab, merges=merges)


def _qwen2_tokenizer(family: str):
    """Qwen2.5-Instruct ships ``Qwen2Tokenizer``: byte-level, no BOS token, EOS
    ``<|im_end|>``, pad ``<|endoftext|>`` (the base models' EOS), specials after the pieces."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _byte_level_vocab(_QWEN2_SPECIALS)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_tokens([AddedToken(s, special=True) for s in _QWEN2_SPECIALS])
    return tokenizer


def _llama3_tokenizer(family: str):
    """Llama-3.1-Instruct ships a plain ``PreTrainedTokenizerFast``: byte-level pieces, then
    ``<|begin_of_text|>`` (prepended by a ``TemplateProcessing`` post-processor),
    ``<|end_of_text|>``, ..., ``<|eot_id|>`` (the tokenizer's EOS); no pad token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _byte_level_vocab(_LLAMA3_SPECIALS)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True) for s in _LLAMA3_SPECIALS])
    bos = _LLAMA3_SPECIALS[0]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos,
                                   eos_token="<|eot_id|>")


_TOKENIZERS = {"llama": _llama_tokenizer, "llama3": _llama3_tokenizer,
               "mistral": _llama_tokenizer, "qwen2": _qwen2_tokenizer,
               "gemma": _gemma_tokenizer, "gpt2": _gpt2_tokenizer}


def _config(family: str, ids: dict[str, int | list[int] | None], vocab_size: int,
            num_layers: int, hidden: int, init_std: float):
    """The family's transformers config: ``num_layers`` blocks ``hidden`` wide, 4 query heads
    (grouped-query attention with 2 KV heads where the family uses it; Gemma-2b's single KV
    head and explicit ``head_dim``), weights drawn with std ``init_std``."""
    from transformers import (
        GemmaConfig,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=init_std,
                  tie_word_embeddings=False, **ids)
    if family == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=num_layers, n_head=4,
                          n_positions=512, initializer_range=init_std,
                          tie_word_embeddings=False, **ids)
    if family == "gemma":
        return GemmaConfig(**{**common, "num_key_value_heads": 1}, head_dim=hidden // 4)
    if family == "mistral":  # a short window, so that prompts and completions cross it
        return MistralConfig(**common, sliding_window=8)
    if family == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common, rope_theta=500000.0 if family == "llama3" else 10000.0)


def _special_ids(tokenizer, convention: Convention) -> dict[str, int | list[int] | None]:
    """``bos_token_id``, ``eos_token_id`` (a list when the family stops on several) and
    ``pad_token_id`` as the family's ``config.json`` and ``generation_config.json`` list
    them (Qwen2.5's config.json has bos 151643 though its tokenizer has no BOS token)."""
    stop = [tokenizer.convert_tokens_to_ids(token) for token in convention.stop]
    bos = convention.bos or "<|endoftext|>"
    return {"bos_token_id": tokenizer.convert_tokens_to_ids(bos),
            "eos_token_id": stop if len(stop) > 1 else stop[0],
            "pad_token_id": tokenizer.pad_token_id}


def build_causal_lm(path: Path, family: str, num_layers: int = 2, hidden_size: int = 64,
                    init_std: float = 0.2, seed: int = 0) -> Path:
    """Save a random-weight causal LM of ``family`` (one of :data:`FAMILIES`) and its
    tokenizer to ``path`` (created): ``config.json``, ``generation_config.json``, weights
    and tokenizer files, loadable offline by ``from_pretrained``. Returns ``path``.

    ``init_std`` (the families use 0.02) and untied input and output embeddings make
    greedy completions of a tiny random model vary from token to token and from prompt to
    prompt (tied embeddings, Qwen2's, Gemma's and GPT-2's, make it echo the prompt's last
    token; 0.02 repeats a few tokens), so that comparing completions can fail. Batched
    and lone forward passes differ by about 2e-6 of the logits' spread (fp32, CPU) and the
    closest top-2 logits of a greedy step by over 1000 times that, at any ``init_std``.

    Raises:
        KeyError: an unknown ``family``.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    convention = CONVENTIONS[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _TOKENIZERS[family](family)
    tokenizer.save_pretrained(str(path))
    ids = _special_ids(tokenizer, convention)
    config = _config(family, ids, len(tokenizer), num_layers, hidden_size, init_std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(str(path))
    return path
