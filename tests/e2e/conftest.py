"""End-to-end tests run ``serve run``, ``ray start`` and scripts in processes of their own,
each on a Ray it starts, and end them with ``ray stop --force``."""

from __future__ import annotations

import pytest
import ray
from ray import serve


@pytest.fixture(scope="module", autouse=True)
def _no_ray_in_this_process() -> None:
    """Shut down a Ray this pytest process is connected to before the module runs.

    ``ray stop --force`` stops every Ray instance on the machine, and a process whose raylet
    dies exits (its core worker ends it): run after the integration tests in one session
    (``pytest tests/integration tests/e2e``), the first ``ray stop`` took pytest down with
    the integration tests' shared instance, with no summary and exit status 1. An
    integration test run after an e2e module in the same session would find that instance
    gone; in the default order (``tests/e2e`` first) none is.
    """
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
