"""A streamed answer that cleans up however it ends (imported by the servers only: it needs Starlette, which the
rest of `epd_lab.serving` imports lazily)."""
from __future__ import annotations

import asyncio
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
            await self._send_while_connected(receive, send)
        finally:
            try:
                await self._content.aclose()  # type: ignore[attr-defined]  # an async generator
            finally:
                await self._on_close()

    async def _send_while_connected(self, receive: Receive, send: Send) -> None:
        """`stream_response` from this task, cancelled by a listener task when the client disconnects: what
        Starlette does for uvicorn (ASGI spec < 2.4) with a task group whose new task sends the body, so the first
        chunk (the proxy's token 0) left one scheduling later."""
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def listen() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()  # lands on the await this task is suspended in: the listener runs only then

        listener = asyncio.ensure_future(listen())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:  # cancelled from outside: the server is shutting down
                raise
            task.uncancel()
        finally:
            listener.cancel()  # before any await: once this task runs, the listener can no longer cancel it
