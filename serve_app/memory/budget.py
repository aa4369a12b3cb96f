"""The replica's byte budget from what it measured."""

from __future__ import annotations


class InsufficientMemoryError(RuntimeError):
    """The device cannot hold even one largest request: the replica must not start."""


def budget_formula_bytes(capacity_bytes: int, held_bytes: int, reserve_bytes: int,
                         safety_factor: float) -> int:
    """``int((capacity - held - reserve) x safety_factor)`` (may be <= 0): the replica's budget,
    the one formula behind :func:`derive_budget_bytes` and the planned estimate
    (:mod:`serve_app.planning`)."""
    return int((capacity_bytes - held_bytes - reserve_bytes) * safety_factor)


def derive_budget_bytes(capacity_bytes: int, held_bytes: int, reserve_bytes: int,
                        safety_factor: float, min_request_bytes: int = 0,
                        override_bytes: int | None = None) -> int:
    """``(capacity - held - reserve) * safety_factor`` (:func:`budget_formula_bytes`), checked.

    Args:
        capacity_bytes: the replica's share of the device (CUDA: its fraction of the card; CPU:
            ``memory.capacity_bytes`` or a fraction of available RAM).
        held_bytes: what the loaded model and runtime already hold.
        reserve_bytes: left untouched for the runtime and other processes.
        safety_factor: fraction of the rest the budget may use, in (0, 1].
        min_request_bytes: the largest single request the config allows; the budget must hold it.
        override_bytes: ``memory.budget_bytes``: use this instead of the derived figure, provided
            it fits in ``capacity - held - reserve``. An explicit budget may be smaller than
            the largest allowed request (the operator's choice): such requests are then
            refused with 400 ``request_too_large`` instead of the replica refusing to start.

    Raises:
        InsufficientMemoryError: the derived budget would be <= 0 or smaller than
            ``min_request_bytes``, or an override is larger than the device has left; the
            message names what to change.
    """
    available = capacity_bytes - held_bytes - reserve_bytes
    formula = (f"(capacity {capacity_bytes} - held {held_bytes} - reserve {reserve_bytes})")
    if override_bytes is not None:
        if override_bytes > available:
            raise InsufficientMemoryError(
                f"memory.budget_bytes={override_bytes} exceeds what the device has left, "
                f"{formula} = {available} bytes. Lower memory.budget_bytes or raise "
                "memory.capacity_bytes (or num_gpus).")
        return override_bytes
    budget = budget_formula_bytes(capacity_bytes, held_bytes, reserve_bytes, safety_factor)
    if budget <= 0 or budget < min_request_bytes:
        raise InsufficientMemoryError(
            f"budget of {budget} bytes = {formula} x safety {safety_factor} cannot hold the "
            f"largest allowed request ({min_request_bytes} bytes). Raise memory.capacity_bytes "
            "(or num_gpus), lower memory.reserve_bytes, or lower limits.max_inputs / "
            "limits.max_input_tokens.")
    return budget
