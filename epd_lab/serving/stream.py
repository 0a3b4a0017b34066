"""A streamed answer that cleans up however it ends (imported by the servers only: it needs Starlette, which the
rest of `epd_lab.serving` imports lazily)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that closes its body generator and then runs `on_close`, however it ends.

    Starlette stops iterating when the client goes away but leaves a generator suspended at ``yield`` (or never
    started, so its own ``finally`` never runs) to the garbage collector; here the generator is closed at once
    and `on_close` runs in every case (the proxy closes the upstream stream, decode cancels the generation and
    gives its admission back).
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._content.aclose()  # type: ignore[attr-defined]  # an async generator
            finally:
                await self._on_close()
