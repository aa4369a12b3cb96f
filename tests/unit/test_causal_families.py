"""The generation engine on a tiny random model of each tokenizer family (Llama-2, Llama-3,
Mistral, Qwen2, Gemma, GPT-2; :mod:`tests.model_dirs`), checked against transformers'
``generate`` on the same ids: a lone greedy completion is exactly HF's, and each of 16
prompts of different lengths batched together (left-padded, padded with EOS where the
tokenizer has no pad token) is exactly what it is alone.

Completions are compared as token ids (recorded from ``model.generate``) as well as text:
these vocabularies hold single-byte pieces, so a random model emits bytes that are not UTF-8
and different ids can decode to the same U+FFFD text.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, TextStreamer

from deployments.engines.generation import GenerationEngine, pad_token_id, stop_token_ids
from deployments.engines.hf import padded
from serve_app.request import GenerationParams
from tests.model_dirs import CONVENTIONS, FAMILIES, build_causal_lm
from tests.support import TINY_LM_CORPUS

_SENTENCES = list(dict.fromkeys(TINY_LM_CORPUS))
# 16 prompts of 1 to 11 words, from every sentence of the tokenizers' corpus.
PROMPTS = [" ".join(_SENTENCES[i % 4].split()[:1 + i % 11]) for i in range(16)]
GREEDY = GenerationParams(max_tokens=12, temperature=0.0)


class _Recorder:
    """Stands in for ``model.generate``: keeps each call's output ids; while ``force`` is
    ``(token, step)``, each call is made to choose ``token`` at generated step ``step``."""

    def __init__(self, generate) -> None:
        self.generate, self.outputs = generate, []
        self.force: tuple[int, int] | None = None

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self.force is not None:
            kwargs["logits_processor"] = LogitsProcessorList([_ForceAt(*self.force)])
        output = self.generate(*args, **kwargs)
        self.outputs.append(output)
        return output

    def new_ids(self, width: int) -> list[list[int]]:
        """Ids after the first ``width`` columns of each row of the last call's output."""
        return self.outputs[-1][:, width:].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tmp_path_factory) -> GenerationEngine:
    path = build_causal_lm(tmp_path_factory.mktemp(request.param) / "model", request.param)
    engine = GenerationEngine(path, "cpu", "float32", num_threads=1)
    engine.family = request.param
    engine.model.generate = _Recorder(engine.model.generate)
    return engine


def _alone(engine, prompt_ids, params) -> tuple[list, list[list[int]]]:
    """Each prompt completed on its own: outputs and the new ids, cut after the first
    stop id as the engine cuts them."""
    outputs, new_ids = [], []
    for ids, p in zip(prompt_ids, params, strict=True):
        outputs.append(engine.generate_ids(ids, p))
        new_ids.append(engine.model.generate.new_ids(len(ids))[0])
    return outputs, new_ids


def _batched(engine, prompt_ids, params) -> tuple[list, list[list[int]]]:
    """The prompts as one batch: outputs and each row's new ids, cut as its output says."""
    outputs = engine.generate_batch_ids(prompt_ids, params)
    rows = engine.model.generate.new_ids(max(map(len, prompt_ids)))
    return outputs, [row[:o.completion_tokens] for row, o in zip(rows, outputs, strict=True)]


def _ids(engine, tokens) -> list[int]:
    return [engine.tokenizer.convert_tokens_to_ids(token) for token in tokens]


def test_special_tokens_are_as_the_family_ships_them(engine) -> None:
    convention = CONVENTIONS[engine.family]
    tokenizer = engine.tokenizer
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == \
        (convention.pad, convention.bos, convention.eos)
    assert engine.stop_ids == tuple(_ids(engine, convention.stop))
    expected_pad = tokenizer.pad_token_id if convention.pad else tokenizer.eos_token_id
    assert engine.pad_id == expected_pad is not None


def test_bos_is_added_as_the_family_adds_it(engine) -> None:
    convention = CONVENTIONS[engine.family]
    plain = engine.tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    [ids] = engine.front.tokenize(["the quick brown fox"])
    bos = _ids(engine, [convention.bos])[:1] if convention.adds_bos else []
    assert ids == bos + plain
    assert engine.tokenizer.bos_token_id not in plain


class _TextOf(TextStreamer):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text


def test_a_lone_greedy_completion_is_what_hf_generate_makes(engine) -> None:
    stop = set(engine.stop_ids)
    for ids in engine.front.tokenize(PROMPTS[::3]):
        reference = _TextOf(engine.tokenizer)  # transformers' own streamed decoding
        ref_ids = engine.model.generate.generate(torch.tensor([ids]), max_new_tokens=12,
                                                 do_sample=False, streamer=reference)
        ref_ids = ref_ids[0, len(ids):].tolist()
        output = engine.generate_ids(ids, GREEDY)
        assert engine.model.generate.new_ids(len(ids))[0] == ref_ids
        assert output.text == reference.text
        assert output.completion_tokens == len(ref_ids)
        assert output.finish_reason == ("stop" if ref_ids[-1] in stop else "length")


@pytest.mark.parametrize("max_tokens", [[12] * 16, [1, 3, 7, 12, 16, 2, 5, 9] * 2],
                         ids=["same-max-tokens", "own-max-tokens"])
def test_16_batched_prompts_each_get_their_lone_completion(engine, max_tokens) -> None:
    prompt_ids = engine.front.tokenize(PROMPTS)
    assert len({len(ids) for ids in prompt_ids}) >= 8  # the batch is really left-padded
    params = [GenerationParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    alone, alone_ids = _alone(engine, prompt_ids, params)
    together, together_ids = _batched(engine, prompt_ids, params)
    assert together_ids == alone_ids
    assert together == alone
    assert len({tuple(ids) for ids in alone_ids}) >= 8  # completions that differ


class _ForceAt(LogitsProcessor):
    """Makes ``token`` the only choice at generated step ``step`` (0-based) of every row."""

    def __init__(self, token: int, step: int) -> None:
        self.token, self.step, self.start = token, step, None

    def __call__(self, input_ids, scores):
        self.start = input_ids.shape[1] if self.start is None else self.start
        if input_ids.shape[1] - self.start == self.step:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.token] = 0.0
        return scores


def test_every_configured_eos_id_ends_a_completion_with_stop(engine) -> None:
    prompt_ids = engine.front.tokenize(PROMPTS[:6])
    recorder = engine.model.generate
    stop = _ids(engine, CONVENTIONS[engine.family].stop)
    for token, step in zip(stop, itertools.cycle((2, 0, 4)), strict=False):
        try:
            recorder.force = (token, step)
            alone, alone_ids = _alone(engine, prompt_ids, [GREEDY] * 6)
            together, together_ids = _batched(engine, prompt_ids, [GREEDY] * 6)
        finally:
            recorder.force = None
        assert together == alone
        assert together_ids == alone_ids
        # (a row may have chosen a stop id of its own before the forced step)
        assert all(ids[-1] in stop for ids in alone_ids)
        assert all(o.finish_reason == "stop" and o.completion_tokens == len(ids) <= step + 1
                   for o, ids in zip(alone, alone_ids, strict=True))
        assert sum(ids[-1] == token and len(ids) == step + 1 for ids in alone_ids) >= 3


def _hf_batch(engine, prompt_ids, **changes) -> list[list[int]]:
    """HF ``generate`` on the left-padded batch, with ``changes`` to its inputs."""
    batch = {**padded(prompt_ids, engine.pad_id, side="left"), **changes}
    output = engine.model.generate.generate(**batch, max_new_tokens=8, do_sample=False,
                                            pad_token_id=engine.pad_id)
    return output[:, batch["input_ids"].shape[1]:].tolist()


def test_the_comparison_catches_a_wrong_mask_or_wrong_positions(engine) -> None:
    """Batching is only right with the attention mask, and (for GPT-2's learned absolute
    positions) with position ids counted from each row's first real token. Rotary families
    see only relative positions, which a shift by the padding leaves unchanged."""
    prompt_ids = engine.front.tokenize(PROMPTS)
    params = [GenerationParams(max_tokens=8, temperature=0.0)] * 16
    _, alone_ids = _alone(engine, prompt_ids, params)
    full = _hf_batch(engine, prompt_ids)
    assert [row[:len(ids)] for row, ids in zip(full, alone_ids, strict=True)] == alone_ids
    ones = torch.ones(16, max(map(len, prompt_ids)), dtype=torch.long)
    assert _hf_batch(engine, prompt_ids, attention_mask=ones) != full
    if engine.family == "gpt2":
        shifted = torch.arange(ones.shape[1]).expand(16, -1)
        assert _hf_batch(engine, prompt_ids, position_ids=shifted) != full


@pytest.mark.parametrize(("pad", "eos", "stop", "expected"), [
    (3, 5, (5, 7), 3), (None, 5, (7,), 5), (None, 0, (0,), 0), (None, None, (7, 8), 7),
])
def test_the_pad_id_is_the_pad_token_else_an_eos(pad, eos, stop, expected) -> None:
    assert pad_token_id(pad, eos, stop) == expected


def test_without_pad_or_eos_batches_pad_with_0_and_say_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="deployments.engines.generation"):
        assert pad_token_id(None, None, (), "tiny") == 0
    assert "tiny" in caplog.text and "neither a pad nor an EOS" in caplog.text


@pytest.mark.parametrize(("configured", "tokenizer_eos", "expected"), [
    ([128001, 128008, 128009], 128009, (128001, 128008, 128009)), (2, 7, (2,)),
    ([5, 5, 6], None, (5, 6)), (None, 7, (7,)), (None, None, ()),
])
def test_stop_ids_are_the_generation_configs_else_the_tokenizers(configured, tokenizer_eos,
                                                                 expected) -> None:
    assert stop_token_ids(configured, tokenizer_eos) == expected
