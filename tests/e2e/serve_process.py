"""``serve run`` started as an operator starts it: a config of this repository moved to a
free port with some of its ``args:`` changed, run in its own session so that
:func:`tests.support.interrupt` stops it as Ctrl-C does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support import as_from_a_terminal

ROOT = Path(__file__).resolve().parents[2]
SERVE = Path(sys.executable).with_name("serve")
RAY = Path(sys.executable).with_name("ray")


def config_file(tmp: Path, source: str, port: int, runtime_env: dict | None = None,
                **args: dict[str, Any]) -> Path:
    """``source`` (a config of this repository) on 127.0.0.1:``port``, with its ``args:``
    sections updated by ``args``."""
    config = yaml.safe_load((ROOT / source).read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    if runtime_env is not None:
        config["applications"][0]["runtime_env"] = runtime_env
    app_args = config["applications"][0]["args"]
    for section, values in args.items():
        app_args[section] = {**app_args.get(section, {}), **values}
    path = tmp / f"{source.replace('/', '_')}-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def serve_run(config: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([str(SERVE), "run", str(config)], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=as_from_a_terminal)
