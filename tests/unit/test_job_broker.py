"""The embedded Redis's deployment across a redeploy: the new broker may find the old one's
server still answering and reuse it; the old broker then stops it as it goes. The new broker
must start its own again (on the same append-only file) at its next health check, and before
it answers anyone its URL, or the app's jobs have no Redis until the next redeploy: a new
ingress then waits 30 s for it and fails, three times, and the redeploy fails."""

from __future__ import annotations

import asyncio

from deployments.cluster.job_broker import JobBroker
from tests.support import read_job, write_job

Broker = JobBroker.func_or_class  # the class Ray Serve runs as the deployment's replicas


def _redeployed(tmp_path):
    old = Broker(str(tmp_path))
    new = Broker(str(tmp_path))  # started while the old one still runs
    url = asyncio.run(new.url())
    write_job(url)
    old.__del__()  # Ray Serve calls it as the old replica shuts down
    return new, url


def test_the_new_broker_brings_the_redis_back_at_its_health_check(tmp_path) -> None:
    new, url = _redeployed(tmp_path)
    try:
        assert asyncio.run(new.check_health()) is None
        assert read_job(url) == {b"status": b"queued"}
    finally:
        new.__del__()
    assert not (tmp_path / "redis.sock").exists()  # its own now: stopped with it


def test_the_new_broker_brings_the_redis_back_before_it_answers_its_url(tmp_path) -> None:
    new, url = _redeployed(tmp_path)
    try:
        assert asyncio.run(new.url()) == url
        assert read_job(url) == {b"status": b"queued"}
    finally:
        new.__del__()
