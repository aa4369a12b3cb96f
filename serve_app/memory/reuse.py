"""When a saved memory profile may stand for a fresh measurement: the one rule, applied where
the app is planned (identity only: no device there) and by each replica before it skips
profiling (identity and what it measured).

Pure: no Ray, torch or FastAPI.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from serve_app.memory.cost_model import Shape
from serve_app.memory.profiler import MemoryProfile

# A saved profile is reused only while the device still offers at least this share of the
# capacity it was measured with, and the loaded model holds about what it held then.
REUSE_MIN_CAPACITY_RATIO = 0.95
REUSE_HELD_TOLERANCE = 0.25


def device_kind_of(method: str, device: str) -> str:
    """``simulated``, ``cpu`` or ``cuda``: the kind of device a probe's (or a profile's)
    ``method`` and ``device`` describe."""
    if method.startswith("simulated"):
        return "simulated"
    return "cpu" if device == "cpu" else "cuda"


def profile_device_kind(profile: MemoryProfile) -> str:
    """The kind of device ``profile`` was measured on (:func:`device_kind_of`)."""
    return device_kind_of(profile.method, profile.device)


@dataclass(frozen=True)
class ExpectedProfile:
    """What a profile must have been measured for to be reused.

    Attributes:
        task: the engine's name (``model.task``, or ``model.engine``).
        model_path: the model directory (or the engine's own identity, e.g. ``fake``).
        device_kind: ``simulated``, ``cpu`` or ``cuda``.
        device: the exact device (a replica's probe), or ``None`` where unknown.
        capacity_bytes: the device's capacity now, or ``None`` where unknown.
        held_bytes: what the loaded model holds now, or ``None`` where unknown.
        largest: the largest request the limits allow now, or ``None`` where unknown.
    """

    task: str
    model_path: str
    device_kind: str
    _: KW_ONLY
    device: str | None = None
    capacity_bytes: int | None = None
    held_bytes: int | None = None
    largest: Shape | None = None


def reuse_problems(saved: MemoryProfile, expected: ExpectedProfile) -> list[str]:
    """Why ``saved`` cannot stand for a measurement ``expected`` describes (empty: it can).

    A profile is reused for the same engine, model and kind of device (and, where known,
    the same device), measured up to at least the largest request the limits allow, on a
    device offering at least ``REUSE_MIN_CAPACITY_RATIO`` of the capacity it had then, with
    the model holding within ``REUSE_HELD_TOLERANCE`` of what it held then.
    """
    problems = []
    where = (saved.task, saved.model_path, profile_device_kind(saved))
    wanted = (expected.task, expected.model_path, expected.device_kind)
    if where != wanted or (expected.device is not None and saved.device != expected.device):
        problems.append(f"measured for {saved.task} {saved.model_path} on {saved.device}, "
                        f"not {expected.task} {expected.model_path} on "
                        f"{expected.device or 'a ' + expected.device_kind + ' device'}")
    if expected.largest is not None:
        measured_up_to = tuple(max(getattr(p, f) for p in saved.points)
                               for f in ("batch", "prompt_tokens", "new_tokens"))
        if any(want > have for want, have in zip(expected.largest, measured_up_to,
                                                 strict=True)):
            problems.append(f"it was measured up to {measured_up_to} (batch, prompt, new "
                            f"tokens), the limits now allow {tuple(expected.largest)}")
    capacity = expected.capacity_bytes
    if capacity is not None and capacity < REUSE_MIN_CAPACITY_RATIO * saved.capacity_bytes:
        problems.append(f"capacity now {capacity} bytes, measured with "
                        f"{saved.capacity_bytes}")
    held = expected.held_bytes
    if held is not None and abs(held - saved.held_bytes) > \
            REUSE_HELD_TOLERANCE * max(saved.held_bytes, 1):
        problems.append(f"the model holds {held} bytes now, {saved.held_bytes} then")
    return problems
