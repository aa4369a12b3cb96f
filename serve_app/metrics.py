"""Every metric the service exports, declared once.

Names carry the project prefix and their unit (``_bytes``, ``_seconds``, ``_total``); labels
are bounded: ``deployment``, ``replica`` and ``model`` (the served model's name; empty on an
ingress series that belongs to no one model) on every series, plus ``outcome``, ``reason``,
``route`` and ``status`` where listed. Histograms have explicit buckets.

Each process (a model replica or an ingress replica) records into a :class:`ProcessMetrics`,
which writes every value twice:

- to a process-local ``prometheus_client`` registry, whose exposition the process publishes
  to the app's registry actor; ``GET /metrics`` on any ingress replica merges those
  expositions (:func:`merge_expositions`), so it shows the whole cluster, each series once,
  whatever the number of ingress or model replicas;
- to Ray's metrics API (``ray.util.metrics``), which every node's metrics agent exports to
  Prometheus and the Ray dashboard (names there get Ray's ``ray_`` prefix:
  ``ray_vramgate_budget_bytes``). Ray is imported lazily, so the module works without it.

See docs/observability.md for what each metric means and the alert rules built on them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)
disable_created_metrics()  # no ``*_created`` series: they double every counter's families

PREFIX = "vramgate"
COMMON_LABELS = ("deployment", "replica", "model")

# Seconds: from 1 ms (a request admitted at once) to 60 s (the longest admission.max_queue_wait_s
# and inference_timeout_s worth waiting for).
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   7.5, 10.0, 30.0, 60.0)  # 7.5: a p99 near the default 10 s wait limit
# measured / estimated bytes of one request: 1.0 is a perfect price; above 1 the cost model
# under-prices (the safety factor's margin is being used), below it over-prices.
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: ``kind`` is ``counter``, ``gauge`` or ``histogram``; ``name`` excludes the
    prefix (and, for counters, the ``_total`` suffix prometheus-client adds)."""

    kind: str
    name: str
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def full_name(self) -> str:
        return f"{PREFIX}_{self.name}"

    @property
    def exported_names(self) -> tuple[str, ...]:
        """The sample names Prometheus sees (what a query names)."""
        base = self.full_name
        if self.kind == "counter":
            return (f"{base}_total",)
        if self.kind == "histogram":
            return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
        return (base,)


def _gauge(name: str, description: str) -> MetricSpec:
    return MetricSpec("gauge", name, description)


SPECS: tuple[MetricSpec, ...] = (
    # --- model replica: the budget and the queue (gauges, refreshed every publish period) ---
    _gauge("budget_bytes", "The replica's byte budget now (after AIMD shrinks/regrowths)."),
    _gauge("measured_budget_bytes", "The budget measured at start-up."),
    _gauge("reserved_bytes", "Bytes leased to admitted requests."),
    _gauge("free_bytes", "Budget bytes not leased."),
    _gauge("queue_depth", "Requests waiting for a lease."),
    _gauge("queued_bytes", "Bytes the waiting requests ask for."),
    _gauge("cost_correction_factor", "Price multiplier learnt from OOMs (1 = as profiled)."),
    _gauge("device_allocated_bytes",
           "CUDA: torch.cuda.memory_allocated; simulated device: live allocations."),
    _gauge("device_reserved_bytes",
           "CUDA: torch.cuda.memory_reserved (the caching allocator's pool)."),
    _gauge("host_resident_bytes", "The replica process's resident set (VmRSS)."),
    # --- model replica: what happened -------------------------------------------------------
    MetricSpec("counter", "admission_decisions",
               "Admission decisions: outcome admitted (the request started on the device), "
               "rejected or cancelled, with the reason.", ("outcome", "reason")),
    MetricSpec("counter", "ooms", "Out-of-memory errors caught."),
    MetricSpec("counter", "budget_shrinks", "Budget shrinks after an OOM (AIMD)."),
    MetricSpec("counter", "budget_regrowths", "Budget regrowth steps after quiet periods."),
    MetricSpec("counter", "device_faults", "Device faults (NaN/Inf canary, non-OOM CUDA "
               "error); each gets the replica replaced."),
    MetricSpec("histogram", "queue_wait_seconds",
               "Wait for a lease and the inference thread, of admitted requests.",
               buckets=SECONDS_BUCKETS),
    MetricSpec("histogram", "tenant_queue_wait_seconds",
               "queue_wait_seconds by tenant (auth.tenants; its key's).", ("tenant",),
               SECONDS_BUCKETS),
    MetricSpec("gauge", "tenant_held_bytes", "Bytes a tenant's admitted requests lease now.",
               ("tenant",)),
    MetricSpec("gauge", "tenant_queue_depth", "A tenant's requests waiting for a lease.",
               ("tenant",)),
    MetricSpec("counter", "tenant_served_byte_seconds",
               "Device memory-time a tenant's leases held: bytes x seconds (its fair share's "
               "measure).", ("tenant",)),
    MetricSpec("counter", "tenant_refusals", "A tenant's requests refused by the replica, by "
               "code (tenant_quota, queue_full, predicted_timeout, ...).", ("tenant", "reason")),
    MetricSpec("histogram", "queue_wait_prediction_error_seconds",
               "How far the wait before starting was from the wait predicted at arrival, of "
               "admitted requests with a prediction; side: longer (waited more than "
               "predicted) or shorter.", ("side",), SECONDS_BUCKETS),
    MetricSpec("histogram", "inference_seconds", "Time on the inference thread per request.",
               buckets=SECONDS_BUCKETS),
    MetricSpec("histogram", "request_measured_over_estimated",
               "Measured peak bytes / priced bytes per request (the cost model's honesty).",
               buckets=RATIO_BUCKETS),
    # --- model replica: continuous batching (deployments.replica.decode_loop) --------------
    _gauge("running_sequences", "Completions in the running batch (continuous batching, or "
           "running in vLLM)."),
    _gauge("waiting_sequences", "Admitted completions waiting to join the running batch (or "
           "waiting in vLLM's own queue)."),
    _gauge("kv_cache_budget_blocks", "KV-cache blocks the budget holds (block size: /v1/status "
           "kv_cache.block_tokens; 16 tokens on the built-in engines)."),
    _gauge("kv_cache_leased_blocks",
           "KV-cache blocks leased: prompt + max_tokens of every running and waiting "
           "completion."),
    _gauge("kv_cache_used_blocks", "KV-cache blocks the running batch holds after its last step."),
    _gauge("kv_cache_preempted_sequences", "Sequences the engine preempted under KV-cache "
           "pressure since the replica started (vLLM's scheduler; 0 on the built-in engines)."),
    MetricSpec("counter", "generated_tokens", "Tokens generated by completions."),
    MetricSpec("histogram", "time_to_first_token_seconds",
               "From admission queue entry to a completion's first token.",
               buckets=SECONDS_BUCKETS),
    MetricSpec("histogram", "inter_token_latency_seconds",
               "Between two tokens of one completion (one decode step).",
               buckets=SECONDS_BUCKETS),
    # --- model replica: durable jobs (deployments.replica.jobs_worker) ---------------------
    _gauge("job_queue_depth", "Durable jobs waiting in the app's queue (cluster-wide, as this "
           "replica last read it, every heartbeat_ttl_s / 3)."),
    _gauge("job_queue_oldest_age_seconds", "Age of the job at the queue's head (0 when the "
           "queue is empty), as this replica last read it."),
    _gauge("running_jobs", "Durable jobs this replica runs now."),
    MetricSpec("counter", "jobs_finished",
               "Durable jobs this replica ran to an outcome: succeeded, failed, cancelled "
               "(cancelled while it ran), or requeued (a transient 503: back at the queue's "
               "head).", ("outcome",)),
    # --- ingress ----------------------------------------------------------------------------
    MetricSpec("counter", "http_requests", "HTTP responses by route and status.",
               ("route", "status")),
    MetricSpec("histogram", "http_request_seconds", "HTTP request duration by route.",
               ("route",), SECONDS_BUCKETS),
    MetricSpec("counter", "batches_finished",
               "Batch API batches this ingress drove to a final status: completed, failed "
               "(refused in validation), cancelled or expired.", ("outcome",)),
    MetricSpec("gauge", "driven_batches",
               "Batch API batches not final that this ingress drives now, by status: "
               "validating, in_progress, finalizing or cancelling (summed over the ingresses: "
               "the app's batches under way).", ("status",)),
    MetricSpec("counter", "batch_lines_finished",
               "Lines of Batch API batches this ingress recorded: completed (output file) or "
               "failed (error file: the job failed, was cancelled or expired).", ("outcome",)),
    MetricSpec("counter", "idempotency_hits",
               "Requests answered from another execution with the same Idempotency-Key: "
               "outcome replayed (stored response) or coalesced (joined a running one).",
               ("outcome",)),
)
#: The model replica's event counters, exported at 0 from its start.
REPLICA_EVENT_COUNTERS = ("ooms", "budget_shrinks", "budget_regrowths", "device_faults",
                          "generated_tokens")


class ProcessMetrics:
    """This process's metrics, labelled with its deployment, replica and model.

    Args:
        deployment: the Serve deployment name (``ModelServer``, ``Ingress``).
        replica: the replica id (unique in the cluster).
        model: the model served (``model.name``); empty for an ingress, whose per-model
            series come from :meth:`for_model`.
        use_ray: also record through ``ray.util.metrics`` (off in unit tests without Ray).
        zeroed: counters (names without labels beyond the common ones) exported at 0 from the
            start, so that their first increment shows in ``rate()`` / ``increase()``.
    """

    def __init__(self, deployment: str, replica: str, use_ray: bool = True,
                 zeroed: tuple[str, ...] = (), model: str = "") -> None:
        self.common = {"deployment": deployment, "replica": replica, "model": model}
        self.registry = CollectorRegistry(auto_describe=True)
        self._local: dict[str, Any] = {}
        self._children: dict[tuple, Any] = {}
        self._ray: dict[str, Any] = {}
        for spec in SPECS:
            labels = COMMON_LABELS + spec.labels
            if spec.kind == "counter":
                metric = Counter(spec.full_name, spec.description, labels,
                                 registry=self.registry)
            elif spec.kind == "gauge":
                metric = Gauge(spec.full_name, spec.description, labels,
                               registry=self.registry)
            else:
                metric = Histogram(spec.full_name, spec.description, labels,
                                   registry=self.registry, buckets=spec.buckets)
            self._local[spec.name] = metric
        if use_ray:
            self._ray = _ray_metrics()
        for name in zeroed:  # locally only: Ray's Counter.inc refuses 0
            self._local[name].labels(**self.common).inc(0)

    def for_model(self, model: str) -> ProcessMetrics:
        """The same series (one registry, one exposition) recorded with ``model`` as their
        ``model`` label: an ingress's view for one of the models it serves."""
        view = copy.copy(self)
        view.common = {**self.common, "model": model}
        view._children = {}
        return view

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._child(name, labels).inc(value)
        if name in self._ray:
            self._ray[name].inc(value, {**self.common, **labels})

    def set(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).set(value)
        if name in self._ray:
            self._ray[name].set(value, {**self.common, **labels})

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).observe(value)
        if name in self._ray:
            self._ray[name].observe(value, {**self.common, **labels})

    def _child(self, name: str, labels: dict[str, str]) -> Any:
        """The local series of ``name`` with ``labels``, looked up once (``labels()`` costs
        about 10 us a call, and a decode step records a value per running sequence)."""
        key = (name, *labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._local[name].labels(
                **{**self.common, **labels})
        return child

    def exposition(self) -> str:
        """This process's series in Prometheus text format."""
        return generate_latest(self.registry).decode()


_RAY_METRICS: dict[str, Any] | None = None


def _ray_metrics() -> dict[str, Any]:
    """One ``ray.util.metrics`` object per spec, per process (Ray aggregates by tags)."""
    global _RAY_METRICS
    if _RAY_METRICS is None:
        from ray.util import metrics as ray_metrics

        made: dict[str, Any] = {}
        for spec in SPECS:
            tag_keys = COMMON_LABELS + spec.labels
            if spec.kind == "counter":
                made[spec.name] = ray_metrics.Counter(spec.full_name, spec.description,
                                                      tag_keys)
            elif spec.kind == "gauge":
                made[spec.name] = ray_metrics.Gauge(spec.full_name, spec.description, tag_keys)
            else:
                made[spec.name] = ray_metrics.Histogram(spec.full_name, spec.description,
                                                        list(spec.buckets), tag_keys)
        _RAY_METRICS = made
    return _RAY_METRICS


def merge_expositions(texts: Iterable[str]) -> str:
    """Merge the expositions of several processes into one (families joined by name).

    Each process labels its series with its own ``replica``, so no series appears twice; a
    family's help and type come from its first appearance.

    Raises:
        ValueError: a text is not valid Prometheus exposition.
    """
    families: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                families[family.name] = family
            else:
                merged.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry).decode()


class _Families:
    """A prometheus-client collector that yields already-built families."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)
