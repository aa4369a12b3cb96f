"""The HTTP ingress: OpenAI-compatible routes in a FastAPI app inside a Ray Serve deployment.

It validates requests, enforces the body limit, calls the model deployment through its handle
and turns results and typed errors into HTTP responses (errors only through
:mod:`serve_app.http_errors`). Ray Serve's proxy already reads or assigns ``X-Request-Id`` and
echoes it on every response; the ingress reads it from the request for its logs.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from deployments.engines.base import GenerationParams
from deployments.http_middleware import BodyLimitMiddleware, HttpMetricsMiddleware
from deployments.openapi import INFERENCE_ERRORS, INFERENCE_PARAMETERS, responses
from deployments.pricing import IngressPricer
from deployments.registry import PUBLISH_PERIOD_S
from serve_app.admission.drain import retry_after_s
from serve_app.config import parse_args
from serve_app.errors import (
    AuthenticationError,
    IdempotencyKeyReusedError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    ServeAppError,
)
from serve_app.http_errors import (
    as_serve_app_error,
    error_response,
    install_error_handlers,
)
from serve_app.idempotency import StoredResponse
from serve_app.metrics import ProcessMetrics, merge_expositions
from serve_app.schemas import (
    CompletionRequest,
    CompletionResponse,
    CompletionResult,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResult,
    HealthResponse,
    ModelList,
    ReadyResponse,
    StatusResponse,
)

logger = logging.getLogger("ray.serve")

STATUS_CACHE_S = 0.5

@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """OpenAI-compatible HTTP front of one model deployment.

    Args:
        raw_args: the config's ``args:`` (validated again here).
        model: handle to the :class:`deployments.model_server.ModelServer` deployment.
        registry: handle to :class:`deployments.registry.ReplicaRegistry`.
        idempotency: handle to :class:`deployments.idempotency.IdempotencyStore`.
    """

    async def __init__(self, raw_args: dict[str, Any], model: DeploymentHandle,
                       registry: DeploymentHandle, idempotency: DeploymentHandle) -> None:
        self._args = parse_args(raw_args)
        self._model = model
        self._registry = registry
        self._idempotency = idempotency
        self._created = int(time.time())
        self._api_key = self._args.auth.resolved_key().encode()
        self._statuses: list[dict[str, Any]] = []
        self._statuses_at = -float("inf")
        context = serve.get_replica_context()
        self._replica_id = context.replica_id.unique_id if context else "local"
        self._metrics = ProcessMetrics(context.deployment if context else "Ingress",
                                       self._replica_id)
        self._publisher = asyncio.get_running_loop().create_task(self._publish_metrics())
        self._pricer = await asyncio.to_thread(IngressPricer, self._args)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray Serve calls this after ``__init__``; the routes close over this replica."""
        app = FastAPI(title="vramgate",
                      description="Memory-budget admission for model serving on Ray Serve.",
                      dependencies=[Depends(self._authenticate)])
        app.add_middleware(BodyLimitMiddleware, max_body_bytes=self._args.limits.max_body_bytes)
        app.add_middleware(HttpMetricsMiddleware, metrics=self._metrics)
        install_error_handlers(app)
        if self._args.model.task in ("embed", "fake"):
            app.post("/v1/embeddings", response_model=None,
                     responses=responses(EmbeddingResponse, *INFERENCE_ERRORS, inference=True),
                     openapi_extra={"parameters": INFERENCE_PARAMETERS})(self.embeddings)
        if self._args.model.task in ("generate", "fake"):
            app.post("/v1/completions", response_model=None, responses=responses(
                CompletionResponse, *INFERENCE_ERRORS, inference=True, event_stream=(
                    "stream: true: each event's data is a CompletionResponse without usage "
                    "(an error after the first event comes in-band as an ErrorResponse); "
                    "the last one is `[DONE]`")),
                openapi_extra={"parameters": INFERENCE_PARAMETERS})(self.completions)
        app.get("/v1/models", response_model=None,
                responses=responses(ModelList, 401))(self.models)
        app.get("/v1/status", response_model=None,
                responses=responses(StatusResponse, 401))(self.status)
        app.get("/metrics", response_model=None, responses={
            200: {"description": "Prometheus text exposition (version 0.0.4)",
                  "content": {"text/plain": {"schema": {"type": "string"}}}},
            401: responses(HealthResponse, 401)[401]})(self.metrics)
        app.get("/healthz", response_model=None,
                responses=responses(HealthResponse))(self.healthz)
        app.get("/readyz", response_model=None,
                responses=responses(ReadyResponse, 503))(self.readyz)
        return app

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        """``POST /v1/embeddings`` (OpenAI-compatible)."""
        return await self._idempotent(request, body, lambda: self._embeddings(body))

    async def _embeddings(self, body: EmbeddingRequest) -> JSONResponse:
        self._check_model(body.model)
        texts = body.texts()
        if len(texts) > self._args.limits.max_inputs:
            raise InvalidRequestError(
                f"{len(texts)} inputs; the limit is {self._args.limits.max_inputs}",
                code="input")
        result: EmbeddingResult = await self._call_model(
            self._model.embed, texts, estimated_bytes=await self._estimated_bytes(texts))
        vectors = _fit_dimensions(result.embeddings, body.dimensions)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(vector, body.encoding_format)}
                for i, vector in enumerate(vectors)]
        usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
        return JSONResponse(
            {"object": "list", "data": data, "model": self._args.model.name, "usage": usage},
            headers=result.admitted.headers())

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """``POST /v1/completions`` (OpenAI-compatible; ``stream: true`` for server-sent
        events ending with ``data: [DONE]``)."""
        self._check_model(body.model)
        if body.max_tokens > self._args.limits.max_tokens:
            raise InvalidRequestError(
                f"max_tokens={body.max_tokens} exceeds the limit of "
                f"{self._args.limits.max_tokens}", code="max_tokens")
        params = GenerationParams(body.max_tokens, body.temperature, body.top_p, body.seed,
                                  body.stop_strings())
        completion_id = f"cmpl-{request.headers.get('x-request-id', uuid.uuid4().hex)}"
        created = int(time.time())
        if body.stream:
            if request.headers.get("idempotency-key") is not None:
                raise InvalidRequestError("Idempotency-Key is not supported with stream: true",
                                          code="idempotency_key")
            return await self._stream_completion(body.prompt, params, completion_id, created)
        return await self._idempotent(
            request, body, lambda: self._completion(body, params, completion_id, created))

    async def _completion(self, body: CompletionRequest, params: GenerationParams,
                          completion_id: str, created: int) -> JSONResponse:
        result: CompletionResult = await self._call_model(
            self._model.complete, body.prompt, params,
            estimated_bytes=await self._estimated_bytes([body.prompt], params.max_tokens))
        return JSONResponse({
            "id": completion_id, "object": "text_completion", "created": created,
            "model": self._args.model.name,
            "choices": [{"index": 0, "text": result.text, "logprobs": None,
                         "finish_reason": result.finish_reason}],
            "usage": {"prompt_tokens": result.prompt_tokens,
                      "completion_tokens": result.completion_tokens,
                      "total_tokens": result.prompt_tokens + result.completion_tokens},
        }, headers=result.admitted.headers())

    async def _stream_completion(self, prompt: str, params: GenerationParams,
                                 completion_id: str, created: int) -> StreamingResponse:
        """Admission errors come before the first byte, as ordinary HTTP errors; anything
        after it goes in-band as a final ``data: {"error": ...}`` event, then ``[DONE]``."""
        estimated_bytes = await self._estimated_bytes([prompt], params.max_tokens)
        stream = self._model.options(stream=True).complete_stream.remote(
            prompt, params, estimated_bytes=estimated_bytes, sent_at_s=time.time())
        await self._wait_for_a_replica(stream)
        first = await self._call_deployment(lambda: stream.__anext__())

        def chunk(text: str, finish_reason: str | None) -> str:
            return _sse({"id": completion_id, "object": "text_completion", "created": created,
                         "model": self._args.model.name,
                         "choices": [{"index": 0, "text": text, "logprobs": None,
                                      "finish_reason": finish_reason}]})

        async def events() -> AsyncIterator[str]:
            try:
                async for item in stream:
                    if "text" in item:
                        yield chunk(item["text"], None)
                    else:
                        yield chunk("", item["finish_reason"])
            except Exception as exc:  # after the first byte: in-band, never a broken stream
                yield _sse(as_serve_app_error(exc).to_body())
            finally:
                stream.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**first["admitted"].headers(),
                                          "Cache-Control": "no-cache"})

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``."""
        return {"object": "list", "data": [{
            "id": self._args.model.name, "object": "model", "created": self._created,
            "owned_by": "vramgate"}]}

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``: every live model replica's admission state."""
        return {"model": self._args.model.name, "replicas": await self._replica_statuses()}

    async def metrics(self) -> Response:
        """``GET /metrics``: the project's metrics of every ingress and model replica, in
        Prometheus text format (see :mod:`serve_app.metrics`). Every process's series come
        from what it last published to the registry (at most one publish period old), so
        scrapes answered by different ingress replicas agree and counters never go back."""
        texts = await self._call_deployment(self._registry.metrics)
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)

    async def _publish_metrics(self) -> None:
        while True:
            try:
                await self._registry.publish_metrics.remote(self._replica_id,
                                                            self._metrics.exposition())
            except Exception:  # the registry restarting must not take the ingress down
                logger.warning("could not publish metrics to the registry", exc_info=True)
            await asyncio.sleep(PUBLISH_PERIOD_S)

    def __del__(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.cancel()

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

    async def _idempotent(self, request: Request, body: Any,
                          run: Callable[[], Awaitable[JSONResponse]]) -> Response:
        """Run ``run`` once per ``Idempotency-Key`` cluster-wide: concurrent duplicates wait
        for the first one's outcome, later ones within ``idempotency.ttl_s`` replay it (with
        ``Idempotent-Replayed: true``), the same key with another body gets 422. A 503 is not
        recorded, so a retry runs again."""
        key = request.headers.get("idempotency-key")
        if key is None:
            return await run()
        if not 1 <= len(key) <= 255 or not all(33 <= ord(c) <= 126 for c in key):
            raise InvalidRequestError("Idempotency-Key must be 1-255 visible ASCII characters",
                                      code="idempotency_key")
        digest = hashlib.sha256(
            f"{request.url.path}\n{body.model_dump_json()}".encode()).hexdigest()
        for _ in range(2):  # a second round if the first runner gave up (transient failure)
            action, stored = await self._call_deployment(self._idempotency.begin, key, digest)
            if action == "mismatch":
                raise IdempotencyKeyReusedError(
                    "this Idempotency-Key was used with a different request body")
            if action == "wait":
                limits = self._args.admission
                stored = await self._call_deployment(
                    self._idempotency.wait, key,
                    limits.max_queue_wait_s + limits.inference_timeout_s + 5)
            if stored is not None:
                self._metrics.inc("idempotency_hits",
                                  outcome="coalesced" if action == "wait" else "replayed")
                return _replay(stored)
            if action == "run":
                return await self._run_and_record(key, run)
        raise OverloadedError("a request with this Idempotency-Key is still running",
                              code="queue_timeout", retry_after_s=1)

    async def _run_and_record(self, key: str,
                              run: Callable[[], Awaitable[JSONResponse]]) -> JSONResponse:
        try:
            response = await run()
        except Exception as exc:
            err = as_serve_app_error(exc)
            if err.status_code >= 500:  # transient or a bug: do not pin it on the key
                await self._call_deployment(self._idempotency.abort, key)
            else:
                rendered = error_response(err)
                await self._call_deployment(self._idempotency.finish, key, _stored(rendered))
            raise err from None
        await self._call_deployment(self._idempotency.finish, key, _stored(response))
        return response

    async def _estimated_bytes(self, texts: list[str], new_tokens: int = 0) -> int | None:
        """This request's price for the budget-aware router (:mod:`deployments.pricing`):
        ``texts`` embedded in one batch, or one prompt and ``new_tokens`` to generate.
        ``None`` (the router then ranks by queued bytes) while no replica has published a cost
        model, or if the tokenizer fails on the text: the replica, which prices again,
        decides what to do with it."""
        statuses = await self._replica_statuses()
        try:
            counts = await asyncio.to_thread(self._pricer.count_tokens, texts)
        except Exception:  # a hint only: the replica counts again and answers the error
            logger.debug("could not count tokens at the ingress", exc_info=True)
            return None
        batch = 1 if new_tokens else len(texts)
        return IngressPricer.price(statuses, batch, max(counts, default=0), new_tokens)

    async def _call_model(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Call a model replica's ``method`` as :meth:`_call_deployment` does, telling it when
        the request was sent (``sent_at_s``) and bounding the wait for a replica to accept it
        (:meth:`_wait_for_a_replica`)."""
        response = method.remote(*args, sent_at_s=time.time(), **kwargs)
        await self._wait_for_a_replica(response)
        return await self._call_deployment(lambda: response)

    async def _wait_for_a_replica(self, response: Any) -> None:
        """Wait until Ray Serve has handed ``response``'s request to a replica, at most
        ``admission.max_queue_wait_s``. Requests wait in the handle's queue while every
        replica has ``max_ongoing_requests`` in flight; Ray bounds that queue's length
        (``max_queued_requests``) but not its time, so the wait is bounded here, and the
        replica counts it against the same limit (``sent_at_s``): an admitted request waits
        ``max_queue_wait_s`` at most in all. Past it the request is cancelled: 503
        ``queue_timeout`` with ``Retry-After``. Other failures (back-pressure, no replica)
        are left to surface when the response is awaited.

        Uses ``DeploymentResponse._fetch_future_result_async`` (Ray Serve 2.60, pinned): it
        resolves once a replica was chosen and the request sent, which no public API tells.
        """
        assigned = asyncio.ensure_future(response._fetch_future_result_async())
        try:
            done, _ = await asyncio.wait({assigned},
                                         timeout=self._args.admission.max_queue_wait_s)
        except asyncio.CancelledError:  # the client left: so does the request
            assigned.cancel()
            response.cancel()
            raise
        if done:
            if not assigned.cancelled():
                assigned.exception()  # retrieved here; awaiting the response raises it again
            return
        assigned.cancel()
        response.cancel()
        self._metrics.inc("admission_decisions", outcome="rejected", reason="queue_timeout")
        raise OverloadedError(
            f"waited {self._args.admission.max_queue_wait_s:g} s for a model replica to "
            "accept the request", code="queue_timeout",
            retry_after_s=await self._cluster_retry_after_s())

    async def _call_deployment(self, method: Any, *args: Any, **kwargs: Any) -> Any:
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
            self._metrics.inc("admission_decisions", outcome="rejected", reason="queue_full")
            raise OverloadedError("every model replica is busy and its queue is full",
                                  code="queue_full",
                                  retry_after_s=await self._cluster_retry_after_s()) from None
        except Exception as exc:
            err = as_serve_app_error(exc)
            if err.code == "no_replicas":  # refused before any replica could decide
                self._metrics.inc("admission_decisions", outcome="rejected", reason=err.code)
            raise err from None

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

    async def _authenticate(self, request: Request) -> None:
        """Every route but the probes needs ``Authorization: Bearer <auth key>`` when a key is
        configured; compared in constant time (``hmac.compare_digest``)."""
        if not self._api_key or request.url.path in ("/healthz", "/readyz"):
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                  self._api_key):
            raise AuthenticationError("missing or invalid API key (send Authorization: "
                                      "Bearer <key>)")

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


def _stored(response: JSONResponse) -> StoredResponse:
    headers = {k: v for k, v in response.headers.items()
               if k.lower() not in ("content-length", "content-type")}
    return StoredResponse(response.status_code, headers, json.loads(response.body))


def _replay(stored: StoredResponse) -> JSONResponse:
    return JSONResponse(stored.body, status_code=stored.status_code,
                        headers={**stored.headers, "Idempotent-Replayed": "true"})


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
