"""Marks every test by its folder: unit, integration, e2e, gpu."""

from __future__ import annotations

from pathlib import Path

import pytest

FOLDER_MARKS = {"unit", "integration", "e2e", "gpu"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in FOLDER_MARKS:
            item.add_marker(getattr(pytest.mark, folder))
