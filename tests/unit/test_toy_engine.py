"""The engine written from docs/engines.md alone (tests/engines/toy_engine.py), profiled as
a replica profiles it and used to price requests: its own axes and feature, its held-out
shapes predicted within the documented CPU bound, its prices growing along its own axis;
and a cost model naming a feature resolves only where the module that registers it was
imported (else a clear error)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.engines.registry import engine_class
from deployments.http.request_factory import RequestFactory
from serve_app.admission.policy import policy_class
from serve_app.config import parse_args
from serve_app.kinds import KINDS
from serve_app.memory.cost_model import (
    CorrectedCostModel,
    FittedCostModel,
    Shape,
    UnknownFeatureError,
    register_feature,
    relative_error,
)
from serve_app.memory.profiler import CPU_FIT_ERROR_BOUND
from serve_app.pricing import estimate_units, shape_bytes
from tests.engines.toy_engine import WIDTH, ToyEngine
from tests.support import measure_in_fresh_process

REPO = Path(__file__).resolve().parents[2]
ENGINE = "tests.engines.toy_engine:ToyEngine"
ARGS = {"model": {"engine": ENGINE, "name": "toy", "device": "cpu"},
        "limits": {"max_inputs": 8, "max_input_tokens": 64}}


@pytest.fixture(scope="module")
def profile():
    profile, max_request_bytes, budget_bytes = measure_in_fresh_process(ARGS)
    print(f"\ntoy: fit error {profile.held_out_error:.1%}\n{profile.table()}\n{profile.cost_model}")
    assert budget_bytes >= max_request_bytes
    return profile


def test_the_registry_resolves_the_engine_by_its_import_path() -> None:
    assert engine_class(parse_args(ARGS)) is ToyEngine


def test_the_profile_is_over_the_engine_s_own_axes_and_feature(profile) -> None:
    assert profile.shape_axes == ("texts", "words", "unused")
    assert profile.table().split()[:3] == ["texts", "words", "unused"]
    assert "toy_texts_word_pairs" in profile.cost_model.features
    assert max(p.prompt_tokens for p in profile.points) == 64  # the limits' largest request
    assert max(p.batch for p in profile.points) == 8


def test_held_out_shapes_are_predicted_within_the_documented_bound(profile) -> None:
    held = [p for p in profile.points if p.held_out]
    assert [(p.batch, p.prompt_tokens) for p in held] == [(2, 48), (6, 21)]
    for p in held:
        assert relative_error(p.predicted_bytes, p.measured_bytes) <= CPU_FIT_ERROR_BOUND
    assert profile.held_out_error <= CPU_FIT_ERROR_BOUND


def test_the_fitted_pair_cost_is_the_pair_tensor_s(profile) -> None:
    """One float32 ``(texts, words, words, WIDTH)`` tensor: ``4 x WIDTH`` bytes per pair
    (within the host probe's accuracy: 0.5x to 3x)."""
    model = profile.cost_model
    per_pair = dict(zip(model.features, model.coefficients, strict=True))["toy_texts_word_pairs"]
    assert 0.5 * 4 * WIDTH <= per_pair <= 3 * 4 * WIDTH


def test_requests_are_priced_along_the_engine_s_axis(profile) -> None:
    args = parse_args(ARGS)
    factory = RequestFactory(args, ToyEngine.front_end(args))  # the ingress's
    published = CorrectedCostModel(profile.cost_model).published()  # what a replica publishes
    policy = policy_class(args.admission.policy)

    async def price(words: int, texts: int = 1) -> int:
        request = await factory.build(KINDS["embed"], [" ".join(["w"] * (words - 2))] * texts)
        estimate = estimate_units([published], request.shape, policy)
        assert estimate == shape_bytes(profile.cost_model, request.shape)
        return estimate


    short, medium, long = (asyncio.run(price(n)) for n in (16, 32, 64))
    assert long - medium > 2 * (medium - short) > 0  # quadratic in words
    assert asyncio.run(price(32, texts=4)) > medium


def test_an_unknown_feature_is_a_clear_error() -> None:
    raw = {"features": ["const", "nobody_registered_this"], "coefficients": [1.0, 2.0],
           "held_out_error": 0.1}
    with pytest.raises(UnknownFeatureError, match="nobody_registered_this"):
        FittedCostModel.from_dict(raw)
    with pytest.raises(ValueError, match="already registered"):
        register_feature("toy_texts_word_pairs", lambda a, b, c: 0.0)


def test_a_saved_toy_model_resolves_only_where_the_engine_module_is_imported() -> None:
    raw = json.dumps(FittedCostModel(("const", "toy_texts_word_pairs"), (1.0, 2.0)).to_dict())
    program = ("import json, sys\n"
               "from serve_app.memory.cost_model import FittedCostModel, UnknownFeatureError\n"
               f"raw = json.loads({raw!r})\n"
               "try:\n    FittedCostModel.from_dict(raw)\nexcept UnknownFeatureError as e:\n"
               "    print('unknown', e)\n"
               "import tests.engines.toy_engine\n"
               "print(FittedCostModel.from_dict(raw).request_bytes(2, 10, 0))\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert first.startswith("unknown") and "toy_texts_word_pairs" in first
    assert int(second) == 1 + 2 * 2 * 10 * 10


def test_the_engine_s_canary_runs_its_kind() -> None:
    engine = ToyEngine.load(parse_args(ARGS), "cpu")
    assert engine.canary() is True
    assert engine.profile_ladder(Shape(8, 64, 0))[0][0] == Shape(8, 64, 0)  # largest first


def test_the_profile_command_shows_the_engine_s_axes_and_feature(tmp_path: Path) -> None:
    import yaml

    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({"applications": [{
        "name": "toy", "import_path": "serve_app.app:build_app", "args": ARGS}]}))
    out = tmp_path / "toy.json"
    done = subprocess.run([sys.executable, "-m", "serve_app", "profile", "--config",
                           str(config), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "profiled 1/11: texts=8 words=64 unused=0 peak=" in done.stderr
    lines = done.stdout.splitlines()
    assert "shape axes: texts, words, unused" in lines
    assert any(line.startswith("largest request (texts=8 words=64 unused=0): ")
               for line in lines)
    assert any(line.split()[:3] == ["texts", "words", "unused"] for line in lines)
    assert any(line.strip().startswith("toy_texts_word_pairs") for line in lines)
    assert any(line.strip().startswith("held-out error:") for line in lines)
