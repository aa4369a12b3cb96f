"""Scripts run from the repository root as modules (``python -m scripts.gpu_check``)."""
