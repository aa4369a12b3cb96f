"""``vramgate validate`` (every problem of every config at once, without Ray) and ``vramgate
plan`` (what each replica gets, and from which measurement)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.engines.registry import engine_class
from serve_app.__main__ import main
from serve_app.app_config import parse_models
from serve_app.cli.plan import plan_lines
from serve_app.cli.serve_config import APPLICATION_KEYS, TOP_LEVEL_KEYS
from serve_app.config import parse_args
from serve_app.planning import plan_deployment

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "loadtest/configs").glob("*.yaml")])
OURS = "serve_app.app:build_app"

BROKEN = {
    "proxy_locaton": "HeadOnly",
    "applications": [
        {"name": "a", "import_path": OURS, "route_prefix": "api/", "args": {
            "admission": {"max_queu_len": 1}, "memory": {"safety_factor": 2},
            "deployment": {"min_replicas": 2, "autoscaling_look_back_s": 1}}},
        {"name": "a", "import_path": "nocolon", "host": "0.0.0.0"},
        5,
        {"name": "b", "route_prefix": "/b", "import_path": OURS,
         "args": {"model": {"engine": "nowhere.module:Engine"}}},
    ],
}


def run_main(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_shipped_configs_validate_without_importing_ray() -> None:
    code = ("import sys\nfrom serve_app.__main__ import main\nstatus = main(sys.argv[1:])\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
            "sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, "validate", *map(str, CONFIGS)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    *ok, imported = done.stdout.splitlines()
    assert imported == "[]"
    assert ok == [f"{path}: application 'vramgate': ok ({engine_line})" for path, engine_line
                  in zip(CONFIGS, [_engine_line(path) for path in CONFIGS], strict=True)]


def _engine_line(path: Path) -> str:
    models = parse_models(yaml.safe_load(path.read_text())["applications"][0]["args"])
    # configs/generate.yaml's model.path is a placeholder for the user's own model.
    unread = (", but its model config cannot be read on this machine (a placeholder path, or "
              "one that only the cluster has?): its plan is a fallback"
              if path.name == "generate.yaml" else "")
    return "; ".join(f"{args.model.engine_name} engine, model {args.model.name!r}, "
                     f"num_gpus {args.deployment.num_gpus:g} per replica{unread}"
                     for args in models)


def test_a_broken_config_prints_every_problem_one_line_each(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(BROKEN))
    (tmp_path / "not_yaml.yaml").write_text("applications:\n  - name: [a\n")
    status, out, err = run_main(capsys, "validate", str(broken), str(REPO / "configs/fake.yaml"),
                                str(tmp_path / "not_yaml.yaml"), str(tmp_path / "absent.yaml"))
    assert status == 1
    a = f"{broken}: application 'a'"
    assert sorted(err.splitlines()) == sorted(f"vramgate: {line}" for line in [
        f"{broken}: proxy_locaton: unknown key (Ray Serve ignores it; check its spelling)",
        f"{broken}: name 'a' is used by more than one application (Ray Serve refuses it)",
        f"{a}: route_prefix: 'api/' must start with '/'",
        f"{a}: args.admission.max_queu_len: unknown key (check its spelling and section)",
        f"{a}: args.memory.safety_factor: Input should be less than or equal to 1",
        f"{a}: args.deployment: deployment.min_replicas is set but deployment.max_replicas "
        "is not: set both to autoscale",
        f"{a}: args.deployment: deployment.autoscaling_look_back_s must exceed "
        "deployment.autoscaling_metrics_interval_s",
        f"{a}: host: set it at the top level of the file (Ray Serve refuses it in an "
        "application)",
        f"{a}: import_path: 'nocolon' must be module:attribute (one colon) or "
        "module.attribute",
        f"{broken}: applications[2]: expected a mapping with an import_path",
        f"{broken}: application 'b': args.model.engine: cannot import the engine "
        "nowhere.module:Engine: No module named 'nowhere'",
        f"{tmp_path / 'not_yaml.yaml'}:3:1: not valid YAML: expected ',' or ']', but got "
        "'<stream end>'",
        f"{tmp_path / 'absent.yaml'}: cannot read it: No such file or directory",
    ])
    # The valid file among them is still checked and said to be valid.
    assert out.startswith(f"{REPO / 'configs/fake.yaml'}: application 'vramgate': ok (")


def test_the_keys_checked_are_ray_serves() -> None:
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    assert TOP_LEVEL_KEYS == set(ServeDeploySchema.model_fields)
    assert APPLICATION_KEYS == set(ServeApplicationSchema.model_fields)


def test_other_applications_are_checked_as_ray_serve_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "other.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"import_path": "pkg.mod:app"}]}))
    status, out, _ = run_main(capsys, "validate", str(config))
    assert status == 0
    assert out == (f"{config}: application 'default': ok as a Ray Serve application "
                   f"(import_path 'pkg.mod:app' is not {OURS}: its args are not checked)\n")
    status, _, err = run_main(capsys, "plan", str(config))
    assert (status, err) == (1, f"vramgate: {config}: no application has import_path {OURS}\n")


def test_plan_prints_what_plan_deployment_derives(capsys: pytest.CaptureFixture) -> None:
    config = REPO / "configs" / "fake.yaml"
    status, out, _ = run_main(capsys, "plan", str(config))
    assert status == 0
    args = parse_args(yaml.safe_load(config.read_text())["applications"][0]["args"])
    plan = plan_deployment(args, engine_class(args))
    assert out.splitlines()[0] == f"{config}: application 'vramgate'"
    printed = dict(re.findall(r"^  ([a-z_ 0-9]+): +(\S+)", out, re.MULTILINE))
    assert printed["num_gpus"] == "0.5"
    assert printed["budget_bytes"] == str(plan.budget_bytes)
    assert printed["max_ongoing_requests"] == str(plan.max_ongoing_requests)
    assert printed["max_queued_requests"] == str(plan.max_queued_requests)
    assert f"\n  from:                 {plan.how}\n" in out
    assert plan.how == "analytic estimate from fake.device_capacity_bytes x num_gpus"


def test_plan_names_the_measurement_and_refuses_a_broken_config(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dataclasses import replace

    args = parse_args({"model": {"task": "fake"}, "deployment": {"num_gpus": 0.5}})
    engine = engine_class(args)
    measured = replace(plan_deployment(args, engine),
                       how="measured on NVIDIA H200 at 2025-01-01T00:00:00Z (cache key 1a2b)",
                       min_num_gpus=0.25)
    lines = plan_lines("title", args, engine, measured)
    assert lines[-1] == ("  from:                 measured on NVIDIA H200 at "
                         "2025-01-01T00:00:00Z (cache key 1a2b)")
    assert any(line.startswith("  recommended num_gpus: 0.25") for line in lines)

    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(BROKEN))
    status, out, err = run_main(capsys, "plan", str(broken))
    assert (status, out) == (1, "")
    assert len(err.splitlines()) == 11


def test_plan_uses_the_measurement_serve_run_cached(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    import time

    from deployments.replica.profiling import measure_replica
    from serve_app.measurement import (
        Measurement,
        MeasurementCache,
        measurement_identity,
        measurement_key,
    )

    raw_args = {"model": {"task": "fake"}, "deployment": {"num_gpus": 0.5},
                "fake": {"latency_per_token_s": 0},
                "limits": {"max_inputs": 2, "max_input_tokens": 32, "max_tokens": 8},
                "memory": {"measurement_cache_dir": str(tmp_path / "cache")}}
    allocator = "expandable_segments:True"
    config = tmp_path / "gpu.yaml"
    config.write_text(yaml.safe_dump({"applications": [{
        "name": "gpu", "import_path": OURS, "args": raw_args,
        "runtime_env": {"env_vars": {"PYTORCH_CUDA_ALLOC_CONF": allocator}}}]}))
    args = parse_args(raw_args)
    # What serve run's measurement task leaves in the cache (its workers have the setting).
    identity = {**measurement_identity(args, engine_class(args).profile_identity(args)),
                "allocator": allocator}
    measured = measure_replica(args, on_progress=lambda line: None)
    cached = MeasurementCache(args.memory.measurement_cache_dir).put(Measurement(
        key=measurement_key(identity), identity=identity, device_name="NVIDIA H200",
        card_bytes=150 << 30, profile=measured.profile,
        max_request_bytes=measured.max_request_bytes, measured_at=time.time()))

    status, out, _ = run_main(capsys, "plan", str(config))
    assert status == 0
    from_line = next(line for line in out.splitlines() if line.startswith("  from:"))
    assert from_line.split(maxsplit=1)[1] == MeasurementCache(
        args.memory.measurement_cache_dir).get(cached.key).describe()
    assert "cached measurement" in from_line and "on NVIDIA H200 at" in from_line
    assert "  recommended num_gpus: " in out  # the card's size is known from the measurement


def test_plan_and_validate_show_every_model_of_an_app_and_how_they_pack(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "three.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "trio", "import_path": OURS,
                                                        "args": {
        "deployment": {"num_gpus": 0.5},
        "models": [{"model": {"task": "fake", "name": name}}
                   for name in ("embedder", "chat", "speech")]}}]}))
    status, out, _ = run_main(capsys, "plan", str(config))
    assert status == 0
    titles = [line for line in out.splitlines() if line.startswith(str(config))]
    assert titles == [f"{config}: application 'trio', model '{name}'"
                      for name in ("embedder", "chat", "speech")]
    assert out.splitlines()[-3:] == [
        "  GPUs needed:          2   (each replica's num_gpus is a share of one card)",
        "    GPU 0: embedder (0.5), chat (0.5)   (1 of 1)",
        "    GPU 1: speech (0.5)   (0.5 of 1)"]
    assert main(["plan", "--gpus", "2", str(config)]) == 0
    assert main(["plan", "--gpus", "1", str(config)]) == 1
    refused = capsys.readouterr().err
    assert refused.startswith(f"vramgate: {config}: application 'trio': the models' replicas "
                              "need 2 GPUs") and "left over: speech (0.5)" in refused
    status, out, _ = run_main(capsys, "validate", str(config))
    assert out.strip() == (
        f"{config}: application 'trio': ok (fake engine, model 'embedder', num_gpus 0.5 per "
        "replica; fake engine, model 'chat', num_gpus 0.5 per replica; fake engine, model "
        "'speech', num_gpus 0.5 per replica)")


def test_a_key_given_twice_is_reported_where_it_is_with_the_files_other_problems(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "twice.yaml"
    config.write_text(f"applications:\n  - import_path: {OURS}\n    args:\n"
                      "      admission:\n        policy: budget\n"
                      "      admission:\n        max_queue_len: -4\n"
                      "    route_prefix: v1\n")
    status, out, err = run_main(capsys, "validate", str(config))
    assert status == 1 and out == ""
    lines = err.splitlines()
    assert lines[0] == (f"vramgate: {config}:6:7: 'admission' is given again in the same "
                        "mapping (first at line 4); serve run would keep only this one and "
                        "drop the first without a word: merge them")
    # The rest of the file is still checked, with the value serve run would use (the last).
    assert (f"vramgate: {config}: application 'default': route_prefix: 'v1' must start "
            "with '/'") in lines
    assert (f"vramgate: {config}: application 'default': args.admission.max_queue_len: Input "
            "should be greater than or equal to 0") in lines
    assert len(lines) == 3, lines


def test_plan_counts_the_gpus_of_the_fewest_initial_and_most_replicas(
        capsys: pytest.CaptureFixture) -> None:
    """configs/prod.yaml autoscales from 2 to 8 replicas of half a card: 1 GPU holds the
    initial (and fewest) replicas, 4 the most; --gpus is checked against the most."""
    config = REPO / "configs" / "prod.yaml"
    status, out, _ = run_main(capsys, "plan", str(config))
    assert status == 0
    packing = out.splitlines()[out.splitlines().index(next(
        line for line in out.splitlines() if line.startswith("  GPUs needed:"))):]
    name = "all-MiniLM-L6-v2"
    assert packing == [
        "  GPUs needed:          1 at least (2 replicas), 1 initially (2), 4 at most (8)   "
        "(each replica's num_gpus is a share of one card)",
        *[f"    at most, GPU {i}: {name} (0.5), {name} (0.5)   (1 of 1)" for i in range(4)]]
    assert main(["plan", "--gpus", "4", str(config)]) == 0
    capsys.readouterr()
    assert main(["plan", "--gpus", "2", str(config)]) == 1
    refused = capsys.readouterr().err.strip()
    assert refused == (
        f"vramgate: {config}: application 'vramgate': at most (deployment.max_replicas) the "
        "models' replicas need 4 GPUs (their num_gpus shares packed onto whole cards: "
        "vramgate plan shows how), but the cluster has 2; left over: "
        + ", ".join([f"{name} (0.5)"] * 4) + ". The app starts (its initial replicas fit) "
        "but the autoscaler cannot add replicas past what fits. Add GPUs, lower "
        "deployment.num_gpus or max_replicas, or set deployment.wait_for_gpus: true to wait "
        "for GPU nodes to join")


def test_limits_the_models_context_cannot_hold_are_warned_and_planned_capped(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """configs/generate.yaml (max_input_tokens 1024 + max_tokens 256, a P95 prompt of 512)
    on a model of 512 positions: no request of 512 + 256 tokens can exist. validate still
    passes it (the replicas refuse what does not fit), with a warning naming the keys and
    the context; plan prices the largest P95 request that fits: 256 + 256."""
    from serve_app.memory.cost_model import Shape
    from serve_app.pricing import shape_bytes
    from tests.support import build_tiny_causal_lm

    model = build_tiny_causal_lm(tmp_path / "lm", max_positions=512)
    capsys.readouterr()  # the progress bars of saving it
    config = yaml.safe_load((REPO / "configs" / "generate.yaml").read_text())
    config["applications"][0]["args"]["model"]["path"] = str(model)
    path = tmp_path / "generate.yaml"
    path.write_text(yaml.safe_dump(config))
    where = f"{path}: application 'vramgate'"
    warning = (f"vramgate: warning: {where}: limits.max_input_tokens (1024) + limits.max_tokens "
               "(256) exceed the model's context of 512 tokens (max_position_embeddings in "
               "its config.json): a prompt and its completion together hold at most 512 "
               "tokens (more is refused with 400), so requests are planned within it (P95: "
               "1 x 256 tokens + 256 new)")
    status, out, err = run_main(capsys, "validate", str(path))
    assert (status, err.splitlines()) == (0, [warning])
    assert out == (f"{where}: ok (generate engine, model 'local-causal-lm', num_gpus 0 per "
                   "replica)\n")

    status, out, err = run_main(capsys, "plan", str(path))
    assert (status, err.splitlines()) == (0, [warning])
    args = parse_args(config["applications"][0]["args"])
    engine = engine_class(args)
    price = shape_bytes(engine.analytic_costs(args)[0], Shape(1, 256, 256))
    assert f"\n  P95 request:          1 x 256 tokens + 256 new: {price} bytes (" in out
    assert plan_deployment(args, engine).request_bytes == price


def test_a_model_without_an_analytic_cost_model_is_planned_for_that_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A Whisper directory that is there, on CPU: its config is read fine, but the transcribe
    engine prices nothing before a replica has measured it. The plan says so, and leaves
    Ray's cap to the replica's budget (admission.policy budget) instead of a guess of 32
    requests at once, which a CPU budget of gigabytes would outgrow; a semaphore's permits
    still set it."""
    from serve_app.planning import MAX_ONGOING_REQUESTS_CAP
    from tests.support import build_tiny_whisper

    whisper = build_tiny_whisper(tmp_path / "whisper")
    capsys.readouterr()
    raw = {"model": {"engine": "transcribe", "path": str(whisper), "device": "cpu"},
           "memory": {"capacity_bytes": 4 << 30}}
    config = tmp_path / "speech.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "speech", "import_path": OURS,
                                                        "args": raw}]}))
    status, out, err = run_main(capsys, "validate", str(config))
    assert (status, err) == (0, "")
    assert out == (f"{config}: application 'speech': ok (transcribe engine, model 'whisper', "
                   "num_gpus 0 per replica, planned without a price: the transcribe engine "
                   "has no analytic cost model, so each replica measures its own at "
                   "start-up)\n")
    args = parse_args(raw)
    plan = plan_deployment(args, engine_class(args))
    assert plan.how == ("no analytic cost model (the transcribe engine): each replica "
                        "measures its requests' prices at start-up")
    assert plan.max_ongoing_requests == MAX_ONGOING_REQUESTS_CAP
    assert plan.ongoing_text(64) == (f"{MAX_ONGOING_REQUESTS_CAP} admitted (the replica's "
                                     "budget, unknown here) + 64 queued "
                                     "(admission.max_queue_len), capped at 1024")
    semaphore = parse_args({**raw, "admission": {"policy": "semaphore",
                                                 "semaphore_permits": 2}})
    assert plan_deployment(semaphore, engine_class(semaphore)).max_ongoing_requests == 2 + 64
