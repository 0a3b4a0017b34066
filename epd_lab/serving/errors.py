"""Typed errors that carry their HTTP status: a role raises one, the serving floor answers it.

No handler matches message text: the class (or its `status`) says how a failure is answered, and `code` says
what a client can branch on (the proxy's OpenAI error objects carry it).
"""
from __future__ import annotations

__all__ = ["BadGateway", "BadRequest", "ClientClosed", "Conflict", "Forbidden", "GatewayTimeout", "NotFound",
           "PayloadTooLarge", "ServingError", "Unavailable", "error_for_status"]


class ServingError(Exception):
    """A request that cannot be served, answered with `status` and `detail`; `code` names the failure for
    clients (machine-readable, stable)."""

    status = 500
    code = "internal_error"

    def __init__(self, detail: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class BadRequest(ServingError):
    """The request itself is wrong (malformed body, bad field, unknown item)."""

    status, code = 400, "invalid_request"


class Forbidden(ServingError):
    """The request names something policy does not allow."""

    status, code = 403, "forbidden"


class NotFound(ServingError):
    status, code = 404, "not_found"


class Conflict(ServingError):
    """The request collides with one in flight (the same id held, already ready)."""

    status, code = 409, "conflict"


class PayloadTooLarge(ServingError):
    status, code = 413, "request_too_large"


class ClientClosed(ServingError):
    """The client went away before the answer (nginx's 499)."""

    status, code = 499, "client_disconnect"


class BadGateway(ServingError):
    """A peer (backend, encoder, producer) failed or answered something unusable."""

    status, code = 502, "backend_error"


class Unavailable(ServingError):
    """Refused now, without queueing (at capacity, pool exhausted, no backend up); the client may retry, after
    `retry_after` seconds when given (the answer's ``Retry-After``)."""

    status, code = 503, "service_unavailable"

    def __init__(self, detail: str, *, code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(detail, code=code)
        self.retry_after = retry_after


class GatewayTimeout(ServingError):
    """A peer did not answer within its bound."""

    status, code = 504, "backend_timeout"


_BY_STATUS = {cls.status: cls for cls in (BadRequest, Forbidden, NotFound, Conflict, PayloadTooLarge, ClientClosed,
                                          BadGateway, Unavailable, GatewayTimeout)}


def error_for_status(status: int, detail: str) -> ServingError:
    """The typed error for an HTTP `status` (a peer's answer, an unknown route); `ServingError` with that
    status when no class is named for it."""
    cls = _BY_STATUS.get(status)
    return cls(detail) if cls is not None else ServingError(detail, status=status)
