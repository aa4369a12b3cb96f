"""The replica's real device: which one it is, its dtype, and the probe that measures it."""

from __future__ import annotations

import psutil
import torch

from serve_app.config import AppArgs
from serve_app.memory.probes import CudaMemoryProbe, DeviceProbe, HostMemoryProbe


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
    return device


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
    measures its ``num_gpus`` share of the card."""
    if device == "cuda":
        return CudaMemoryProbe(share=args.deployment.num_gpus or 1.0,
                               capacity_override_bytes=args.memory.capacity_bytes)
    return HostMemoryProbe(args.memory.capacity_bytes, args.memory.host_fraction)
