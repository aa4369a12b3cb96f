"""The GPU check, without Ray: the real engines on the device, the profiler and a held-out
check against the device's own counters, the admission gate + batcher + inference thread
under a concurrent burst of mixed sizes, their throughput beside the bare model's batched
calls (:mod:`.throughput`), and a forced real out-of-memory error caught and recovered
from, once per CUDA allocator setting (default, then ``expandable_segments``), each in its
own process; the figures are printed as one table and the exit status is 1 if any check
failed.

    python -m scripts.gpu_check [--device cpu|cuda] [--quick] [--settings ...] [--json PATH]

``--device`` defaults to ``cuda`` where CUDA is available, else ``cpu``. On CPU it runs the
same scenarios on the simulated device (the fake engine: every figure exact) and the real
engines on tiny random-weight models (host RSS: shown, not checked), in well under a minute;
``tests/unit/test_gpu_check.py`` runs it there with ``--quick``. On CUDA: a ~1.1B-parameter
fp16 Llama serving completions and a ~0.3B fp16 BERT serving embeddings, each on half the
card (``--quick``: ~0.2B and ~0.1B). What is checked, and where each bound comes from:
:mod:`.plan` and :mod:`.scenarios`.

On the lent GPU machine (Python 3.12 with its own torch and transformers, no registry, no
Ray, no pydantic): ``bash scripts/gpu_wheels.sh`` here first (it downloads the few wheels
the machine lacks into ``.gpu-wheels/``), then one device call with ``carry:
[".gpu-wheels"]``:

    bash scripts/gpu_check.sh --device cuda --json $OUT/gpu_check.json

(``scripts/gpu_check.sh`` installs the carried wheels with ``pip install --no-index
--target /tmp/gpu-site`` and puts that folder on ``PYTHONPATH`` when pydantic is missing; on
an H200 one allocator setting took about 3 minutes, model building included, and the check
stops itself at 7.) What the first run measured: docs/profiling.md, "Measured on a GPU".
The Ray end-to-end part (two half-card replicas behind Ray Serve) stays in ``tests/gpu/``
for machines that have Ray (``python -m pytest tests/gpu``).
"""
