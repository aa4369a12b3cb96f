"""The engine registry: a name or an import path picks the engine class, checked against the
config; everything else it refuses with a ConfigError naming the key."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from deployments.engines.base import AsyncScheduler, Engine, PassRunner
from deployments.engines.embeddings import EmbeddingEngine
from deployments.engines.fake import FakeEngine
from deployments.engines.generation import GenerationEngine
from deployments.engines.registry import BUILTIN_ENGINES, engine_class
from deployments.engines.transcribe import TranscribeEngine
from serve_app.config import ConfigError, parse_args
from tests.support import build_tiny_causal_lm


class ToyEngine(PassRunner):
    """An engine class defined outside the project (a test module)."""

    kinds = ("embed",)


class NoKindsEngine(PassRunner):
    pass


class UnknownKindEngine(PassRunner):
    kinds = ("rerank",)


class NoCapabilityEngine(Engine):
    """Neither runs passes nor schedules itself (an engine written before the capabilities:
    ``run_embed`` without ``run_batch``)."""

    kinds = ("embed",)


class SchedulingEmbedder(AsyncScheduler):
    kinds = ("embed",)


def problems(raw: dict) -> list[str]:
    """The lines of the ConfigError that resolving ``raw``'s engine raises."""
    with pytest.raises(ConfigError) as refused:
        engine_class(parse_args(raw))
    heading, *lines = str(refused.value).split("\n")
    assert heading == "invalid vramgate config:"
    return [line.strip() for line in lines]


def test_each_task_names_its_builtin_engine() -> None:
    assert set(BUILTIN_ENGINES) == {"embed", "generate", "fake", "transcribe", "vllm"}
    assert engine_class(parse_args({})) is EmbeddingEngine
    assert engine_class(parse_args({"model": {"task": "fake"}})) is FakeEngine
    assert engine_class(parse_args({"model": {"task": "generate", "path": "/lm"}})) is \
        GenerationEngine
    # model.engine wins over model.task
    assert engine_class(parse_args({"model": {"task": "embed", "engine": "fake"}})) is FakeEngine
    assert engine_class(parse_args({"model": {"engine": "transcribe", "path": "/whisper"}})) \
        is TranscribeEngine


def test_an_import_path_loads_your_own_engine_class() -> None:
    args = parse_args({"model": {"engine": f"{__name__}:ToyEngine"}})
    assert engine_class(args) is ToyEngine
    assert args.model.engine_name == f"{__name__}:ToyEngine"


@pytest.mark.parametrize(("engine", "says"), [
    ("bert", "unknown engine 'bert': use one of ['embed', 'fake', 'generate', 'transcribe', "
     "'vllm']"),
    ("no_such_module_here:Engine", "cannot import the engine no_such_module_here:Engine"),
    (f"{__name__}:Missing", f"cannot import the engine {__name__}:Missing"),
    (f"{__name__}:problems", "is neither a deployments.engines.base.PassRunner nor an "
     "AsyncScheduler: subclass one (docs/engines.md)"),
    (f"{__name__}:NoCapabilityEngine", "is neither a deployments.engines.base.PassRunner"),
    (f"{__name__}:SchedulingEmbedder", "schedules itself, so it serves kinds that generate "
     "only, not ['embed']"),
    (f"{__name__}:NoKindsEngine", "serves request kinds []; each must be one of"),
    (f"{__name__}:UnknownKindEngine", "serves request kinds ['rerank']"),
])
def test_a_bad_engine_is_named(engine: str, says: str) -> None:
    (only,) = problems({"model": {"engine": engine}})
    assert only.startswith("args.model.engine: ") and says in only


def test_a_budget_larger_than_the_replicas_share_of_the_card_is_rejected() -> None:
    (only,) = problems({"model": {"task": "fake"}, "deployment": {"num_gpus": 0.5},
                        "fake": {"device_capacity_bytes": 16 << 30},
                        "memory": {"capacity_bytes": 10 << 30}})
    assert "memory.capacity_bytes: 10737418240 does not fit" in only
    assert "0.5 x fake.device_capacity_bytes = 8589934592" in only


def test_generation_needs_a_model_path() -> None:
    (only,) = problems({"model": {"task": "generate"}})
    assert only.startswith("args.model.path: ")
    assert "set model.path to a causal LM directory" in only


def vllm_args(path: Path) -> dict:
    return {"model": {"engine": "vllm", "path": str(path), "device": "cpu"},
            "deployment": {"num_gpus": 0}}


def test_the_vllm_engine_without_vllm_installed_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    path = build_tiny_causal_lm(tmp_path / "lm", hidden_size=128, num_heads=2)
    [line] = problems(vllm_args(path))
    assert line.startswith("args.model.engine: vllm cannot be imported (")
    assert line.endswith("pip install 'vramgate[vllm]' on a GPU machine, or the CPU build "
                         "(README: Install)")


@pytest.mark.parametrize(("hidden_size", "num_heads", "refused"),
                         [(64, 4, True), (128, 2, False), (128, 4, False)])
def test_the_vllm_engine_on_cpu_refuses_head_sizes_its_attention_lacks(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hidden_size: int, num_heads: int,
        refused: bool) -> None:
    from deployments.engines.vllm_engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    path = build_tiny_causal_lm(tmp_path / "lm", hidden_size=hidden_size, num_heads=num_heads)
    if not refused:
        assert engine_class(parse_args(vllm_args(path))) is VLLMEngine
        return
    [line] = problems(vllm_args(path))
    assert line == ("args.model.path: head size 16: vLLM's CPU attention runs head sizes "
                    "[32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512] only")
