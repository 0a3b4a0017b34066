"""One way every server reads and decodes a request body, under one limit.

The limit (`MAX_BODY_BYTES`) is the same on every hop, because the same images travel through all of them as
``data:`` URIs (client → proxy → prefill → encoder): a body one hop accepts, the next one accepts too.
"""
from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import msgspec

from epd_lab.serving.errors import BadRequest, PayloadTooLarge

__all__ = ["MAX_BODY_BYTES", "SMALL_BODY_BYTES", "client_gone", "decode_body", "read_body", "read_struct"]

MAX_BODY_BYTES = 64 << 20  # several data-URI images are MiBs; larger bodies are refused with 413
SMALL_BODY_BYTES = 64 << 10  # bodies up to this decode in µs, on the event loop; larger ones in a thread

T = TypeVar("T")


async def read_body(request: Any, limit: int = MAX_BODY_BYTES) -> bytearray:
    """The request body, at most `limit` bytes (`PayloadTooLarge` beyond); not copied into `bytes` (msgspec
    reads any buffer). A body over the limit is drained up to twice the limit, so that the client reads the
    413 rather than a reset connection; a declared length beyond that is refused before reading."""
    length = request.headers.get("content-length", "")
    too_large = PayloadTooLarge(f"request body larger than {limit} bytes")
    if length.isdigit() and int(length) > 2 * limit:
        _count_refusal(request)
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > 2 * limit:
            break
    if len(body) > limit:
        _count_refusal(request)
        raise too_large
    return body


def _count_refusal(request: Any) -> None:
    """``body_too_large`` in the refusals of the server's floor (`role_app` keeps them in the app's state)."""
    refusals = getattr(getattr(request.scope.get("app"), "state", None), "refusals", None)
    if refusals is not None:
        refusals["body_too_large"] += 1


def client_gone(request: Any) -> bool:
    """Whether the client closed the connection, once the body was read: Starlette's `Request.is_disconnected`
    without its cancel scope, about a thirteenth of its cost (`data/bench/client-gone-check-cpu-amd-epyc.json`; a
    lone split request makes three such checks on its critical path: proxy, prefill, encoder). The ASGI
    ``receive`` is stepped once: a message it has now is read, one it would wait for is not waited for (the step
    is closed, as a cancel would end it). A receive that suspends for any other reason reads as "not gone", never
    as a hang."""
    if request._is_disconnected:  # Starlette's own flag, which its `is_disconnected` keeps too
        return True
    step = request.receive()
    try:
        step.send(None)
    except StopIteration as done:
        message = done.value
    else:
        step.close()
        return False
    if message.get("type") == "http.disconnect":
        request._is_disconnected = True
        return True
    return False


def decode_body(body: bytes | bytearray, typ: type[T] = Any) -> T:  # type: ignore[assignment]
    """`typ` from a JSON body (any JSON without one); `BadRequest` naming the type when it is not one, or when
    it nests deeper than the decoder recurses."""
    try:
        return msgspec.json.decode(body, type=typ)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        what = "JSON body" if typ is Any else getattr(typ, "__name__", "JSON body")
        raise BadRequest(f"malformed {what}: {exc}") from None


async def read_struct(request: Any, typ: type[T] = Any, limit: int = MAX_BODY_BYTES) -> T:  # type: ignore[assignment]
    """`read_body`, then `decode_body`: on the event loop when the body is small, in a thread when not (tens
    of MiB of JSON take milliseconds, which would stall every other request on the loop)."""
    body = await read_body(request, limit)
    if len(body) <= SMALL_BODY_BYTES:
        return decode_body(body, typ)
    return await asyncio.to_thread(decode_body, body, typ)
