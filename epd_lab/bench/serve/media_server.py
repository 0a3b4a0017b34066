"""A static media server for `epd-lab bench serve`: the run's images by URL instead of inside the request.

    with MediaServer() as media:
        url = media.add(png_bytes)         # http://127.0.0.1:<port>/m/0.png, fetched by the encoders

It holds the images in memory and serves ``GET /m/<n>.<ext>`` from a thread, on 127.0.0.1 and a port the OS
chooses. An encoder fetches loopback URLs only when its media policy allows private hosts
(``--media-private-hosts``; `epd_lab.ep.media.MediaPolicy`), which the bench sets on the clusters it launches.
"""
from __future__ import annotations

import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_TYPES = {b"\x89PNG": ("png", "image/png"), b"\xff\xd8\xff": ("jpg", "image/jpeg")}


def _kind(raw: bytes) -> tuple[str, str]:
    """(extension, content type) from the image's magic bytes; octet-stream when unknown."""
    return next((kind for magic, kind in _TYPES.items() if raw.startswith(magic)), ("bin", "application/octet-stream"))


class MediaServer:
    """Serves registered bytes over HTTP on loopback; a context manager (`close` stops it, idempotent)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._items: dict[str, tuple[bytes, str]] = {}
        self._added = 0  # names are never reused, even after `clear`
        self.requests = 0  # GETs answered, for the report (each image fetched once per encoder that needs it)
        items, served = self._items, self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept-alive connections for fetchers that reuse them

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                item = items.get(self.path)
                if item is None:
                    self.send_error(HTTPStatus.NOT_FOUND)
                    return
                raw, content_type = item
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
                served.requests += 1

            def log_message(self, *args: object) -> None:  # a line per GET would flood the bench's output
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="bench-media", daemon=True)
        self._thread.start()
        self._closed = False

    def add(self, raw: bytes) -> str:
        """Serve `raw` (an image's bytes); returns its URL."""
        ext, content_type = _kind(raw)
        path = f"/m/{self._added}.{ext}"
        self._added += 1
        self._items[path] = (raw, content_type)
        return self.url + path

    def clear(self) -> None:
        """Stop serving everything added so far (its URLs answer 404 from now on)."""
        self._items.clear()

    def close(self) -> None:
        """Stop serving and close the socket."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> "MediaServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
