"""The ingress's durable jobs: ``Prefer: respond-async`` on any inference route, and
``POST /v1/jobs`` / ``GET /v1/jobs/{id}`` / ``DELETE /v1/jobs/{id}``.

A job is validated, tokenized and priced at submission exactly as the route would do it
(:meth:`~deployments.http.routes.base.Route.prepare`), so a bad body is a 400 now, not a failed
job later; then it is stored in the app's Redis (:mod:`serve_app.jobs.store`) with that
request and how its result renders (:mod:`serve_app.jobs.payload`), and answered ``202
Accepted`` with ``Location: /v1/jobs/{id}`` and ``{id, status: "queued", position, eta_s}``.
Model replicas pull jobs when they fit and run the stored request
(:mod:`deployments.replica.jobs_worker`). A queued job's ``eta_s`` is the time the replicas' drain
rate needs for what they hold now and the prices of the jobs up to it
(:meth:`JobsFront.with_eta`). Jobs stored by an earlier release carry their body alone: the
ingress rebuilds their requests (:meth:`JobsFront.rebuild_stored`).
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.http.http_middleware import priority_of, tenant_of
from deployments.http.idempotency_guard import checked_key
from deployments.http.openapi import responses
from deployments.http.replica_view import ReplicaView
from deployments.http.routes.base import Prepared, Route
from serve_app.admission.priority import Priority
from serve_app.errors import (
    InternalError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTooLargeError,
    ServeAppError,
)
from serve_app.jobs.payload import encode_job, encode_refusal
from serve_app.jobs.store import JobStore, new_job_id
from serve_app.jobs.view import FINAL_STATUSES, JobView
from serve_app.schemas import JobResponse

logger = logging.getLogger("ray.serve")


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
        self._rebuilding: asyncio.Future[int] | None = None

    async def submit(self, path: str, body: BaseModel, request: Request) -> JSONResponse:
        """Store ``body`` for the route at ``path`` as a job; 202 with its ``Location`` (and
        ``Idempotent-Replayed: true`` when the Idempotency-Key already names the job).

        Raises:
            ServeAppError: the route's 400/404 for the body; 400 ``request_too_large`` when
                it exceeds every replica's whole budget; 422 for an Idempotency-Key used with
                another body; 503 ``jobs_full``.
        """
        job, created = await self.submit_body(path, body, request.headers.get("idempotency-key"),
                                              tenant_of(request),
                                              priority_of(request, Priority.BATCH))
        job = await self.with_eta(await self._store.get(job.id) or job)
        headers = {"Location": f"/v1/jobs/{job.id}"}
        if not created:  # the key's job, as for any replayed Idempotency-Key
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse(job.to_body(), status_code=202, headers=headers)

    @property
    def store(self) -> JobStore:
        """The model's job store."""
        return self._store

    async def price(self, prepared: Prepared) -> int | None:
        """The device bytes ``prepared`` is priced at (``None`` while no replica has measured
        its cost model).

        Raises:
            RequestTooLargeError: it exceeds every replica's whole budget (400).
        """
        units = await self._replicas.estimate(prepared.request.shape)
        budgets = [s.measured_budget_bytes for s in await self._replicas.states()]
        if units is not None and budgets and units > max(budgets):
            raise RequestTooLargeError(
                f"the request needs an estimated {units} bytes of device memory, more than "
                f"any replica's whole budget ({max(budgets)} bytes)")
        return units

    async def submit_body(self, path: str, body: BaseModel, key: str | None, tenant: str,
                          priority: Priority = Priority.BATCH) -> tuple[JobView, bool]:
        """Prepare and price ``body`` as the route at ``path`` does, and store it as a job of
        ``tenant`` in the ``priority`` class under the Idempotency-Key ``key``:
        :meth:`JobStore.submit`'s answer.

        Raises:
            ServeAppError: as :meth:`submit`.
        """
        job_id = new_job_id()
        prepared = await self._routes[path].prepare(body, job_id)
        units = await self.price(prepared)
        return await self._store.submit(
            path, body.model_dump_json(exclude_unset=True),
            encode_job(dataclasses.replace(prepared.request, tenant=tenant, priority=priority),
                       prepared.render),
            units or 0, checked_key(key), job_id)

    async def show(self, job_id: str) -> JobView | None:
        """The job now (``None`` when unknown here or expired); one stored by an earlier
        release is rebuilt first (:meth:`rebuild_stored`)."""
        job = await self._store.get(job_id)
        if job is not None and not job.request and job.status not in FINAL_STATUSES:
            await self._rebuild(job)
        return None if job is None else await self.with_eta(job)

    def start_rebuilding(self) -> None:
        """Run :meth:`rebuild_stored` in the background (the ingress serves meanwhile; a
        replica leaves such a job at the queue's head until it is rebuilt, for
        :data:`deployments.replica.jobs_worker.UNREADABLE_WAIT_S`)."""
        self._rebuilding = asyncio.ensure_future(self.rebuild_stored())
        self._rebuilding.add_done_callback(_log_rebuild)

    async def rebuild_stored(self) -> int:
        """Give every queued or running job stored by an earlier release, which kept the
        client's body alone (record format 1, :mod:`serve_app.jobs.payload`), the request
        its route builds from that body now, as at submission: the model replicas then run
        it. A body the route refuses now is stored as that refusal (the job fails with it
        when a replica takes it, as it did before). Returns how many were rebuilt."""
        rebuilt = 0
        for job_id in await self._store.without_request():
            job = await self._store.get(job_id)
            if job is not None and job.status not in FINAL_STATUSES:
                rebuilt += await self._rebuild(job)
        return rebuilt

    async def _rebuild(self, job: JobView) -> bool:
        """Store the request of ``job`` (format 1) rebuilt from its body; whether it was
        stored (not if it finished, or was rebuilt, meanwhile)."""
        route = self._routes.get(job.route)
        try:
            if route is None:
                raise InternalError(f"this app serves no route {job.route}")
            try:
                body = route.body_model.model_validate_json(job.body_json)
            except ValidationError as exc:
                raise InvalidRequestError(f"the job's body is not valid: {exc}") from None
            prepared = await route.prepare(body, job.id)
            record = encode_job(prepared.request, prepared.render)
        except ServeAppError as exc:
            record = encode_refusal(exc)
        return await self._store.set_request(job.id, record)

    async def with_eta(self, job: JobView) -> JobView:
        """A queued ``job`` with ``eta_s``: what the replicas hold now and the prices of the
        jobs up to it, over their summed busy drain rate (:meth:`ReplicaView.drain_s`, the
        rate behind predicted waits and ``Retry-After``); the store's own estimate from the
        jobs finished in the last minute while no replica has measured a rate. Measured
        before: a lone job said 14.2 s and finished in under 1 s."""
        if job.position is None:
            return job
        eta_s = await self._replicas.drain_s(
            await self._store.figures.queued_bytes_through(job.position))
        return job if eta_s is None else dataclasses.replace(job, eta_s=eta_s)

    async def cancel(self, job_id: str) -> JobView | None:
        """Cancel a queued job; a running one is stopped by its replica's worker within
        ``jobs.poll_interval_s`` (``status`` stays ``running`` until then, ``cancelled``
        after); a finished one is left as it is. ``None`` when unknown here or expired."""
        return await self._store.cancel(job_id)


class JobsRoutes:
    """``/v1/jobs``: a job goes to the jobs of the model its body names; a job id is looked
    up in each model's store.

    Args:
        models: the ingress's models (:class:`deployments.http.served_models.ServedModels`);
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
        try:
            route, body = self.parsed(job.route, job.body)
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        request.state.model = route.context.args.model.name
        return await route.context.jobs.submit(job.route, body, request)

    def paths(self) -> list[str]:
        """Every inference route's path here."""
        return self._models.paths()

    def parsed(self, path: str, body: dict[str, Any]) -> tuple[Route, BaseModel]:
        """The route at ``path`` of the model ``body`` names, and ``body`` validated by it.

        Raises:
            ModelNotFoundError: no such inference route here, or model (404).
            InvalidRequestError: ``stream`` is true (a job's result is fetched whole).
            pydantic.ValidationError: the route refuses the body.
        """
        if path not in self._models.paths():
            raise ModelNotFoundError(f"no inference route {path!r} here; one of "
                                     f"{self._models.paths()}")
        model = body.get("model")
        route = self._models.route(path, model if isinstance(model, str) else None)
        parsed = route.body_model.model_validate(body)
        if getattr(parsed, "stream", False):
            raise InvalidRequestError("a job's result is fetched whole: stream must be false",
                                      code="stream")
        return route, parsed

    async def show(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{job_id}``: the job now (404 when unknown or expired)."""
        return _found(await self.first(job_id, JobsFront.show), job_id).to_body()

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """``DELETE /v1/jobs/{job_id}``: :meth:`JobsFront.cancel` (404 when unknown)."""
        return _found(await self.first(job_id, JobsFront.cancel), job_id).to_body()

    async def first(self, job_id: str, call: Any) -> JobView | None:
        """``call(front, job_id)`` on each model's jobs (:class:`JobsFront`) until one knows
        the job; ``None`` if none does."""
        for front in self._models.fronts:
            if front.jobs is not None and (job := await call(front.jobs, job_id)) is not None:
                return job
        return None


def _log_rebuild(task: asyncio.Future[int]) -> None:
    if task.cancelled():
        return
    if (failure := task.exception()) is not None:
        logger.error("durable jobs: the jobs stored by an earlier release could not be "
                     "rebuilt (%s); a replica fails them after a while", failure)
    elif rebuilt := task.result():
        logger.info("durable jobs: %d jobs stored by an earlier release rebuilt", rebuilt)


def _found(job: JobView | None, job_id: str) -> JobView:
    if job is None:
        raise ModelNotFoundError(f"no job {job_id!r} (unknown, or its result expired)",
                                 code="job_not_found")
    return job

