"""``Idempotency-Key`` at the ingress: a keyed request runs once cluster-wide, every caller
gets the same answer (the state lives in
:class:`deployments.cluster.idempotency_store.IdempotencyStore`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from ray.serve.handle import DeploymentHandle

from deployments.http.http_errors import as_serve_app_error, error_response
from deployments.http.model_client import ModelClient
from serve_app.errors import IdempotencyKeyReusedError, InvalidRequestError, OverloadedError
from serve_app.idempotency import StoredResponse
from serve_app.metrics import ProcessMetrics
from serve_app.outcomes import IdempotencyHit


class IdempotencyGuard:
    """Runs a request once per ``Idempotency-Key`` (see :meth:`run`).

    Args:
        store: handle to the ``IdempotencyStore`` deployment.
        client: calls the store (typed errors on failure).
        wait_s: the longest a duplicate waits for the first one's outcome
            (``max_queue_wait_s + inference_timeout_s + 5``).
        metrics: the ingress's metrics (``idempotency_hits``).
    """

    def __init__(self, store: DeploymentHandle, client: ModelClient, wait_s: float,
                 metrics: ProcessMetrics) -> None:
        self._store, self._client = store, client
        self._wait_s, self._metrics = wait_s, metrics

    async def run(self, request: Request, body: BaseModel,
                  run: Callable[[], Awaitable[JSONResponse]]) -> Response:
        """Run ``run`` once per ``Idempotency-Key`` cluster-wide: concurrent duplicates wait
        for the first one's outcome, later ones within ``idempotency.ttl_s`` replay it (with
        ``Idempotent-Replayed: true``), the same key with another body gets 422. A 5xx is not
        recorded, so a retry runs again. Without a key, ``run`` runs.

        Raises:
            InvalidRequestError: the key is not 1-255 visible ASCII characters.
            IdempotencyKeyReusedError: the key came with another body (422).
        """
        key = checked_key(request.headers.get("idempotency-key"))
        if key is None:
            return await run()
        digest = hashlib.sha256(
            f"{request.url.path}\n{body.model_dump_json()}".encode()).hexdigest()
        for _ in range(2):  # a second round if the first runner gave up (transient failure)
            action, stored = await self._client.call(self._store.begin, key, digest)
            if action == "mismatch":
                raise IdempotencyKeyReusedError(
                    "this Idempotency-Key was used with a different request body")
            if action == "wait":
                stored = await self._client.call(self._store.wait, key, self._wait_s)
            if stored is not None:
                self._metrics.inc("idempotency_hits",
                                  outcome=IdempotencyHit.COALESCED if action == "wait"
                                  else IdempotencyHit.REPLAYED)
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
                await self._client.call(self._store.abort, key)
            else:
                await self._client.call(self._store.finish, key,
                                        _stored(error_response(err)))
            raise err from None
        await self._client.call(self._store.finish, key, _stored(response))
        return response


def _stored(response: JSONResponse) -> StoredResponse:
    headers = {k: v for k, v in response.headers.items()
               if k.lower() not in ("content-length", "content-type")}
    return StoredResponse(response.status_code, headers, json.loads(response.body))


def _replay(stored: StoredResponse) -> JSONResponse:
    return JSONResponse(stored.body, status_code=stored.status_code,
                        headers={**stored.headers, "Idempotent-Replayed": "true"})


def checked_key(key: str | None) -> str | None:
    """An ``Idempotency-Key`` header's value, or ``None`` when absent.

    Raises:
        InvalidRequestError: the key is not 1-255 visible ASCII characters.
    """
    if key is not None and (not 1 <= len(key) <= 255
                            or not all(33 <= ord(c) <= 126 for c in key)):
        raise InvalidRequestError("Idempotency-Key must be 1-255 visible ASCII characters",
                                  code="idempotency_key")
    return key
