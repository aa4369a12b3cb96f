"""The one place where errors become HTTP responses.

Everything an inference route can raise, ours or Ray Serve's, is turned into a
:class:`~serve_app.errors.ServeAppError` by :func:`as_serve_app_error` and rendered by
:func:`error_response`. Nothing else in the project builds an error response.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from serve_app.errors import (
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    ServeAppError,
)
from serve_app.outcomes import Reason

logger = logging.getLogger("vramgate.errors")


def as_serve_app_error(exc: BaseException) -> ServeAppError:
    """Translate any exception into the typed error the client will see.

    Our errors pass through (also when Ray wrapped them in a ``RayTaskError``); Ray Serve's
    back-pressure becomes 503 ``queue_full``, an unavailable deployment 503 ``no_replicas``, a
    job store that does not answer 503 ``jobs_unavailable``; anything else is a bug: logged
    with its traceback, answered with a generic 500.
    """
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, ServeAppError):
        exc = exc.cause
    if isinstance(exc, ServeAppError):
        return exc
    if isinstance(exc, BackPressureError):
        return OverloadedError("every model replica's queue is full", code=Reason.QUEUE_FULL.value,
                               retry_after_s=1)
    if isinstance(exc, RayActorError):  # the replica died or was replaced mid-request
        return OverloadedError("the model replica serving this request stopped; retry",
                               code=Reason.NO_REPLICAS.value, retry_after_s=1)
    if isinstance(exc, DeploymentUnavailableError):
        return OverloadedError("no model replica is available", code=Reason.NO_REPLICAS.value,
                               retry_after_s=1)
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        # The jobs' Redis, between a redeploy's old and new broker, or jobs.redis_url down:
        # the embedded one is back within a health-check period (deployments/cluster/job_broker.py).
        return OverloadedError("the job store (Redis) does not answer; retry",
                               code="jobs_unavailable", retry_after_s=1)
    logger.error("unexpected error", exc_info=exc)
    return InternalError("internal error")


def error_response(err: ServeAppError) -> JSONResponse:
    """Render ``err`` as the OpenAI error body with its status and headers."""
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    if err.retry_after_ms is not None:  # read first by the OpenAI SDKs (up to 60 s)
        headers["retry-after-ms"] = str(err.retry_after_ms)
    if err.queue_position is not None:
        headers["X-Queue-Position"] = str(err.queue_position)
    return JSONResponse(err.to_body(), status_code=err.status_code, headers=headers)


def validation_error(errors: Sequence[Any]) -> ServeAppError:
    """The 400 of a body that failed validation with pydantic's ``errors`` (their ``loc``
    without a leading ``"body"``): ``invalid_json``, else the first offending field."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return InvalidRequestError("the body is not valid JSON", code="invalid_json")
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = loc[0] if loc else "body"
    where = ".".join(loc) or "body"
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "field required"
    elif first.get("type") == "extra_forbidden":
        message = "unrecognized request argument"
    elif first.get("type") == "model_attributes_type":
        message = "the body must be a JSON object"
    return InvalidRequestError(f"{where}: {message}", code=field)


def _allowed(request: Request) -> list[str]:
    """The methods of every route of the app at the request's path."""
    methods = {method for route in request.app.router.routes
               if isinstance(route, Route) and route.matches(request.scope)[0] is Match.PARTIAL
               for method in route.methods or ()}
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error raised inside ``app`` through :func:`error_response`."""

    @app.exception_handler(ServeAppError)
    async def _ours(_: Request, exc: ServeAppError) -> JSONResponse:
        return error_response(as_serve_app_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:  # an inference route no model serves has its own 404
            err: ServeAppError = NotFoundError(
                f"no such route: {request.url.path} (GET /openapi.json lists the routes)")
        elif exc.status_code == 400:  # FastAPI could not decode the body (e.g. bad UTF-8)
            err = InvalidRequestError("the body is not valid JSON (or not UTF-8)",
                                      code="invalid_json")
        else:
            err = InvalidRequestError(str(exc.detail), code="invalid_request")
            err.status_code = exc.status_code
        response = error_response(err)
        # Starlette's own headers stay: a 405 must list the route's methods in `Allow`
        # (RFC 9110 15.5.6), of every route at the path (Starlette names the first one's).
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(_allowed(request))
        return response

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        return error_response(as_serve_app_error(exc))
