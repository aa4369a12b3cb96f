"""Measurements made before a deployment is created, and their cache.

``serve run`` of a GPU config measures the model once, on the cluster, with one replica's
resources (:mod:`deployments.cluster.build_measurement`), and derives the deployment's
``max_ongoing_requests`` from it (:func:`serve_app.planning.plan_from_profile`). The result
is cached in ``memory.measurement_cache_dir`` under a key of everything that changes what
would be measured, so a later run of the same config on the same kind of card reuses it.

Pure: no Ray, torch or FastAPI.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.config import AppArgs
from serve_app.memory.profiler import MemoryProfile

logger = logging.getLogger(__name__)

MEASUREMENT_VERSION = 1
#: PyTorch's CUDA caching-allocator settings (https://pytorch.org/docs/stable/notes/cuda.html
#: #optimizing-memory-usage-with-pytorch-cuda-alloc-conf). It changes what a model holds and
#: how memory fragments, so a measurement is only valid under the setting it was made with.
ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def allocator_setting() -> str:
    """This process's ``PYTORCH_CUDA_ALLOC_CONF`` (``""``: PyTorch's defaults)."""
    return os.environ.get(ALLOCATOR_ENV, "")


def measured_before_deploy(args: AppArgs) -> bool:
    """Whether the deployment of ``args`` is planned from a measurement made on the cluster:
    GPU replicas (``deployment.num_gpus`` > 0), ``memory.measure_before_deploy``, and no
    ``memory.profile_path`` of the operator's."""
    mem = args.memory
    return args.deployment.num_gpus > 0 and mem.measure_before_deploy and not mem.profile_path


def measurement_identity(args: AppArgs, model_identity: str) -> dict[str, Any]:
    """What a measurement of ``args`` depends on, apart from the device it runs on: the
    engine and model (``model_identity``: the model directory, or the engine's own name),
    the model section (dtype, device, chat template...), the replica's GPU share, the limits
    (the largest request profiled), the capacity override, the fake engine's costs (its
    simulated card; the defaults for any other engine), and the allocator setting of the
    process that measures."""
    return {
        "version": MEASUREMENT_VERSION,
        "engine": args.model.engine_name, "model": model_identity,
        "model_section": args.model.model_dump(mode="json"),
        "num_gpus": args.deployment.num_gpus,
        "limits": args.limits.model_dump(mode="json"),
        "capacity_bytes": args.memory.capacity_bytes,
        "fake": args.fake.model_dump(mode="json"),
        "allocator": allocator_setting(),
    }


def measurement_key(identity: dict[str, Any]) -> str:
    """A short stable digest of ``identity`` (16 hex digits of SHA-256 of its sorted JSON)."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One measurement of a model with one replica's resources.

    Attributes:
        key: :func:`measurement_key` of ``identity``.
        identity: :func:`measurement_identity` of the config it was made for.
        device_name: the card it ran on (e.g. ``NVIDIA H200``, or the simulated card).
        card_bytes: that card's total memory, bytes.
        profile: the memory profile (held bytes, fitted cost model, every point).
        max_request_bytes: the price of the largest request the limits allow, bytes.
        measured_at: when (Unix time, seconds).
        reused: this run found it in the cache rather than measuring.
        profile_path: where the profile alone is saved, for ``memory.profile_path``
            (``""``: not saved).
    """

    key: str
    identity: dict[str, Any]
    device_name: str
    card_bytes: int
    profile: MemoryProfile
    max_request_bytes: int
    measured_at: float
    reused: bool = False
    profile_path: str = ""

    def summary(self) -> dict[str, Any]:
        """What ``/v1/status`` and ``vramgate plan`` show of it."""
        return {"key": self.key, "device": self.device_name, "card_bytes": self.card_bytes,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                             time.gmtime(self.measured_at)),
                "reused": self.reused, "allocator": self.identity.get("allocator", ""),
                "profile_path": self.profile_path}

    def describe(self) -> str:
        """One line: where the figures came from."""
        how = "cached measurement" if self.reused else "measurement"
        return (f"{how} {self.key} on {self.device_name} at "
                f"{self.summary()['measured_at']}")

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "identity": self.identity, "device_name": self.device_name,
                "card_bytes": self.card_bytes, "profile": self.profile.to_dict(),
                "max_request_bytes": self.max_request_bytes, "measured_at": self.measured_at}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], profile_path: str = "") -> Measurement:
        return cls(key=raw["key"], identity=raw["identity"], device_name=raw["device_name"],
                   card_bytes=int(raw["card_bytes"]),
                   profile=MemoryProfile.from_dict(raw["profile"]),
                   max_request_bytes=int(raw["max_request_bytes"]),
                   measured_at=float(raw["measured_at"]), reused=True, profile_path=profile_path)


class MeasurementCache:
    """Measurements saved as ``<dir>/<key>.json``, with the profile alone beside it as
    ``<dir>/<key>.profile.json`` (what a replica reads through ``memory.profile_path``).

    Args:
        directory: ``memory.measurement_cache_dir`` (``~`` expanded; created on first save).
            On a multi-node cluster, a directory every node mounts lets any node reuse it.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).expanduser()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str, device: tuple[str, int] | None = None) -> Measurement | None:
        """The cached measurement under ``key`` (``None``: none, or unreadable: logged), made
        on a card of the same name and size when ``device`` (name, total bytes) is given."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            found = Measurement.from_dict(json.loads(path.read_text()),
                                          str(self._profile_path(key)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("cannot use the cached measurement %s: %s", path, exc)
            return None
        if device is not None and (found.device_name, found.card_bytes) != device:
            logger.info("cached measurement %s was made on %s (%d bytes), not %s (%d bytes)",
                        path, found.device_name, found.card_bytes, *device)
            return None
        return found

    def put(self, measurement: Measurement) -> Measurement:
        """Save ``measurement`` (atomically: a reader never sees half a file); return it
        with its ``profile_path``. An unwritable directory is logged, not raised: the
        measurement still serves this run."""
        profile_path = self._profile_path(measurement.key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_atomically(profile_path, json.dumps(measurement.profile.to_dict(), indent=2))
            _write_atomically(self.path(measurement.key),
                              json.dumps(measurement.to_dict(), indent=2))
        except OSError as exc:
            logger.warning("cannot cache the measurement in %s: %s", self.directory, exc)
            return measurement
        return Measurement(**{**measurement.__dict__, "profile_path": str(profile_path)})

    def _profile_path(self, key: str) -> Path:
        return self.directory / f"{key}.profile.json"


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text + "\n")
    temporary.replace(path)
