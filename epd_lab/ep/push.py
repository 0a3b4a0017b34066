"""ZMQ PUSH sockets to receivers, cached per destination (the encoder's notification channel)."""
from __future__ import annotations

import collections
import threading

import zmq

from epd_lab import security
from epd_lab.failpoints import failpoint

NOTIFY_MAX_BYTES = 1 << 20  # a metadata-only notification (mooncake backend) is far smaller: the receiver's bound


class PushSockets:
    """ZMQ PUSH sockets, one per destination URL, from one context; ``LINGER=0`` so closing never hangs.

    At most `max_sockets` are kept (least recently used closed first): zmq_to_scheduler receivers may
    bind a new port per request. With a shared secret (`secret`, or ``EPD_SECRET`` from the environment
    when None) every frame carries its HMAC tag (`epd_lab.security.sign`), which the receiver checks.
    """

    def __init__(self, send_timeout: float, max_sockets: int = 64, secret: bytes | str | None = None) -> None:
        self._secret = security.resolve(secret)
        self._ctx = zmq.Context()
        self._sockets: collections.OrderedDict[str, zmq.Socket] = collections.OrderedDict()
        self._max_sockets = max_sockets
        self._send_timeout_ms = max(1, int(send_timeout * 1000))
        self._lock = threading.Lock()  # a ZMQ socket is not thread-safe; sends come from worker threads

    def push(self, url: str, frame: bytes) -> None:
        """Queue `frame` for `url`; raises `zmq.Again` when it cannot be queued within the timeout."""
        with self._lock:
            sock = self._sockets.get(url)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
                try:
                    sock.connect(url)
                except zmq.ZMQError:
                    sock.close()
                    raise
                self._sockets[url] = sock
                if len(self._sockets) > self._max_sockets:
                    self._sockets.popitem(last=False)[1].close()
            self._sockets.move_to_end(url)
            failpoint("encoder.before_notify")
            sock.send(security.sign(self._secret, security.EP_NOTIFY, frame), copy=False)

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
            self._ctx.term()
