"""The ``fake:`` section of a config: the model-free engine on a simulated device
(``model.task: fake``). Pure pydantic."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MiB = 1 << 20
GiB = 1 << 30


class FakeConfig(BaseModel):
    """The model-free engine of ``model.task: fake`` on a simulated device: exact, known
    memory and time costs for tests, load tests and demos on machines without a GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_capacity_bytes: int = Field(
        16 * GiB, gt=0, description="The simulated card. A replica holding "
        "`deployment.num_gpus` of it gets that share (the whole card when num_gpus is 0).")
    weights_bytes: int = Field(1 * GiB, ge=0, description="What the fake model holds.")
    bytes_per_token: int = Field(
        1 * MiB, ge=0, description="Device bytes per token of batch x (prompt + new tokens).")
    bytes_per_request: int = Field(0, ge=0, description="Fixed device bytes per request.")
    latency_per_token_s: float = Field(
        0.0005, ge=0, allow_inf_nan=False, description="Seconds per token of "
        "batch x (prompt + new tokens).")
    latency_per_pass_s: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="Fixed seconds per forward pass (an "
        "embedding batch, a prompt's prefill, each generated token), whatever its batch: on a "
        "GPU a pass reads every weight once, so small batches cost about what one request "
        "does (Pope et al. 2022, 'Efficiently Scaling Transformer Inference', sec. 2). 0 = "
        "time linear in tokens, where batching buys no throughput.")
    dimensions: int = Field(384, ge=1, description="Embedding dimensions.")
    oom_probability: float = Field(
        0.0, ge=0, le=1, description="Injected fault: each inference raises the device's "
        "out-of-memory error with this probability.")
    cuda_error_probability: float = Field(
        0.0, ge=0, le=1, description="Injected fault: each inference raises a non-OOM CUDA "
        "error (\"device-side assert triggered\") with this probability.")
    hang_probability: float = Field(
        0.0, ge=0, le=1, description="Injected fault: each inference hangs for `hang_s`.")
    hang_s: float = Field(3600.0, ge=0, allow_inf_nan=False, description="How long a hang lasts.")
    nan_after_oom: bool = Field(
        False, description="Injected fault: after an OOM every output is NaN (a corrupted "
        "device), which the canary inference detects.")
    fault_seed: int = Field(0, description="Seeds the injected faults.")
    max_seq_tokens: int = Field(2048, ge=2, description="Longest prompt + completion.")
