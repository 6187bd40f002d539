"""The one error type a request can end in, and its OpenAI-shaped body.

Every failure the proxy answers itself is a `ProxyError` with an honest status: 400 for a
body that is not a JSON object or a content part the proxy's rules refuse (`parts`), 401
for a missing or wrong API key, 408 for a body that did not arrive in time, 413 for an
oversized body, 429 for a tenant with too many requests in flight or a request that
waited too long for an encoder slot (with `Retry-After`), 502 when a
prefill/decode instance failed or answered 5xx, 503 when none is healthy (or the proxy
has as many connections as it takes), 504 when one stayed silent past its timeout. The
body is the shape OpenAI clients parse: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class ProxyError(Exception):
    """A request the proxy answers with an error of its own; one with a `reason` was refused
    before any backend saw it, and is counted under that reason (`rejected_total`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        reason: str | None = None,
        retry_after: int | None = None,
        upstream: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.retry_after = retry_after  # seconds, sent as `Retry-After`
        self.upstream = upstream  # the backend URL whose failure this is, if one's


class _Body(msgspec.Struct):
    message: str
    type: str
    param: None
    code: int


class _Envelope(msgspec.Struct):
    error: _Body


def error_body(status: int, message: str) -> bytes:
    """The OpenAI-shaped JSON body of an error with `status`."""
    body = _Body(message=message, type=_TYPES.get(status, "error"), param=None, code=status)
    return msgspec.json.encode(_Envelope(error=body))


def error_response(status: int, message: str, retry_after: int | None = None) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.Response(
        status=status,
        body=error_body(status, message),
        content_type="application/json",
        headers=headers,
    )
