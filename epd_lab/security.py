"""The optional shared secret: where it comes from and how every surface proves it knows it.

Set ``EPD_SECRET`` (the secret itself) or ``EPD_SECRET_FILE`` (a file holding it; surrounding whitespace is
dropped) in the environment of every process of a deployment. Never a command-line argument: those show in
``/proc/*/cmdline`` to every user of the host. Without either variable nothing is authenticated (loopback-only
deployments, the default). With it:

- HTTP: every route but ``/health`` needs ``Authorization: Bearer <secret>`` (`bearer_header`,
  `check_bearer`); the proxy's OpenAI clients pass the secret as their ``api_key``. ``/health`` answers anyone
  alive or not, and its detail (the topology's addresses) only with the token.
- The transfer engine's TCP port: a mutual challenge-response before any request (native code,
  ``epd_core.c``: HMAC-SHA256 over both sides' nonces).
- ZMQ side channels (P→D KV asks and replies, E→P notifications): an HMAC-SHA256 tag in front of every
  message (`sign`), checked in constant time before the payload is decoded (`verify`). A tag binds a message
  to its channel (`domain`), so one channel's message is refused on another.

What it does not do: encrypt anything (HTTP bodies, ZMQ messages and written bytes travel in clear), nor stop a
replay of a message seen on the wire. Use it with private networks or a tunnel across hosts.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zmq

ENV_SECRET = "EPD_SECRET"
ENV_SECRET_FILE = "EPD_SECRET_FILE"
MIN_SECRET_BYTES = 16
TAG_BYTES = 32  # HMAC-SHA256

# ZMQ channels: a tag made for one is refused on the others
KV_ASK = b"epd/kv-ask"
KV_REPLY = b"epd/kv-reply"
EP_NOTIFY = b"epd/ep-notify"


class AuthError(ValueError):
    """A message or request that does not carry a valid proof of the shared secret."""


class RefusalLog:
    """The refusing side's log of peers that failed authentication on one surface: a warning line at most every
    `interval` seconds, with the count so far, so that a flood of bad messages cannot fill a role's log. It names
    the peer where known, never the secret."""

    def __init__(self, logger: logging.Logger, surface: str, interval: float = 1.0) -> None:
        self.logger, self.surface, self.interval = logger, surface, interval
        self._last = -float("inf")
        self._lock = threading.Lock()

    def __call__(self, count: int, frame: zmq.Frame | None = None) -> None:
        """Note one refusal (`count`: the surface's counter after it; `frame`: the refused ZMQ message, whose
        sender's address is logged when it came over tcp)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval:
                return
            self._last = now
        peer = None
        if frame is not None:
            import zmq  # here, not at the top: the transfer engine imports this module and needs no pyzmq

            try:
                peer = frame.get("Peer-Address")
            except zmq.ZMQError:  # not a tcp message: no address to name
                pass
        self.logger.warning("%s: a peer%s failed authentication (no valid tag of the shared secret; %d refused so "
                            "far)", self.surface, f" at {peer}" if peer else "", count)


def load_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment's secret from ``EPD_SECRET`` or the file ``EPD_SECRET_FILE`` names; None when neither is
    set (or both are empty). Raises `ValueError` when both are set, the file cannot be read, or the secret is
    shorter than `MIN_SECRET_BYTES`."""
    env = os.environ if environ is None else environ
    value, path = env.get(ENV_SECRET, ""), env.get(ENV_SECRET_FILE, "")
    if value and path:
        raise ValueError(f"set {ENV_SECRET} or {ENV_SECRET_FILE}, not both")
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"{ENV_SECRET_FILE}={path!r}: {exc.strerror}") from None
    else:
        secret = value.encode()
    return check_secret(secret) if secret else None


def check_secret(secret: bytes | str) -> bytes:
    """`secret` as bytes; `ValueError` when it is shorter than `MIN_SECRET_BYTES` or not printable ASCII."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"the shared secret has {len(raw)} bytes; use at least {MIN_SECRET_BYTES} "
                         f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    if not all(33 <= b < 127 for b in raw):
        raise ValueError("the shared secret must be printable ASCII without spaces (it travels in an HTTP header)")
    return raw


def resolve(secret: bytes | str | None) -> bytes | None:
    """A component's secret: the one given, else the environment's (`load_secret`)."""
    return check_secret(secret) if secret is not None else load_secret()


def tag(secret: bytes, domain: bytes, payload: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of `payload` on channel `domain`."""
    mac = hmac.new(secret, domain, hashlib.sha256)
    mac.update(b"\0")
    mac.update(payload)
    return mac.digest()


def sign(secret: bytes | None, domain: bytes, payload: bytes) -> bytes:
    """The frame to send: the tag, then `payload`; `payload` itself without a secret."""
    return payload if secret is None else tag(secret, domain, payload) + payload


def verify(secret: bytes | None, domain: bytes, frame: bytes | memoryview) -> memoryview:
    """The payload of a frame `sign` made, after checking its tag in constant time; raises `AuthError` when the
    tag is missing or wrong. Without a secret, the frame itself."""
    view = memoryview(frame)
    if secret is None:
        return view
    if len(view) < TAG_BYTES or not hmac.compare_digest(view[:TAG_BYTES], tag(secret, domain, view[TAG_BYTES:])):
        raise AuthError("message without a valid tag of the shared secret")
    return view[TAG_BYTES:]


def bearer_header(secret: bytes | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <secret>"}``, or nothing without a secret."""
    return {} if secret is None else {"Authorization": "Bearer " + secret.decode("ascii")}


def check_bearer(secret: bytes, authorization: str | None) -> bool:
    """Whether an ``Authorization`` header carries `secret` as its bearer token (constant-time compare)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8", "replace"), secret)
