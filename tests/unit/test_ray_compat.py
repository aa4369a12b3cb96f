"""The private Ray Serve method the ingress uses is there in the installed Ray, and is not
called on a Ray it was not checked on (``deployments/cluster/ray_compat.py``)."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import replace

import pytest
import ray
from ray.serve.handle import DeploymentResponse, DeploymentResponseGenerator

from deployments.cluster.ray_compat import PRIVATE_METHOD, private_api_checked, replica_assigned
from deployments.http.model_client import ModelClient
from serve_app.errors import OverloadedError
from serve_app.memory.cost_model import Shape
from serve_app.request import InferenceRequest


def test_the_installed_ray_is_one_the_private_call_was_checked_on() -> None:
    assert private_api_checked(ray.__version__), (
        f"Ray {ray.__version__}: read DeploymentResponse.{PRIVATE_METHOD} in this version, "
        "then add it to deployments/cluster/ray_compat.py CHECKED_RAY_VERSIONS and pyproject.toml")


@pytest.mark.parametrize("response_class", [DeploymentResponse, DeploymentResponseGenerator])
def test_the_private_method_exists_in_the_installed_ray(response_class) -> None:
    method = getattr(response_class, PRIVATE_METHOD, None)
    assert method is not None and inspect.iscoroutinefunction(method)


@pytest.mark.parametrize(("version", "checked"), [
    ("2.60.0", True), ("2.60.3", True), ("2.61.0", False), ("3.0.0", False), ("2.6.0", False)])
def test_versions_checked(version, checked) -> None:
    assert private_api_checked(version) is checked


class _Response:
    def __init__(self) -> None:
        self.assigned = asyncio.Event()
        self.cancelled = False

    async def _fetch_future_result_async(self) -> str:
        await self.assigned.wait()
        return "replica result"

    def cancel(self) -> None:
        self.cancelled = True


async def test_replica_assigned_uses_the_method_only_on_a_checked_ray() -> None:
    response = _Response()
    response.assigned.set()
    assert await replica_assigned(response, "2.60.0") == "replica result"
    assert replica_assigned(response, "2.61.0") is None
    assert replica_assigned(object(), "2.60.0") is None


async def test_a_unary_call_over_grpc_is_not_bounded_by_its_assignment() -> None:
    # Over gRPC (RAY_SERVE_THROUGHPUT_OPTIMIZED=1) a unary call's replica result resolves
    # with the result itself: waiting for it as the assignment would refuse every request
    # that runs longer than the queue bound. A stream's first message is its accept.
    by_value = _Response()
    by_value.by_reference = False
    assert replica_assigned(by_value, "2.60.0") is None
    by_reference = _Response()
    by_reference.by_reference = True
    by_reference.assigned.set()
    assert await replica_assigned(by_reference, "2.60.0") == "replica result"


class _Replicas:
    async def retry_after_s(self) -> float:
        return 2.0


class _Metrics:
    def __init__(self) -> None:
        self.counted: list[dict] = []

    def inc(self, name: str, **labels: str) -> None:
        self.counted.append({"name": name, **labels})


REQUEST = InferenceRequest("embed", ((1, 2),), Shape(1, 2, 0))


async def test_without_the_method_the_ingress_does_not_wait() -> None:
    client = ModelClient(None, _Replicas(), 0.01, _Metrics())
    await client._wait_for_a_replica(object(), REQUEST)  # returns at once, nothing raised


async def test_with_the_method_the_wait_is_bounded() -> None:
    metrics = _Metrics()
    client = ModelClient(None, _Replicas(), 0.01, metrics)
    response = _Response()
    with pytest.raises(OverloadedError) as raised:
        await client._wait_for_a_replica(response, REQUEST)
    assert raised.value.code == "queue_timeout" and response.cancelled
    assert metrics.counted == [{"name": "admission_decisions", "outcome": "rejected",
                                "reason": "queue_timeout"}]
    assigned = _Response()
    assigned.assigned.set()
    await client._wait_for_a_replica(assigned, REQUEST)
    assert not assigned.cancelled


async def test_the_client_s_shorter_limit_bounds_the_wait_for_a_replica() -> None:
    client = ModelClient(None, _Replicas(), 1000.0, _Metrics())
    response = _Response()
    with pytest.raises(OverloadedError) as raised:  # the 1000 s bound would hang the test
        await client._wait_for_a_replica(response, replace(REQUEST, wait_limit_s=0.01))
    assert raised.value.code == "queue_timeout" and response.cancelled
    assert "waited 0.01 s" in raised.value.message
