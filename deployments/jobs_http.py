"""The ingress's durable jobs: ``Prefer: respond-async`` on any inference route, and
``POST /v1/jobs`` / ``GET /v1/jobs/{id}`` / ``DELETE /v1/jobs/{id}``.

A job is validated, tokenized and priced at submission exactly as the route would do it
(:meth:`~deployments.routes.base.Route.prepare`), so a bad body is a 400 now, not a failed
job later; then it is stored in the app's Redis (:mod:`serve_app.jobs.store`) and answered
``202 Accepted`` with ``Location: /v1/jobs/{id}`` and ``{id, status: "queued", position,
eta_s}``. Model replicas pull jobs when they fit (:mod:`deployments.jobs_worker`). A queued
job's ``eta_s`` is the time the replicas' drain rate needs for what they hold now and the
prices of the jobs up to it (:meth:`JobsFront.with_eta`).
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.idempotency_guard import checked_key
from deployments.openapi import responses
from deployments.replica_view import ReplicaView
from deployments.routes.base import Route
from serve_app.errors import InvalidRequestError, ModelNotFoundError, RequestTooLargeError
from serve_app.jobs.store import JobStore
from serve_app.jobs.view import JobView
from serve_app.schemas import JobResponse


class JobRequest(BaseModel):
    """``POST /v1/jobs``: an inference route's path and the body it would take."""

    model_config = ConfigDict(extra="forbid")
    route: str = Field(description="The inference route, e.g. `/v1/embeddings`.")
    body: dict[str, Any] = Field(description="The body that route takes.")


class JobsFront:
    """One model's jobs: accepts, shows and cancels them in its job store.

    Args:
        store: the model's job store.
        routes: the model's inference routes, by path.
        replicas: the ingress's view of the model's replicas (a job's price, the largest
            budget).
    """

    def __init__(self, store: JobStore, routes: Mapping[str, Route],
                 replicas: ReplicaView) -> None:
        self._store, self._routes, self._replicas = store, routes, replicas

    async def submit(self, path: str, body: BaseModel, request: Request) -> JSONResponse:
        """Store ``body`` for the route at ``path`` as a job; 202 with its ``Location`` (and
        ``Idempotent-Replayed: true`` when the Idempotency-Key already names the job).

        Raises:
            ServeAppError: the route's 400/404 for the body; 400 ``request_too_large`` when
                it exceeds every replica's whole budget; 422 for an Idempotency-Key used with
                another body; 503 ``jobs_full``.
        """
        prepared = await self._routes[path].prepare(body, uuid.uuid4().hex)
        units = await self._replicas.estimate(prepared.request.shape)
        budgets = [s.measured_budget_bytes for s in await self._replicas.states()]
        if units is not None and budgets and units > max(budgets):
            raise RequestTooLargeError(
                f"the request needs an estimated {units} bytes of device memory, more than "
                f"any replica's whole budget ({max(budgets)} bytes)")
        key = request.headers.get("idempotency-key")
        job, created = await self._store.submit(
            path, body.model_dump_json(exclude_unset=True), b"", units or 0, checked_key(key))
        job = await self.with_eta(await self._store.get(job.id) or job)
        headers = {"Location": f"/v1/jobs/{job.id}"}
        if not created:  # the key's job, as for any replayed Idempotency-Key
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse(job.to_body(), status_code=202, headers=headers)

    async def show(self, job_id: str) -> JobView | None:
        """The job now (``None`` when unknown here or expired)."""
        job = await self._store.get(job_id)
        return None if job is None else await self.with_eta(job)

    async def with_eta(self, job: JobView) -> JobView:
        """A queued ``job`` with ``eta_s``: what the replicas hold now and the prices of the
        jobs up to it, over their summed busy drain rate (:meth:`ReplicaView.drain_s`, the
        rate behind predicted waits and ``Retry-After``); the store's own estimate from the
        jobs finished in the last minute while no replica has measured a rate. Measured
        before: a lone job said 14.2 s and finished in under 1 s."""
        if job.position is None:
            return job
        eta_s = await self._replicas.drain_s(
            await self._store.queued_bytes_through(job.position))
        return job if eta_s is None else dataclasses.replace(job, eta_s=eta_s)

    async def cancel(self, job_id: str) -> JobView | None:
        """Cancel a queued job; a running one finishes and its result is dropped
        (``status`` stays ``running`` until then); a finished one is left as it is. ``None``
        when unknown here or expired."""
        return await self._store.cancel(job_id)


class JobsRoutes:
    """``/v1/jobs``: a job goes to the jobs of the model its body names; a job id is looked
    up in each model's store.

    Args:
        models: the ingress's models (:class:`deployments.served_models.ServedModels`);
            each model's route has its :class:`JobsFront` (``route.context.jobs``).
    """

    def __init__(self, models: Any) -> None:
        self._models = models

    def install(self, app: FastAPI) -> None:
        """Add ``/v1/jobs`` routes to ``app``."""
        app.post("/v1/jobs", status_code=202, response_model=None,
                 responses=responses(JobResponse, 400, 401, 404, 413, 422, 503, ok_status=202)
                 )(self.create)
        app.get("/v1/jobs/{job_id}", response_model=None,
                responses=responses(JobResponse, 401, 404))(self.show)
        app.delete("/v1/jobs/{job_id}", response_model=None,
                   responses=responses(JobResponse, 401, 404))(self.cancel)

    async def create(self, job: JobRequest, request: Request) -> JSONResponse:
        """``POST /v1/jobs``: run ``job.body`` on ``job.route`` as a job (202)."""
        if job.route not in self._models.paths():
            raise ModelNotFoundError(f"no inference route {job.route!r} here; one of "
                                     f"{self._models.paths()}")
        model = job.body.get("model")
        route = self._models.route(job.route, model if isinstance(model, str) else None)
        try:
            body = route.body_model.model_validate(job.body)
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        if getattr(body, "stream", False):
            raise InvalidRequestError("a job's result is fetched whole: stream must be false",
                                      code="stream")
        request.state.model = route.context.args.model.name
        return await route.context.jobs.submit(job.route, body, request)

    async def show(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{job_id}``: the job now (404 when unknown or expired)."""
        return _found(await self._first(job_id, JobsFront.show), job_id).to_body()

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """``DELETE /v1/jobs/{job_id}``: :meth:`JobsFront.cancel` (404 when unknown)."""
        return _found(await self._first(job_id, JobsFront.cancel), job_id).to_body()

    async def _first(self, job_id: str, call: Any) -> JobView | None:
        """``call(front, job_id)`` on each model's jobs until one knows the job."""
        for front in self._models.fronts:
            if front.jobs is not None and (job := await call(front.jobs, job_id)) is not None:
                return job
        return None


def _found(job: JobView | None, job_id: str) -> JobView:
    if job is None:
        raise ModelNotFoundError(f"no job {job_id!r} (unknown, or its result expired)",
                                 code="job_not_found")
    return job

