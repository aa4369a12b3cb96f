"""One typed error hierarchy for everything a client can be told.

Every error that may reach a client is a :class:`ServeAppError` carrying the HTTP status, the
OpenAI-style ``type`` and ``code`` of the README's error table and, for 503s, ``retry_after_s``. The
classes are plain picklable exceptions (no Ray, FastAPI or torch imports) so they cross Ray
actor boundaries unchanged; the ingress maps them to HTTP responses in exactly one place
(:func:`deployments.http.http_errors.error_response`).

Messages are written for clients: they never contain tracebacks or internal detail.
"""

from __future__ import annotations

import math
from typing import Any


class ServeAppError(Exception):
    """Base class: a refusal or failure with a fixed HTTP meaning.

    Attributes:
        status_code: HTTP status sent to the client.
        type: the OpenAI error ``type`` string.
        code: the machine-readable ``code`` string (see the README's error table).
        message: human-readable, safe to show to clients.
        retry_after_s: for 503s, whole seconds the client should wait (>= 1), else ``None``.
        retry_after_ms: for 503s, the same wait in milliseconds, not rounded up to whole
            seconds (the ``retry-after-ms`` header the OpenAI SDKs read first), else ``None``.
        queue_position: requests that were ahead of this one when it was queued, if it was.
    """

    status_code: int = 500
    type: str = "internal_error"
    default_code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        retry_after_s: float | None = None,
        queue_position: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.retry_after_s = None if retry_after_s is None else math.ceil(retry_after_s)
        self.retry_after_ms = None if retry_after_s is None else _ms(retry_after_s)
        self.queue_position = queue_position

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments are lost by Exception's default pickling; keep them (the
        # wait with its milliseconds).
        wait_s = None if self.retry_after_ms is None else self.retry_after_ms / 1000
        return (_rebuild, (type(self), self.message, self.code, wait_s, self.queue_position))

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


def _ms(wait_s: float) -> int:
    """A wait in whole milliseconds, rounded up, at least 1."""
    return max(1, math.ceil(wait_s * 1000 - 1e-6))


def _rebuild(cls: type[ServeAppError], message: str, code: str | None,
             retry_after_s: float | None, queue_position: int | None) -> ServeAppError:
    return cls(message, code=code, retry_after_s=retry_after_s, queue_position=queue_position)


class InvalidRequestError(ServeAppError):
    """400: the request is malformed or fails validation; ``code`` names the field."""

    status_code = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class RequestTooLargeError(InvalidRequestError):
    """400 ``request_too_large``: the estimated bytes exceed the whole budget; it can never run."""

    default_code = "request_too_large"


class AuthenticationError(ServeAppError):
    """401 ``invalid_api_key``."""

    status_code = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class NotFoundError(ServeAppError):
    """404 ``not_found``: a path the app does not have."""

    status_code = 404
    type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    """404 ``model_not_found``: unknown model, or a route the named model (or, unnamed, any
    model of the app) does not serve."""

    default_code = "model_not_found"


class BodyTooLargeError(ServeAppError):
    """413 ``body_too_large``: the HTTP body exceeds ``limits.max_body_bytes``."""

    status_code = 413
    type = "invalid_request_error"
    default_code = "body_too_large"


class IdempotencyKeyReusedError(ServeAppError):
    """422 ``idempotency_key_reused``: the same Idempotency-Key came with a different body."""

    status_code = 422
    type = "invalid_request_error"
    default_code = "idempotency_key_reused"


class OverloadedError(ServeAppError):
    """503: a transient capacity refusal, always with a wait: ``retry_after_s`` (whole
    seconds, >= 1, for ``Retry-After``) and ``retry_after_ms`` (the same wait unrounded, >= 1).
    ``retry_after_s`` given as a float keeps its milliseconds; ``None`` means 1 s.

    ``code`` is one of ``queue_full``, ``queue_timeout``, ``predicted_timeout``, ``oom``,
    ``no_replicas``, ``draining``, ``jobs_full``, ``jobs_unavailable``.
    """

    status_code = 503
    type = "overloaded"
    default_code = "queue_full"

    def __init__(self, message: str, *, code: str | None = None,
                 retry_after_s: float | None = None, queue_position: int | None = None) -> None:
        super().__init__(message, code=code,
                         retry_after_s=1.0 if retry_after_s is None else retry_after_s,
                         queue_position=queue_position)
        self.retry_after_s = max(1, self.retry_after_s)


class TenantQuotaError(OverloadedError):
    """429 ``tenant_quota``: the request's tenant holds or waits for its whole quota
    (``auth.tenants[].max_share`` / ``max_waiting``) while the service may have room for
    others (the Gateway API inference extension's doctrine: 429 for a client over its share,
    503 for a service without capacity). Transient, always with a wait, as its base."""

    status_code = 429
    type = "rate_limit_error"
    default_code = "tenant_quota"


class InferenceTimeoutError(ServeAppError):
    """504 ``inference_timeout``: inference ran longer than ``admission.inference_timeout_s``."""

    status_code = 504
    type = "timeout"
    default_code = "inference_timeout"


class InternalError(ServeAppError):
    """500 ``internal_error``: a bug. The message stays generic."""
