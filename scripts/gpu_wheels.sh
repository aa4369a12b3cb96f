#!/usr/bin/env bash
# Download the wheels the lent GPU machine lacks into .gpu-wheels/ (run here, where PyPI is reachable): bash scripts/gpu_wheels.sh
#
# That machine runs Python 3.12 (x86-64, manylinux) with its own torch, transformers,
# sentence-transformers, numpy, psutil, prometheus-client, pyyaml and httpx, reaches no
# package registry, and has no pydantic or redis (nor Ray or FastAPI, which the check does
# not use). What `python -m scripts.gpu_check` imports that it lacks is pydantic and its needs:
# pydantic-core (compiled: the cp312 manylinux wheel), annotated-types and typing-inspection;
# typing-extensions too, since pydantic needs a recent one and the machine's version is not
# known; and redis (pure Python), which tests/support.py imports (the check builds its models
# with it). Versions are those of this checkout's .venv where it has them (what the tests ran).
#
# Then one device `run`, with carry [".gpu-wheels"] (the wheels travel with the working tree,
# 64 MiB in all; this script checks the total):
#   bash scripts/gpu_check.sh --device cuda --json $OUT/gpu_check.json
# which installs them with `pip install --no-index --no-deps --target /tmp/gpu-site` and puts
# /tmp/gpu-site on PYTHONPATH (nothing is written into the machine's own environment).
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions redis)
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
mapfile -t SPECS < <("$PY" - "${PACKAGES[@]}" <<'PYTHON'
import sys
from importlib.metadata import PackageNotFoundError, version

for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PYTHON
)
rm -rf .gpu-wheels
mkdir .gpu-wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu-wheels "${SPECS[@]}"
ls -1 .gpu-wheels
# What the device call sends: tracked + untracked-not-ignored files, plus the carried folder.
"$PY" - <<'PYTHON'
import os
import subprocess
import sys

listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.decode().split("\0")
tree = sum(os.path.getsize(p) for p in set(listed) if p and os.path.isfile(p))
wheels = sum(e.stat().st_size for e in os.scandir(".gpu-wheels"))
total, limit = tree + wheels, 64 << 20
print(f"working tree {tree / 2**20:.1f} MiB + .gpu-wheels {wheels / 2**20:.1f} MiB = "
      f"{total / 2**20:.1f} MiB (limit 64 MiB)")
sys.exit(0 if total <= limit else 1)
PYTHON
