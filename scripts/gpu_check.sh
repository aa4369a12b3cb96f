#!/usr/bin/env bash
# The GPU check without Ray (one table; see scripts/gpu_check/__init__.py): bash scripts/gpu_check.sh [--device cuda|cpu] [--quick] [--json PATH]
#
# Where pydantic is missing (the lent GPU machine: no registry) it installs the wheels that
# scripts/gpu_wheels.sh downloaded into .gpu-wheels/ (carry that folder) into /tmp/gpu-site,
# outside the machine's own environment, and puts that folder on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import pydantic" 2>/dev/null; then
    if [ ! -d .gpu-wheels ]; then
        echo "pydantic is missing and there is no .gpu-wheels/: run scripts/gpu_wheels.sh" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-site .gpu-wheels/*.whl
    export PYTHONPATH=/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
PYTHONUNBUFFERED=1 exec "$PY" -m scripts.gpu_check "$@"
