"""parse_args: defaults, unknown and misplaced keys named, invalid values explained."""

from __future__ import annotations

import math

import pydantic
import pytest

from serve_app.config import AppArgs, ConfigError, parse_args


def problems(raw: dict) -> list[str]:
    """The lines of the ConfigError that ``raw`` raises, without the heading."""
    with pytest.raises(ConfigError) as refused:
        parse_args(raw)
    heading, *lines = str(refused.value).split("\n")
    assert heading == "invalid vramgate config:"
    return [line.strip() for line in lines]


@pytest.mark.parametrize("raw", [None, {}])
def test_no_args_means_the_defaults(raw) -> None:
    args = parse_args(raw)
    assert args == AppArgs()
    assert args.admission.policy == "budget"
    assert args.admission.max_queue_len == 64
    assert args.admission.max_queue_wait_s == 10.0
    assert args.memory.safety_factor == 0.9
    assert args.deployment.num_gpus == 0.0


def test_values_are_read_into_their_sections() -> None:
    args = parse_args({"admission": {"max_queue_len": 3, "max_queue_wait_s": 0.5},
                       "deployment": {"num_gpus": 0.5}, "model": {"device": "cuda"}})
    assert args.admission.max_queue_len == 3
    assert args.admission.max_queue_wait_s == 0.5
    assert args.deployment.num_gpus == 0.5
    assert args.model.device == "cuda"
    assert args.admission.inference_timeout_s == 30.0  # untouched keys keep their defaults


def test_an_unknown_key_is_named() -> None:
    assert problems({"admission": {"max_queu_len": 1}}) == [
        "args.admission.max_queu_len: unknown key (check its spelling and section)"]


def test_an_unknown_section_is_named() -> None:
    assert problems({"admision": {}}) == [
        "args.admision: unknown key (check its spelling and section)"]


def test_a_misplaced_key_is_named_where_it_was_put() -> None:
    assert problems({"memory": {"max_queue_len": 3}}) == [
        "args.memory.max_queue_len: unknown key (check its spelling and section)"]


def test_every_problem_gets_its_own_line() -> None:
    lines = problems({"memory": {"max_queue_len": 3, "safety_factor": 1.5},
                      "admission": {"max_queue_len": -1}})
    assert sorted(lines) == sorted([
        "args.memory.max_queue_len: unknown key (check its spelling and section)",
        "args.memory.safety_factor: Input should be less than or equal to 1",
        "args.admission.max_queue_len: Input should be greater than or equal to 0",
    ])


@pytest.mark.parametrize(("raw", "line"), [
    ({"admission": {"max_queue_wait_s": 0}},
     "args.admission.max_queue_wait_s: Input should be greater than 0"),
    ({"admission": {"max_queue_wait_s": math.nan}},
     "args.admission.max_queue_wait_s: Input should be a finite number"),
    ({"admission": {"max_queue_wait_s": math.inf}},
     "args.admission.max_queue_wait_s: Input should be a finite number"),
    ({"admission": {"policy": "fifo"}}, "args.admission.policy: Input should be"),
    ({"deployment": {"num_gpus": 1.5}},
     "args.deployment.num_gpus: Input should be less than or equal to 1"),
    ({"memory": {"capacity_bytes": 0}},
     "args.memory.capacity_bytes: Input should be greater than 0"),
    ({"limits": {"max_inputs": 0}},
     "args.limits.max_inputs: Input should be greater than or equal to 1"),
    ({"admission": 5}, "args.admission: Input should be a valid dictionary"),
])
def test_an_invalid_value_is_explained(raw: dict, line: str) -> None:
    (only,) = problems(raw)
    assert only.startswith(line)


def test_cuda_without_a_gpu_share_says_what_to_change() -> None:
    (only,) = problems({"model": {"device": "cuda"}})
    assert "model.device is 'cuda' but deployment.num_gpus is 0" in only
    assert "deployment.num_gpus: 0.5" in only


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_parsed_args_are_frozen() -> None:
    args = parse_args({})
    with pytest.raises(pydantic.ValidationError):
        args.admission.max_queue_len = 5  # type: ignore[misc]


def test_every_section_field_is_documented() -> None:
    for section in AppArgs.model_fields.values():
        for name, field in section.annotation.model_fields.items():
            assert field.description, f"{section.annotation.__name__}.{name} has no description"


@pytest.mark.parametrize(("auth", "problem"), [
    ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]},
     "args.auth: a key of tenant 'a' is also one of 'b': each key names one tenant"),
    ({"api_key": "k", "tenants": [{"name": "b", "api_keys": ["k"]}]},
     "args.auth: a key of tenant 'default' is also one of 'b': each key names one tenant"),
    ({"tenants": [{"name": "a"}, {"name": "a"}]},
     "args.auth: tenants: names must be unique, got ['a', 'a']"),
    ({"api_key": "k", "tenants": [{"name": "default", "api_keys": ["j"]}]},
     "args.auth: tenants: 'default' is auth.api_key's tenant; name the tenant otherwise or "
     "move the key into its api_keys"),
    ({"tenants": [{"name": "a", "weight": 0}]},
     "args.auth.tenants.0.weight: Input should be greater than 0"),
    ({"tenants": [{"name": "a b"}]},
     "args.auth.tenants.0.name: String should match pattern"),
])
def test_tenants_that_cannot_be_told_apart_are_refused(auth, problem) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_args({"auth": auth})
    assert problem in str(raised.value)


def test_a_tenants_keys_come_from_the_config_and_its_environment_variable(monkeypatch) -> None:
    monkeypatch.setenv("ETL_KEYS", "e1, e2")
    auth = parse_args({"auth": {"api_key": "d", "tenants": [
        {"name": "etl", "api_keys": ["e0"], "api_key_env": "ETL_KEYS", "weight": 2,
         "max_share": 0.5}]}}).auth
    assert auth.tenant_keys() == {"d": "default", "e0": "etl", "e1": "etl", "e2": "etl"}
    assert auth.weights() == {"etl": 2.0}
    assert auth.quotas() == {"etl": (0.5, None)}
