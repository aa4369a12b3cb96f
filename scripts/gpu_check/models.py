"""Model directories built at run time from a transformers config: random weights, a
tokenizer trained on a few sentences, nothing downloaded. Causal LMs are Llama-shaped
(``tests/gpu``'s ~1.1B is TinyLlama-1.1B's dimensions); embedding models are plain BERT
directories, which the embedding engine mean-pools and normalises."""

from __future__ import annotations

from pathlib import Path

# Llama dimensions by size; "tiny" is tests.support.build_tiny_causal_lm's (2 layers, 64 wide,
# the tokenizer's ~160-token vocabulary).
CAUSAL_SIZES = {
    "small": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                  num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                  max_position_embeddings=2048),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
               num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
               max_position_embeddings=2048),
}
BERT_SIZES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=128),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096, max_position_embeddings=512),
}


def ensure_model(root: Path, family: str, size: str, device: str) -> Path:
    """The directory of ``family`` (``causal`` or ``bert``) at ``size`` under ``root``,
    built on ``device`` (``cpu`` or ``cuda``: fp16 there) unless an earlier run built it."""
    path = root / f"{family}-{size}"
    if (path / "config.json").is_file():
        return path
    build = _build_causal if family == "causal" else _build_bert
    tmp = root / f".{family}-{size}.partial"
    build(tmp, size, device)
    tmp.rename(path)
    if device == "cuda":  # nothing of the build may stay cached: the replica measures next
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    return path


def _save(model, path: Path, device: str) -> None:
    """Save ``model`` (fp16 on CUDA)."""
    import torch

    model.to(torch.float16 if device == "cuda" else torch.float32).save_pretrained(str(path))


def _build_causal(path: Path, size: str, device: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.support import build_tiny_causal_lm

    build_tiny_causal_lm(path)  # its tokenizer (and a tiny model, replaced below)
    if size == "tiny":
        return
    for weights in path.glob("model*.safetensors*"):
        weights.unlink()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    config = LlamaConfig(**CAUSAL_SIZES[size], eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    _save(model, path, device)


def _build_bert(path: Path, size: str, device: str) -> None:
    import torch
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    from tests.support import TINY_LM_CORPUS

    word_piece = BertWordPieceTokenizer(lowercase=True)
    word_piece.train_from_iterator(TINY_LM_CORPUS, vocab_size=400, min_frequency=1,
                                   show_progress=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_piece._tokenizer, cls_token="[CLS]", sep_token="[SEP]",
        pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    config = BertConfig(vocab_size=len(tokenizer), **BERT_SIZES[size])
    torch.manual_seed(0)
    with torch.device(device):
        model = BertModel(config)
    _save(model, path, device)
