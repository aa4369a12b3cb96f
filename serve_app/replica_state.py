"""A model replica's state as one typed value, and the three views others read of it.

The replica builds one :class:`ReplicaState` whenever it reports; ``GET /v1/status`` shows
:meth:`~ReplicaState.to_status`, the budget-aware request router reads
:meth:`~ReplicaState.to_routing_stats` (Ray Serve's ``record_routing_stats``) and the
autoscaling policy :meth:`~ReplicaState.to_autoscaling_stats` (``record_autoscaling_stats``).
The keys of those two views are declared here once, and their readers
(:mod:`serve_app.routing`, :mod:`deployments.cluster.autoscaling`) import them from here.

Pure: no Ray, torch or FastAPI.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# --- routing stats (record_routing_stats) ---------------------------------------------------
ROUTING_BYTES_KEYS = ("budget_bytes", "reserved_bytes", "free_bytes", "queued_bytes")
"""Byte figures (the gate's units) a replica reports to the router (ints >= 0)."""
ROUTING_QUEUE_DEPTH_KEY = "queue_depth"
"""Requests waiting in the replica's admission FIFO (int >= 0)."""
ROUTING_MEASURED_AT_KEY = "measured_at_unix_s"
"""When the replica took its figures: ``time.time()`` on the replica (float seconds)."""

# --- autoscaling stats (record_autoscaling_stats) -------------------------------------------
# Prefixed: Ray stores custom metrics beside its own (``running_requests``) in one dict per
# replica; values must all be numbers, or Ray turns custom metrics off for the replica.
AUTOSCALING_QUEUE_DEPTH_KEY = "vramgate_queue_depth"
AUTOSCALING_QUEUED_BYTES_KEY = "vramgate_queued_bytes"
AUTOSCALING_RESERVED_BYTES_KEY = "vramgate_reserved_bytes"
AUTOSCALING_BUDGET_BYTES_KEY = "vramgate_budget_bytes"
AUTOSCALING_RUNNING_REQUESTS_KEY = "vramgate_running_requests"
AUTOSCALING_JOBS_QUEUED_KEY = "vramgate_jobs_queued"
AUTOSCALING_REFUSED_KEY = "vramgate_refused_by_prediction"
AUTOSCALING_KEYS = (AUTOSCALING_QUEUE_DEPTH_KEY, AUTOSCALING_QUEUED_BYTES_KEY,
                    AUTOSCALING_RESERVED_BYTES_KEY, AUTOSCALING_BUDGET_BYTES_KEY,
                    AUTOSCALING_RUNNING_REQUESTS_KEY, AUTOSCALING_JOBS_QUEUED_KEY,
                    AUTOSCALING_REFUSED_KEY)


@dataclass(frozen=True, kw_only=True)
class GateFigures:
    """The admission gate now, in the policy's units (bytes under ``budget``).

    Attributes:
        capacity: what the gate may lease at once now.
        reserved_bytes, peak_reserved_bytes, free_bytes: leased now, most ever leased at
            once, capacity not leased.
        active_leases: leases held.
        queue_depth, queued_bytes: waiters in the FIFO and what they ask for.
        charged_bytes_total, released_bytes_total: every lease's figure, when taken and
            when given back (equal when idle).
        drain_bytes_per_s: the measured drain rate (``None`` before any lease ran).
        thread_wait_s: seconds a request admitted now would wait for the inference thread
            (its backlog of passes), for predicted waits.
        busy_drain_bytes_per_s: the drain rate while the replica works (idle time left
            out), for predicted waits (``None`` before any lease ran).
        wait_margin_s: seconds added to predicted waits before refusing on them (the recent
            errors' quantile, :mod:`serve_app.admission.calibration`), of the tenants that
            have too few errors of their own (``tenants[t]["wait_margin_s"]``: their own).
        tenants: each tenant's share (:meth:`AdmissionController.tenant_figures`).
    """

    capacity: int
    reserved_bytes: int
    peak_reserved_bytes: int
    free_bytes: int
    active_leases: int
    queue_depth: int
    queued_bytes: int
    charged_bytes_total: int
    released_bytes_total: int
    drain_bytes_per_s: float | None
    thread_wait_s: float = 0.0
    busy_drain_bytes_per_s: float | None = None
    wait_margin_s: float = 0.0
    tenants: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class DeviceFigures:
    """The replica's inference thread and device health.

    Attributes:
        inferences_running: jobs on (or queued for) the thread.
        inferences_total: jobs the thread ran.
        oom_count: out-of-memory errors caught.
        device_fault: why the replica is being replaced, or ``None``.
        cost_correction_factor, cost_corrections: the price multiplier learnt from OOMs,
            and how many times it rose.
    """

    inferences_running: int
    inferences_total: int
    oom_count: int
    device_fault: str | None
    cost_correction_factor: float
    cost_corrections: int


@dataclass(frozen=True, kw_only=True)
class ReplicaState:
    """One model replica's published state.

    Attributes:
        replica_id, node_id, gpu_ids, num_gpus: where it runs.
        model: the model id clients see; ``task``: the engine's name; ``kinds``: the request
            kinds it serves.
        policy, gate_units: the admission policy and the units of ``gate``.
        memory: what was measured at start-up (device, method, capacity, held, reserve,
            safety factor, measured budget, largest request, profile summary; on CPU the
            torch threads chosen, ``cpu_threads``).
        cost_model: the prices it charges now, published exactly
            (:meth:`~serve_app.memory.cost_model.CorrectedCostModel.published`).
        gate, device: the gate's and the thread's figures now.
        budget_bytes: the byte budget now (after AIMD shrinks and regrowths).
        measured_budget_bytes: the budget derived at start-up.
        budget_shrink_count, budget_regrow_count: AIMD steps taken.
        updated_at: when it was taken (``time.time()``).
        jobs_queued: durable jobs waiting in the app's queue, as this replica last read it
            (0 without jobs).
        refused_by_prediction: requests this replica refused by prediction over the
            autoscaling look-back window (they would have waited: demand for the autoscaler).
        kv_cache: continuous batching's figures (sequences running and waiting, KV blocks:
            size in tokens and bytes, the budget's worth, leased, in use), or ``None``
            (no continuous batching on this replica).
    """

    replica_id: str
    node_id: str
    gpu_ids: tuple[str, ...]
    num_gpus: float
    model: str
    task: str
    kinds: tuple[str, ...]
    policy: str
    gate_units: str
    memory: Mapping[str, Any]
    cost_model: Mapping[str, Any]
    gate: GateFigures
    device: DeviceFigures
    budget_bytes: int
    measured_budget_bytes: int
    budget_shrink_count: int
    budget_regrow_count: int
    updated_at: float = field(default=0.0)
    kv_cache: Mapping[str, int] | None = None
    jobs_queued: int = 0
    refused_by_prediction: int = 0

    def to_status(self) -> dict[str, Any]:
        """The JSON shown per replica by ``GET /v1/status``."""
        gate, device = self.gate, self.device
        return {
            "replica_id": self.replica_id, "node_id": self.node_id,
            "gpu_ids": list(self.gpu_ids), "num_gpus": self.num_gpus, "model": self.model,
            "task": self.task, "kinds": list(self.kinds), "policy": self.policy,
            "gate_units": self.gate_units, **self.memory,
            "reserved_bytes": gate.reserved_bytes,
            "peak_reserved_bytes": gate.peak_reserved_bytes, "free_bytes": gate.free_bytes,
            "active_leases": gate.active_leases, "queue_depth": gate.queue_depth,
            "queued_bytes": gate.queued_bytes,
            "charged_bytes_total": gate.charged_bytes_total,
            "released_bytes_total": gate.released_bytes_total,
            "inferences_running": device.inferences_running,
            "inferences_total": device.inferences_total, "oom_count": device.oom_count,
            "device_fault": device.device_fault,
            "cost_correction_factor": round(device.cost_correction_factor, 4),
            "cost_corrections": device.cost_corrections,
            "cost_model": dict(self.cost_model),
            "drain_bytes_per_s": gate.drain_bytes_per_s,
            "thread_wait_s": round(gate.thread_wait_s, 4),
            "busy_drain_bytes_per_s": gate.busy_drain_bytes_per_s,
            "wait_margin_s": round(gate.wait_margin_s, 4),
            "tenants": {t: dict(f) for t, f in gate.tenants.items()},
            "budget_bytes": self.budget_bytes,
            "measured_budget_bytes": self.measured_budget_bytes,
            "budget_shrink_count": self.budget_shrink_count,
            "budget_regrow_count": self.budget_regrow_count,
            "updated_at": self.updated_at,
            "kv_cache": dict(self.kv_cache) if self.kv_cache is not None else None,
            "jobs_queued": self.jobs_queued,
        }

    def to_routing_stats(self) -> dict[str, float]:
        """What the request router reads (:mod:`serve_app.routing`): the gate now."""
        gate = self.gate
        return {"budget_bytes": gate.capacity, "reserved_bytes": gate.reserved_bytes,
                "free_bytes": gate.free_bytes, ROUTING_QUEUE_DEPTH_KEY: gate.queue_depth,
                "queued_bytes": gate.queued_bytes, ROUTING_MEASURED_AT_KEY: self.updated_at}

    def to_autoscaling_stats(self) -> dict[str, float]:
        """What the autoscaling policy reads (:mod:`deployments.cluster.autoscaling`): floats."""
        gate = self.gate
        return {AUTOSCALING_QUEUE_DEPTH_KEY: float(gate.queue_depth),
                AUTOSCALING_QUEUED_BYTES_KEY: float(gate.queued_bytes),
                AUTOSCALING_RESERVED_BYTES_KEY: float(gate.reserved_bytes),
                AUTOSCALING_BUDGET_BYTES_KEY: float(self.budget_bytes),
                AUTOSCALING_RUNNING_REQUESTS_KEY: float(gate.active_leases),
                AUTOSCALING_JOBS_QUEUED_KEY: float(self.jobs_queued),
                AUTOSCALING_REFUSED_KEY: float(self.refused_by_prediction)}
