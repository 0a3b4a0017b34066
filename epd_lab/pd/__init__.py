"""P→D servers: the prefill server (E→P, then the KV producer) and the decode server (KV consumer, generation).

- `messages`: the HTTP bodies (`PrefillRequest`, `PrefillResponse`, `KVTransferParams`, `DecodeRequest`, ...).
- `prefill_server`: ``python -m epd_lab.pd.prefill_server --port 0 [--encoders URL,URL]``: ``POST /v1/prefill``.
- `decode_server`: ``python -m epd_lab.pd.decode_server --port 0``: ``POST /v1/decode`` (NDJSON streaming too).

Both start like the encoders (`epd_lab.launch`): port 0, then one JSON line ``{"url", "pid"}`` on stdout once
serving. This module holds what the two servers share (binding, serving, bodies, errors, metrics text).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any

__all__ = ["bind_tcp", "metrics_text", "serve_and_announce"]


def bind_tcp(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn. IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY on accepted
    sockets only when the listening socket says it is TCP (with proto 0, Nagle + delayed ACK add ~40 ms)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def url_of(host: str, sock: socket.socket) -> str:
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{sock.getsockname()[1]}"


def serve_and_announce(app: Any, sock: socket.socket, url: str, graceful_s: float) -> int:
    """Serve `app` on `sock` until SIGINT/SIGTERM, printing ``{"url", "pid"}`` once serving; 1 when start-up
    (the lifespan: model load, engine) failed."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=int(graceful_s) + 1)
    server = uvicorn.Server(config)

    async def run() -> bool:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:  # the launcher reads this line to learn the port
            print(json.dumps({"url": url, "pid": os.getpid()}), flush=True)
        await task
        return server.started

    return 0 if asyncio.run(run()) else 1


def metrics_text(prefix: str, values: list[tuple[str, str, float, str]]) -> str:
    """Prometheus text exposition of (name, kind, value, help) rows."""
    lines: list[str] = []
    for name, kind, value, help_ in values:
        lines += [f"# HELP {prefix}_{name} {help_}", f"# TYPE {prefix}_{name} {kind}", f"{prefix}_{name} {value}"]
    return "\n".join(lines) + "\n"
