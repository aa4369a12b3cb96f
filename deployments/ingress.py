"""The HTTP ingress: OpenAI-compatible routes in a FastAPI app inside a Ray Serve deployment.

It validates requests, enforces the body limit, calls the model deployment through its handle
and turns results and typed errors into HTTP responses (errors only through
:mod:`serve_app.http_errors`). Ray Serve's proxy already reads or assigns ``X-Request-Id`` and
echoes it on every response; the ingress reads it from the request for its logs.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import base64
import logging
import time
from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.admission.drain import retry_after_s
from serve_app.config import parse_args
from serve_app.errors import (
    BodyTooLargeError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    ServeAppError,
)
from serve_app.http_errors import as_serve_app_error, error_response, install_error_handlers
from serve_app.schemas import EmbeddingRequest, EmbeddingResult

logger = logging.getLogger("ray.serve")

STATUS_CACHE_S = 0.5


class BodyLimitMiddleware:
    """Refuses bodies over ``max_body_bytes`` with 413: at once when ``Content-Length`` says
    so, else as soon as the streamed (chunked) body passes the limit. A body within the limit
    is read here and handed on whole; later ``receive`` calls (disconnects) pass through."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self._app = app
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        too_large = error_response(
            BodyTooLargeError(f"the body exceeds {self._max_body_bytes} bytes"))
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self._max_body_bytes:
            await too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body_bytes:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self._app(scope, replay, send)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """OpenAI-compatible HTTP front of one model deployment.

    Args:
        raw_args: the config's ``args:`` (validated again here).
        model: handle to the :class:`deployments.model_server.ModelServer` deployment.
        registry: handle to :class:`deployments.registry.ReplicaRegistry`.
    """

    def __init__(self, raw_args: dict[str, Any], model: DeploymentHandle,
                 registry: DeploymentHandle) -> None:
        self._args = parse_args(raw_args)
        self._model = model
        self._registry = registry
        self._created = int(time.time())
        self._statuses: list[dict[str, Any]] = []
        self._statuses_at = -float("inf")

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray Serve calls this after ``__init__``; the routes close over this replica."""
        app = FastAPI(title="vramgate",
                      description="Memory-budget admission for model serving on Ray Serve.")
        app.add_middleware(BodyLimitMiddleware, max_body_bytes=self._args.limits.max_body_bytes)
        install_error_handlers(app)
        app.post("/v1/embeddings")(self.embeddings)
        app.get("/v1/models")(self.models)
        app.get("/v1/status")(self.status)
        app.get("/healthz")(self.healthz)
        app.get("/readyz")(self.readyz)
        return app

    async def embeddings(self, body: EmbeddingRequest) -> JSONResponse:
        """``POST /v1/embeddings`` (OpenAI-compatible)."""
        self._check_model(body.model)
        texts = body.texts()
        if len(texts) > self._args.limits.max_inputs:
            raise InvalidRequestError(
                f"{len(texts)} inputs; the limit is {self._args.limits.max_inputs}",
                code="input")
        result: EmbeddingResult = await self._call_model("embed", texts)
        vectors = _fit_dimensions(result.embeddings, body.dimensions)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(vector, body.encoding_format)}
                for i, vector in enumerate(vectors)]
        usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
        return JSONResponse(
            {"object": "list", "data": data, "model": self._args.model.name, "usage": usage},
            headers={"X-Queue-Wait-Ms": str(round(result.queue_wait_s * 1000)),
                     "X-Queue-Position": str(result.queue_position)})

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``."""
        return {"object": "list", "data": [{
            "id": self._args.model.name, "object": "model", "created": self._created,
            "owned_by": "vramgate"}]}

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``: every live model replica's admission state."""
        return {"model": self._args.model.name, "replicas": await self._replica_statuses()}

    async def healthz(self) -> dict[str, str]:
        """``GET /healthz``: 200 while the ingress runs."""
        return {"status": "ok"}

    async def readyz(self) -> JSONResponse:
        """``GET /readyz``: 200 once a model replica has loaded and measured its model."""
        replicas = await self._replica_statuses()
        if not replicas:
            return error_response(OverloadedError(
                "no model replica has loaded and measured its model yet", code="no_replicas",
                retry_after_s=1))
        return JSONResponse({"status": "ready", "replicas": len(replicas)})

    async def _call_model(self, method: str, *args: Any) -> Any:
        """Call the model deployment; any failure leaves as a typed error (Ray's back-pressure
        and unavailability included), so FastAPI's handlers render it."""
        try:
            return await getattr(self._model, method).remote(*args)
        except ServeAppError:
            raise
        except BackPressureError:
            raise OverloadedError("every model replica is busy and its queue is full",
                                  code="queue_full",
                                  retry_after_s=await self._cluster_retry_after_s()) from None
        except Exception as exc:
            raise as_serve_app_error(exc) from None

    async def _cluster_retry_after_s(self) -> int:
        """``Retry-After`` for a request refused before reaching a replica: the bytes queued
        on all replicas over their summed measured drain rate (from the registry)."""
        replicas = await self._replica_statuses()
        queued = sum(r["queued_bytes"] for r in replicas)
        rate = sum(r["drain_bytes_per_s"] or 0.0 for r in replicas)
        return retry_after_s(queued, rate, fallback_s=self._args.admission.max_queue_wait_s)

    async def _replica_statuses(self) -> list[dict[str, Any]]:
        """The registry's snapshot (at most ``STATUS_CACHE_S`` old: refusals under load must
        not flood the registry)."""
        now = time.monotonic()
        if now - self._statuses_at >= STATUS_CACHE_S:
            try:
                self._statuses = await self._registry.snapshot.remote()
            except Exception as exc:  # the registry restarting: no replicas, not a 500
                logger.warning("replica registry unavailable: %s",
                               as_serve_app_error(exc).message)
                self._statuses = []
            self._statuses_at = now
        return self._statuses

    def _check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self._args.model.name:
            raise ModelNotFoundError(
                f"model {requested!r} is not served here; this deployment serves "
                f"{self._args.model.name!r}")


def _fit_dimensions(embeddings: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Truncate to ``dimensions`` and re-normalise (OpenAI's ``dimensions`` parameter)."""
    if dimensions is None or dimensions == embeddings.shape[1]:
        return embeddings
    if dimensions > embeddings.shape[1]:
        raise InvalidRequestError(
            f"dimensions={dimensions} exceeds the model's {embeddings.shape[1]}",
            code="dimensions")
    cut = embeddings[:, :dimensions]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
