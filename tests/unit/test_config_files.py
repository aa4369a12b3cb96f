"""Every file in configs/ is a valid Ray Serve config whose args our model accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.engines.registry import engine_class
from serve_app.app_config import parse_models
from serve_app.config import parse_args
from serve_app.planning import plan_deployment

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"local.yaml", "prod.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid_for_ray_and_for_us(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    for application in schema.applications:
        assert application.import_path == "serve_app.app:build_app"
        for args in parse_models(application.args):
            plan = plan_deployment(args, engine_class(args))
            assert plan.max_ongoing_requests >= 1
            assert plan.num_gpus == args.deployment.num_gpus


def test_prod_uses_fractional_gpus() -> None:
    raw = yaml.safe_load((CONFIGS[0].parent / "prod.yaml").read_text())
    args = parse_args(raw["applications"][0]["args"])
    assert 0 < args.deployment.num_gpus < 1
    assert args.model.device == "cuda"
