"""The ingress's client of the model deployment: one handle call per request, its wait for a
replica bounded, and every failure on the way turned into a typed error with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from deployments.cluster.ray_compat import replica_assigned
from deployments.http.http_errors import as_serve_app_error
from deployments.http.replica_view import ReplicaView
from serve_app.admission.calibration import WaitCalibration
from serve_app.admission.drain import MAX_RETRY_AFTER_S
from serve_app.admission.fair import DEFAULT_TENANT
from serve_app.errors import OverloadedError, ServeAppError
from serve_app.kinds import KINDS
from serve_app.memory.cost_model import Shape
from serve_app.metrics import ProcessMetrics
from serve_app.outcomes import Outcome, Reason
from serve_app.request import InferenceRequest, wait_bound_s
from serve_app.schemas import InferenceResult
from serve_app.stream_events import AdmissionEvent, StreamError, StreamEvent


class ModelClient:
    """Sends validated requests to the model replicas.

    Args:
        model: handle to :class:`deployments.replica.model_server.ModelServer`.
        replicas: the ingress's view of the replicas (prices, ``Retry-After``).
        max_queue_wait_s: ``admission.max_queue_wait_s``, the longest wait for a replica.
        metrics: the ingress's metrics (refusals decided here).
        max_replicas: with autoscaling, the most model replicas (``None``: a fixed count).
            While fewer run, the ingress refuses nothing by prediction: the replicas do, and
            count it for the autoscaler, which the ingress's refusals would hide from.
        refuse_predicted: ``admission.refuse_predicted_waits`` (off: only requests with a
            client wait limit are refused by prediction).
    """

    def __init__(self, model: DeploymentHandle, replicas: ReplicaView, max_queue_wait_s: float,
                 metrics: ProcessMetrics, max_replicas: int | None = None,
                 refuse_predicted: bool = True) -> None:
        self._max_replicas, self._refuse_predicted = max_replicas, refuse_predicted
        self._model, self._replicas = model, replicas
        self._max_queue_wait_s, self._metrics = max_queue_wait_s, metrics
        # Units of this ingress's requests sent but not yet taken by a replica, by tenant:
        # on their way to the replicas' queues, where they take their tenant's place in the
        # fair order; invisible in the replicas' published queues.
        self._unassigned_units: Counter[str] = Counter()
        self._unassigned = 0
        # Recent waits for a replica to take a request (a slot under max_ongoing_requests):
        # their median is the wait for a slot predicted while the handle queue is not empty.
        self._assign_waits = WaitCalibration(window=100, quantile=0.5)

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        """Run ``request`` on a replica (``ModelServer.infer``).

        Raises:
            ServeAppError: the replica's typed errors, and Ray's refusals as 503 (see
                :meth:`call`).
        """
        request = await self._priced(request)
        response = self._model.infer.remote(request)
        await self._wait_for_a_replica(response, request)
        return _raised(await self.call(lambda: response))

    async def stream(self, request: InferenceRequest,
                     ) -> tuple[AdmissionEvent, AsyncIterator[list[StreamEvent]]]:
        """Start streaming ``request`` (``ModelServer.infer_stream``): its first item (the
        admission, ``Queued`` or ``Admitted``, so that admission errors come
        before any byte is sent) and the rest, in the lists the replica sent them in
        (:mod:`serve_app.stream_events`; a ``StreamError`` item last if the stream ended
        with an error on the replica). Cancel the rest (``aclose``) when the client leaves.

        Raises: as :meth:`infer`, before the first item; the rest raises Ray's errors.
        """
        request = await self._priced(request)
        stream = self._model.options(stream=True).infer_stream.remote(request)
        await self._wait_for_a_replica(stream, request)
        first, *more = await self.call(lambda: stream.__anext__())

        async def rest() -> AsyncIterator[list[StreamEvent]]:
            try:
                if more:
                    yield more
                async for batch in stream:
                    yield batch
            finally:
                stream.cancel()

        return _raised(first), rest()

    async def _priced(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` with the router's price and the time it is sent (the replica counts
        the time it spends reaching it as queue wait).

        Raises:
            OverloadedError: ``predicted_timeout`` (:meth:`predicted_refusal`), refused
                before it joins Ray Serve's queue.
        """
        units = await self._replicas.estimate(request.shape)
        refusal = await self.predicted_refusal(units, request.wait_limit_s,
                                               KINDS[request.kind].generates, request.tenant)
        if refusal is not None:
            raise refusal
        return request.sent(units, time.time())

    async def shape_refusal(self, shape: Shape, wait_limit_s: float | None,
                            generates: bool = False,
                            tenant: str = DEFAULT_TENANT) -> OverloadedError | None:
        """:meth:`predicted_refusal` of a request of ``shape``, priced as the replicas
        publish."""
        if not await self._refuses_by_prediction(wait_limit_s):
            return None  # not priced on every request for nothing
        return await self.predicted_refusal(await self._replicas.estimate(shape), wait_limit_s,
                                            generates, tenant)

    async def predicted_refusal(self, units: int | None, wait_limit_s: float | None,
                                generates: bool = False,
                                tenant: str = DEFAULT_TENANT) -> OverloadedError | None:
        """The 503 ``predicted_timeout`` (counted in ``/metrics``) for a request of ``units``
        whose client waits ``wait_limit_s`` at most (``None``: no limit given), when every
        replica's published figures predict a longer wait than it may wait
        (:meth:`ReplicaView.predicted_wait_s`; ``generates``: a completion, with this
        ingress's requests still waiting
        for a replica ahead of it, and, while there are such, the median of the recent waits
        for a replica to take a request); ``None`` when it may be sent. Refuses nothing with
        ``admission.refuse_predicted_waits`` off and no client limit, nor while an
        autoscaling deployment runs fewer than its most replicas (the replicas refuse then,
        and count it for the autoscaler). ``tenant``: whose it is (its fair share of the
        replicas' backlogs)."""
        if not await self._refuses_by_prediction(wait_limit_s):
            return None
        predicted_s = await self._replicas.predicted_wait_s(units, self._unassigned_units,
                                                            generates, tenant)
        if predicted_s is not None and self._unassigned:
            predicted_s += self._assign_waits.margin_s()
        left_s = wait_bound_s(self._max_queue_wait_s, wait_limit_s)
        if predicted_s is None or predicted_s <= left_s:
            return None
        self._metrics.inc("admission_decisions", outcome=Outcome.REJECTED,
                          reason=Reason.PREDICTED_TIMEOUT)
        return OverloadedError(
            f"refused at once: the predicted wait of {predicted_s:.3g} s on every model "
            f"replica exceeds the {left_s:.3g} s this request may wait",
            code=Reason.PREDICTED_TIMEOUT.value,
            retry_after_s=min(MAX_RETRY_AFTER_S, predicted_s - left_s))

    async def _refuses_by_prediction(self, wait_limit_s: float | None) -> bool:
        return (self._refuse_predicted or wait_limit_s is not None) and (
            self._max_replicas is None
            or len(await self._replicas.states()) >= self._max_replicas)

    async def _wait_for_a_replica(self, response: Any, request: InferenceRequest) -> None:
        """Wait until Ray Serve has handed ``response``'s request to a replica, at most
        ``admission.max_queue_wait_s``. Requests wait in the handle's queue while every
        replica has ``max_ongoing_requests`` in flight; Ray bounds that queue's length
        (``max_queued_requests``) but not its time, so the wait is bounded here, and the
        replica counts it against the same limit (``sent_at_s``): an admitted request waits
        ``max_queue_wait_s`` at most in all. Past it the request is cancelled: 503
        ``queue_timeout`` with ``Retry-After``. Other failures (back-pressure, no replica)
        are left to surface when the response is awaited.

        When a replica was chosen is told by a private Ray method, on the Ray versions it was
        checked on only (:mod:`deployments.cluster.ray_compat`); elsewhere this returns at once and
        the replica alone bounds the wait (``sent_at_s``).
        """
        awaitable = replica_assigned(response)
        if awaitable is None:
            return
        assigned = asyncio.ensure_future(awaitable)
        units, sent_at = request.estimated_bytes or 0, time.monotonic()
        self._unassigned_units[request.tenant] += units
        self._unassigned += 1
        try:
            done, _ = await asyncio.wait(
                {assigned}, timeout=request.wait_bound_s(self._max_queue_wait_s))
        except asyncio.CancelledError:  # the client left: so does the request
            assigned.cancel()
            response.cancel()
            raise
        finally:
            self._unassigned_units[request.tenant] -= units
            if not self._unassigned_units[request.tenant]:
                del self._unassigned_units[request.tenant]
            self._unassigned -= 1
            self._assign_waits.record(time.monotonic() - sent_at)
        if done:
            if not assigned.cancelled():
                assigned.exception()  # retrieved here; awaiting the response raises it again
            return
        assigned.cancel()
        response.cancel()
        self._metrics.inc("admission_decisions", outcome=Outcome.REJECTED,
                          reason=Reason.QUEUE_TIMEOUT)
        raise OverloadedError(
            f"waited {request.wait_bound_s(self._max_queue_wait_s):g} s for a model replica "
            "to accept the request",
            code=Reason.QUEUE_TIMEOUT.value, retry_after_s=await self._replicas.retry_after_s())

    async def call(self, method: Callable[..., Awaitable[Any]] | Any, *args: Any,
                   **kwargs: Any) -> Any:
        """Call ``method`` (a deployment handle's method, or any coroutine function); any
        failure leaves as a typed error (Ray's back-pressure and unavailability included), so
        FastAPI's handlers render it."""
        try:
            call = (method.remote(*args, **kwargs) if hasattr(method, "remote")
                    else method(*args, **kwargs))
            return await call
        except ServeAppError:
            raise
        except BackPressureError:
            self._metrics.inc("admission_decisions", outcome=Outcome.REJECTED,
                              reason=Reason.QUEUE_FULL)
            raise OverloadedError("every model replica is busy and its queue is full",
                                  code=Reason.QUEUE_FULL.value,
                                  retry_after_s=await self._replicas.retry_after_s()) from None
        except Exception as exc:
            err = as_serve_app_error(exc)
            if err.code == Reason.NO_REPLICAS:  # refused before any replica could decide
                self._metrics.inc("admission_decisions", outcome=Outcome.REJECTED,
                                  reason=Reason.NO_REPLICAS)
            raise err from None


def _raised(answer: Any) -> Any:
    """A model replica's answer (a result, or a stream's item), its typed error raised
    again: the replica returns refusals rather than raising them (``ModelServer.infer``, a
    stream's :class:`StreamError` item), so that Ray Serve does not log them as failures.

    Raises:
        ServeAppError: the error the replica answered with, as it would have raised it.
    """
    error = answer.error if isinstance(answer, StreamError) else answer
    if isinstance(error, ServeAppError):
        raise error
    return answer
