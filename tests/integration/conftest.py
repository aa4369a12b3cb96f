"""One local Ray instance and Serve HTTP proxy for the whole integration session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from serve_app.app import build_app
from tests.support import assert_idle_invariants, free_port, settled_status, wait_until_ready


@pytest.fixture(scope="session")
def serve_base_url() -> Iterator[str]:
    """Start Ray (8 logical CPUs, 2 declared GPUs) and Serve's proxy on a free port."""
    port = free_port()
    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False,
             object_store_memory=256 * 1024 * 1024, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


class DeployedApp:
    """A vramgate app deployed on the session's Serve instance."""

    def __init__(self, base_url: str, name: str, args: dict[str, Any]) -> None:
        self.base_url, self.name, self.args = base_url, name, args

    def check_invariants(self) -> list[dict[str, Any]]:
        key = self.args.get("auth", {}).get("api_key")
        replicas = settled_status(self.base_url,
                                  headers={"Authorization": f"Bearer {key}"} if key else None)
        assert_idle_invariants(replicas)
        return replicas


@pytest.fixture(scope="module")
def deploy(serve_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``deploy(args)`` runs ``build_app(args)`` as this module's app at ``/``, and deletes it
    when the module is done. One app at a time: each module deploys what it needs. Its durable
    jobs live in this module's own directory (``jobs.data_dir``, unless the args set it), so no
    job of another module or run is ever pulled."""
    deployed: list[str] = []
    jobs_dir = str(tmp_path_factory.mktemp("jobs"))

    def _deploy(args: dict[str, Any], name: str = "vramgate") -> DeployedApp:
        args = {**args, "jobs": {"data_dir": jobs_dir, **args.get("jobs", {})}}
        for old in deployed:
            serve.delete(old)
        deployed.clear()
        serve.run(build_app(args), name=name, route_prefix="/", blocking=False)
        deployed.append(name)
        wait_until_ready(serve_base_url)
        return DeployedApp(serve_base_url, name, args)

    yield _deploy
    for name in deployed:
        serve.delete(name)


@pytest.fixture()
def client(app: DeployedApp) -> Iterator[httpx.Client]:
    """An HTTP client of the module's ``app``; after the test, the app's replicas must be
    idle with their invariants holding (no lease left behind)."""
    with httpx.Client(base_url=app.base_url, timeout=120) as c:
        yield c
    app.check_invariants()
