"""``python -m serve_app profile``: argument handling, and one real run on the packaged MiniLM.
Every error is one line on stderr and exit status 1 (tests/unit/test_cli_validate.py: the
``validate`` and ``plan`` commands)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.engines.registry import engine_class
from serve_app.__main__ import main
from serve_app.cli import EXIT_FAILED
from serve_app.cli.profile import profiling_args
from serve_app.cli.serve_config import read_application
from serve_app.config import parse_args
from serve_app.memory.budget import InsufficientMemoryError
from serve_app.memory.profiler import MemoryProfile
from serve_app.planning import MAX_ONGOING_REQUESTS_CAP, plan_deployment, plan_from_profile

REPO = Path(__file__).resolve().parents[2]
OURS = "serve_app.app:build_app"


def write_config(tmp_path: Path, *apps: dict) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": list(apps)}))
    return path


def run_main(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """Exit status and stderr of ``main(argv)`` (errors there: ``vramgate: ...`` lines)."""
    status = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return status, err


# --- argument handling (no model is loaded) ---------------------------------------------------


@pytest.mark.parametrize("command", [[], ["validate"], ["plan"], ["profile"]])
def test_help_is_plain_text(capsys: pytest.CaptureFixture, command: list[str]) -> None:
    """A terminal shows no reStructuredText: the module docstring's ``code`` marks."""
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vramgate") and "`" not in out
    if not command:
        assert "\npython -m serve_app (or vramgate): command-line tools for operators.\n" in out


def test_a_missing_config_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status, err = run_main(capsys, "profile", "--config", str(tmp_path / "absent.yaml"))
    assert status == EXIT_FAILED == 1
    assert err == (f"vramgate: {tmp_path / 'absent.yaml'}: cannot read it: "
                   "No such file or directory\n")


def test_a_file_that_is_not_a_serve_config_exits_1(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- just\n- a list\n")
    status, err = run_main(capsys, "profile", "--config", str(path))
    assert status == 1
    assert "not a serve run config" in err


def test_an_unknown_app_name_exits_1_and_lists_the_names(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_config(tmp_path, {"name": "a", "import_path": OURS},
                        {"name": "b", "import_path": OURS})
    status, err = run_main(capsys, "profile", "--config", str(path), "--app", "c")
    assert status == 1
    assert "no application named 'c' (it has 'a', 'b')" in err


def test_an_app_that_is_not_vramgate_exits_1(tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    path = write_config(tmp_path, {"name": "other", "import_path": "elsewhere:app"})
    status, err = run_main(capsys, "profile", "--config", str(path), "--app", "other")
    assert status == 1
    assert "'other' has import_path 'elsewhere:app'" in err
    status, err = run_main(capsys, "profile", "--config", str(path))
    assert status == 1
    assert f"no application has import_path {OURS}" in err


def test_an_engine_that_sizes_its_own_kv_cache_is_not_profiled(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from tests.support import build_tiny_causal_lm

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # importable: no engine
    model = build_tiny_causal_lm(tmp_path / "lm", hidden_size=128, num_heads=2)
    capsys.readouterr()  # what saving the model printed (transformers 5.19: a progress bar)
    out = tmp_path / "profile.json"
    path = write_config(tmp_path, {"name": "v", "import_path": OURS, "args": {
        "model": {"engine": "vllm", "path": str(model), "device": "cpu"},
        "deployment": {"num_gpus": 0}}})
    status, err = run_main(capsys, "profile", "--config", str(path), "--out", str(out))
    assert status == EXIT_FAILED
    assert err == ("vramgate profile: the vllm engine is not profiled: it sizes its own KV "
                   "cache and a replica's budget is that pool, read at start-up; no profile "
                   "was written\n")
    assert not out.exists()


@pytest.mark.parametrize("bad_args, key", [
    ({"admission": {"max_queu_len": 1}}, "args.admission.max_queu_len: unknown key"),
    ({"memory": {"safety_factor": 2}}, "args.memory.safety_factor: Input should be less"),
])
def test_invalid_args_exit_1_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture,
                                            bad_args: dict, key: str) -> None:
    path = write_config(tmp_path, {"name": "x", "import_path": OURS, "args": bad_args})
    status, err = run_main(capsys, "profile", "--config", str(path))
    assert status == 1
    assert err.startswith(f"vramgate: {path}: application 'x': {key}")


@pytest.mark.parametrize("argv", [[], ["frob"], ["profile"], ["validate"]])
def test_a_bad_command_line_is_one_line_and_exit_1(capsys: pytest.CaptureFixture,
                                                    argv: list[str]) -> None:
    status, err = run_main(capsys, *argv)
    assert status == 1
    assert len(err.splitlines()) == 1 and re.search(r"\(see vramgate( \w+)? --help\)\n$", err)


def test_an_unexpected_error_is_one_line_naming_its_type(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import deployments.replica.profiling

    def fail(args, on_progress):
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    monkeypatch.setattr(deployments.replica.profiling, "measure_replica", fail)
    path = write_config(tmp_path, {"name": "x", "import_path": OURS,
                                   "args": {"model": {"task": "fake"}}})
    status, err = run_main(capsys, "profile", "--config", str(path))
    assert status == 1
    assert err.splitlines()[-1] == ("vramgate: unexpected RuntimeError: CUDA error: an illegal "
                                    "memory access was encountered")


def test_a_gpu_replica_is_not_profiled_without_cuda(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, err = run_main(capsys, "profile", "--config", str(REPO / "configs" / "prod.yaml"))
    assert status == 1
    assert err.startswith("vramgate: ") and len(err.splitlines()) == 1
    assert "model.device is cuda but this machine has no CUDA device; run vramgate profile " \
           "on a GPU node" in err
    args = {"deployment": {"num_gpus": 0.5}}  # device auto: the replicas get a GPU
    path = write_config(tmp_path, {"name": "x", "import_path": OURS, "args": args})
    status, err = run_main(capsys, "profile", "--config", str(path))
    assert status == 1
    assert "deployment.num_gpus is 0.5 (the replicas run on a GPU) but this machine has no " \
           "CUDA device" in err


def test_the_default_application_is_the_first_vramgate_one(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"name": "other", "import_path": "elsewhere:app"},
                        {"name": "first", "import_path": OURS, "args": {"model": {"name": "m"}}},
                        {"name": "second", "import_path": OURS})
    first, second = read_application(path, None), read_application(path, "second")
    assert (first.name, first.raw_args) == ("first", {"model": {"name": "m"}})
    assert (second.name, second.raw_args) == ("second", {})


def test_the_measurement_is_fresh_and_on_the_replicas_device() -> None:
    cpu = profiling_args(parse_args({"memory": {"profile_path": "old.json"}}))
    assert cpu.memory.profile_path == ""
    assert cpu.model.device == "cpu"  # auto without num_gpus: the replica sees no GPU
    gpu = profiling_args(parse_args({"deployment": {"num_gpus": 0.5}}))
    assert gpu.model.device == "auto"


def test_insufficient_memory_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import deployments.replica.profiling

    def refuse(args, on_progress):
        raise InsufficientMemoryError("budget of -5 bytes cannot hold the largest request")

    monkeypatch.setattr(deployments.replica.profiling, "measure_replica", refuse)
    path = write_config(tmp_path, {"name": "x", "import_path": OURS})
    status, err = run_main(capsys, "profile", "--config", str(path))
    assert status == 1
    assert err.endswith("\nvramgate: insufficient memory: budget of -5 bytes cannot hold the "
                        "largest request\n")  # after the progress lines
    assert not (tmp_path / "profiles").exists()


# --- a real run: load MiniLM on CPU, profile a small ladder, recommend, save ------------------


def test_profile_the_packaged_minilm(tmp_path: Path) -> None:
    raw = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    app = raw["applications"][0]
    app["args"]["limits"].update(max_inputs=4, max_input_tokens=32)  # a small, fast ladder
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "p.json"

    done = subprocess.run(
        [sys.executable, "-m", "serve_app", "profile", "--config", str(config), "--out",
         str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)

    assert done.returncode == 0, done.stderr
    assert "profiled 1/" in done.stderr  # progress goes to stderr
    stdout = done.stdout
    assert "device:   cpu" in stdout
    assert "method:   host RSS" in stdout
    profile = MemoryProfile.load(out)
    assert len(profile.points) >= 5 and any(p.held_out for p in profile.points)
    assert profile.device == "cpu" and profile.capacity_bytes == 2147483648

    # The printed recommendation is plan_from_profile's, and a config using the saved
    # profile plans exactly that.
    args = parse_args(app["args"])
    expected = plan_from_profile(args, profile, engine_class(args).kinds)
    printed = {key: re.search(rf"^  {key}: (\S+)", stdout, re.MULTILINE).group(1)
               for key in ("max_ongoing_requests", "budget_bytes", "num_gpus")}
    assert printed == {"max_ongoing_requests": str(expected.max_ongoing_requests),
                       "budget_bytes": str(expected.budget_bytes), "num_gpus": "0"}
    smallest = profile.cost_model.request_bytes(1, 1)
    assert expected.max_ongoing_requests == min(
        MAX_ONGOING_REQUESTS_CAP,
        expected.budget_bytes // smallest + args.admission.max_queue_len)
    assert f"    profile_path: {out}" in stdout
    with_profile = args.model_copy(update={"memory": args.memory.model_copy(
        update={"profile_path": str(out)})})
    planned = plan_deployment(with_profile, engine_class(with_profile))
    assert planned.max_ongoing_requests == expected.max_ongoing_requests
    assert planned.how == f"measured profile {out}"


def test_profile_the_fake_engine_recommends_a_share_of_its_card(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = {"model": {"task": "fake"}, "deployment": {"num_gpus": 0.5},
            "fake": {"device_capacity_bytes": 16 << 30, "weights_bytes": 1 << 30,
                     "latency_per_token_s": 0},
            "limits": {"max_inputs": 4, "max_input_tokens": 64, "max_tokens": 32}}
    config = write_config(tmp_path, {"name": "fake", "import_path": OURS, "args": args})
    out = tmp_path / "fake.json"

    assert main(["profile", "--config", str(config), "--out", str(out)]) == 0

    stdout = capsys.readouterr().out
    profile = MemoryProfile.load(out)
    assert profile.task == "fake" and profile.held_bytes == 1 << 30
    # P95: 4 x 64 tokens (256 MiB at 1 MiB per token) costs more than 1 x 64 + 32 new.
    assert "P95 request (4 x 64 tokens or 1 x 64 tokens + 32 new)" in stdout
    assert "largest request (4 x 64 tokens + 32 new)" in stdout
    budget = int(((8 << 30) - (1 << 30)) * 0.9)
    assert f"  budget_bytes: {budget}" in stdout
    running = budget // profile.cost_model.request_bytes(4, 64)
    assert running == 25
    # Ray's cap: what the budget admits at once (the smallest request, 1 token, costs
    # 1 MiB), capped.
    assert budget // (1 << 20) + 64 > MAX_ONGOING_REQUESTS_CAP
    assert f"  max_ongoing_requests: {MAX_ONGOING_REQUESTS_CAP}   # {budget // (1 << 20)} " \
        "admitted (budget // smallest request) + 64 queued" in stdout
    # 1 GiB held + 25 x 256 MiB / 0.9 = 8135 MiB of the 16 GiB card: 0.4965, so 0.5.
    assert "  num_gpus: 0.5   # smallest 0.05 of the card" in stdout


def test_running_out_of_memory_while_profiling_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # The largest request, 4 x (64 + 32) tokens at 1 MiB each, is more than the 256 MiB card.
    args = {"model": {"task": "fake"},
            "fake": {"device_capacity_bytes": 256 << 20, "weights_bytes": 0,
                     "latency_per_token_s": 0},
            "limits": {"max_inputs": 4, "max_input_tokens": 64, "max_tokens": 32}}
    config = write_config(tmp_path, {"name": "fake", "import_path": OURS, "args": args})
    status, err = run_main(capsys, "profile", "--config", str(config),
                           "--out", str(tmp_path / "p.json"))
    assert status == 1
    assert "profiling ran out of device memory" in err
    assert "Lower limits.max_inputs" in err
    assert not (tmp_path / "p.json").exists()


FAKE_PROFILE_ARGS = {
    "model": {"task": "fake"}, "deployment": {"num_gpus": 0.5},
    "fake": {"latency_per_token_s": 0},
    "limits": {"max_inputs": 4, "max_input_tokens": 64, "max_tokens": 32}}
TABLE_HEADER = ("inputs prompt_tokens new_tokens measured MiB fitted MiB  error analytic MiB "
                "spread MiB seconds  set")


def test_the_profile_table_says_its_units_and_is_printed_once(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, {"name": "fake", "import_path": OURS,
                                     "args": FAKE_PROFILE_ARGS})
    assert main(["profile", "--config", str(config), "--out", str(tmp_path / "p.json")]) == 0
    out, err = capsys.readouterr()
    assert out.count(TABLE_HEADER) == 1 and "measured" not in err  # the report only
    rows = out.split(TABLE_HEADER + "\n")[1].split("\n\n")[0].splitlines()
    assert len(rows) == len(MemoryProfile.load(tmp_path / "p.json").points)


def test_a_replica_logs_the_profile_table_with_its_units(caplog: pytest.LogCaptureFixture) -> None:
    from deployments.replica.profiling import measure_replica

    progress: list[str] = []
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        measured = measure_replica(parse_args(FAKE_PROFILE_ARGS), on_progress=progress.append)
    [logged] = [r.getMessage() for r in caplog.records if "memory profile" in r.getMessage()]
    assert logged == "memory profile:\n" + measured.profile.table()
    assert logged.splitlines()[1] == TABLE_HEADER
    assert progress and not any("measured" in line for line in progress)
