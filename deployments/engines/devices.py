"""The replica's real device: which one it is, its dtype, and the probe that measures it."""

from __future__ import annotations

import logging
import os

import psutil
import torch

from serve_app.config import AppArgs
from serve_app.memory.probes import CudaMemoryProbe, DeviceProbe, HostMemoryProbe

logger = logging.getLogger("ray.serve")

ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DEFAULT_CUDA_ALLOC_CONF = "expandable_segments:True"
"""PyTorch's CUDA allocator setting a replica uses unless its environment sets one: the
caching allocator then grows one segment page by page instead of keeping a segment per size
class, which fragments less under requests of many sizes. Measured on an H200 (the GPU check,
docs/profiling.md): a burst of 48 mixed completions grew the reserved pool 198 MiB with the
default allocator and 166 MiB with expandable segments, for 131 and 122 MiB of live tensors
(https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)."""


class DeviceUnavailableError(RuntimeError):
    """The config asks for a device this process does not have (a refusal: retrying the
    same replica on the same node fails the same way)."""


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when CUDA is usable in this process, else ``cpu``.

    Raises:
        DeviceUnavailableError: ``cuda`` was asked for but is not available.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(
            "model.device is 'cuda' but CUDA is not available to this replica (no GPU on its "
            f"node, or torch {torch.__version__} has no CUDA): run it on a GPU node with "
            "deployment.num_gpus > 0, or serve on CPU (model.device: cpu, "
            "deployment.num_gpus: 0)")
    if device == "cuda":
        default_cuda_allocator()
    return device


def default_cuda_allocator() -> None:
    """Use :data:`DEFAULT_CUDA_ALLOC_CONF` unless ``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` is set (an operator's own setting always wins; set either to
    ``expandable_segments:False`` for PyTorch's default). Only before CUDA initialises: the
    allocator reads its setting once, then (logged, nothing changed)."""
    if any(os.environ.get(name) for name in ALLOCATOR_ENV):
        return
    if torch.cuda.is_initialized():
        logger.info("CUDA is already initialised in this process: its allocator keeps "
                    "PyTorch's default (set PYTORCH_CUDA_ALLOC_CONF=%s before it starts)",
                    DEFAULT_CUDA_ALLOC_CONF)
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_CUDA_ALLOC_CONF


def device_identity(device: str) -> tuple[str, int]:
    """``(name, total bytes)`` of ``device`` (``cpu`` or ``cuda``) in this process: the
    card's name and memory (``torch.cuda.get_device_properties``), or the host's RAM."""
    if device == "cuda":
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        return properties.name, int(properties.total_memory)
    return "cpu", int(psutil.virtual_memory().total)


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` -> float16 on CUDA, float32 on CPU."""
    if dtype == "auto":
        return "float16" if device == "cuda" else "float32"
    return dtype


def make_probe(device: str, args: AppArgs) -> DeviceProbe:
    """The probe for ``device`` (``cpu`` or ``cuda``), sized by the config: a GPU replica
    measures its ``num_gpus`` share of the card, and its allocator is capped there
    (:meth:`~serve_app.memory.probes.CudaMemoryProbe.limit_to_capacity`)."""
    if device == "cuda":
        probe = CudaMemoryProbe(share=args.deployment.num_gpus or 1.0,
                                capacity_override_bytes=args.memory.capacity_bytes)
        probe.limit_to_capacity()
        return probe
    return HostMemoryProbe(args.memory.capacity_bytes, args.memory.host_fraction)
