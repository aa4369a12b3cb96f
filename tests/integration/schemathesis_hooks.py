"""Schemathesis extension loaded by ``test_openapi_fuzz.py``'s ``st run`` (as a hooks file): one
more check on every response, the README's error table."""

from __future__ import annotations

import json

import schemathesis


@schemathesis.check
def contract_errors(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                    case: schemathesis.Case) -> None:
    """No body carries a traceback; every error is the OpenAI error shape
    ``{"error": {"message": str, "type": str, "code": str | null}}`` and never
    ``internal_error``; a 503 has ``Retry-After`` of at least 1 whole second."""
    text = response.text or ""
    if "Traceback (most recent call last)" in text or 'File "/' in text:
        raise AssertionError(f"a traceback in the body: {text[:500]!r}")
    if response.status_code < 400:
        return
    try:
        body = json.loads(text)
    except ValueError:
        raise AssertionError(f"{response.status_code} body is not JSON: {text[:200]!r}") from None
    error = body.get("error") if isinstance(body, dict) else None
    if (set(body) != {"error"} or not isinstance(error, dict)
            or set(error) != {"message", "type", "code"}
            or not isinstance(error["message"], str) or not isinstance(error["type"], str)
            or not (error["code"] is None or isinstance(error["code"], str))):
        raise AssertionError(f"{response.status_code} body is not the OpenAI error shape: {body}")
    if error["type"] == "internal_error":
        raise AssertionError(f"an internal error: {body}")
    if response.status_code == 503:
        retry_after = (response.headers.get("retry-after") or [""])[0]
        if not (retry_after.isdigit() and int(retry_after) >= 1):
            raise AssertionError(f"503 without a valid Retry-After ({retry_after!r}): {body}")
