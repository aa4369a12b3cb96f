"""What would be served wrong is refused at start-up (resolving the engine, before any
replica starts) with a message naming ``model.path``: quantised weights, a model that needs
its own code, a ``config.json`` whose dimensions cannot be read, unsupported
sentence-transformers modules. And ``model.name`` defaults to the directory's name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployments.engines.registry import engine_class
from serve_app.config import ConfigError, parse_args
from tests.embedding_dirs import build_bert, build_sentence_transformer
from tests.model_dirs import build_causal_lm

pytestmark = pytest.mark.unit


def _edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (path / "config.json").write_text(json.dumps(config))
    return path


def _refusal(task: str, path: Path) -> str:
    with pytest.raises(ConfigError) as refused:
        engine_class(parse_args({"model": {"task": task, "path": str(path)}}))
    return str(refused.value)


@pytest.fixture()
def causal_lm(tmp_path: Path) -> Path:
    return build_causal_lm(tmp_path / "lm", "gpt2")


def test_quantised_weights_are_refused(causal_lm: Path) -> None:
    _edit_config(causal_lm, quantization_config={"quant_method": "gptq", "bits": 4})
    message = _refusal("generate", causal_lm)
    assert "args.model.path" in message and "quantised weights (quantization_config: gptq)" \
        in message


def test_a_model_that_needs_its_own_code_is_refused(tmp_path: Path) -> None:
    path = _edit_config(build_bert(tmp_path / "bert"), model_type="my_remote_bert",
                        auto_map={"AutoModel": "modeling_mine.MyModel"})
    assert "needs the model's own code (auto_map, trust_remote_code)" in _refusal("embed", path)


def test_unreadable_dimensions_are_refused_naming_the_keys(causal_lm: Path) -> None:
    _edit_config(causal_lm, n_layer=None, n_head=None)
    message = _refusal("generate", causal_lm)
    assert "cannot read" in message and "n_layer" in message and "n_head" in message


def test_unsupported_sentence_transformers_modules_are_refused(tmp_path: Path) -> None:
    path = build_sentence_transformer(tmp_path / "st")
    entries = json.loads((path / "modules.json").read_text())
    entries[1]["type"] = "sentence_transformers.models.WeightedLayerPooling"
    (path / "modules.json").write_text(json.dumps(entries))
    message = _refusal("embed", path)
    assert "args.model.path" in message and "['WeightedLayerPooling'] are not supported" \
        in message


def test_a_supported_directory_is_accepted_and_named_after_itself(causal_lm: Path) -> None:
    args = parse_args({"model": {"task": "generate", "path": str(causal_lm) + "/"}})
    assert engine_class(args).__name__ == "GenerationEngine"
    assert args.model.name == "lm"
    assert parse_args({}).model.name == "all-MiniLM-L6-v2"
    assert parse_args({"model": {"path": str(causal_lm), "name": "mine"}}).model.name == "mine"
