#!/usr/bin/env bash
# The GPU check, end to end, on a machine with one CUDA GPU (about 5 minutes):
# install, then profile a ~1B-parameter fp16 model and burst two half-card replicas.
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv /tmp/vramgate-gpu-venv
. /tmp/vramgate-gpu-venv/bin/activate
pip install -q -e '.[dev]'
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
PYTHONUNBUFFERED=1 python -m pytest tests/gpu -v -s -p no:cacheprovider
