"""Media items of an /encode request: file paths, ``data:`` URIs and http(s) URLs, fetched with bounded
time and size, then decoded into RGB images in two steps: `open_image` parses the header only (the size is
then known, which is all /encode answers), `load_rgb` decodes the pixels (the encoder's worker, just before
the ViT). `decode_image` does both.

An item that cannot be fetched or decoded raises `MediaError` (a `ValueError`), whose message names the
item, so the encoder can answer 400 with it. Pixel data that is corrupt or truncated behind a sound header
is only found by `load_rgb`.

A server fetches for its clients under a `MediaPolicy`: local paths only inside the folders it names (after
resolving links; regular files only, so never ``/proc``, devices or pipes), http(s) only to public addresses
unless it allows private ones. A refusal says what the policy is, never whether the thing exists, so a
client cannot probe the server's files or network. The host is resolved once, every address it resolves to is
checked, and the connection goes to a checked address (the URL's host kept in ``Host`` and, for https, in SNI and
the certificate check): a DNS answer that changes between the check and the connect (rebinding) cannot steer
the fetch to a private address. Without a policy (`fetch_media`'s default) the caller is
trusted: the driver reading its own files.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import os
import socket
import stat
import threading
import time
import warnings
from dataclasses import dataclass
from urllib.parse import unquote, urljoin, urlsplit

import httpx
from PIL import Image


class MediaError(ValueError):
    """A media item that could not be fetched or decoded."""


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """What a server fetches when a client names a media item.

    Args:
        roots: folders whose regular files may be read (empty: no local paths at all).
        private_hosts: fetch http(s) from loopback, private, link-local and other non-public addresses.
    """

    roots: tuple[str, ...] = ()
    private_hosts: bool = False

    def local_path(self, path: str) -> str:
        """`path` resolved, if it lies inside one of `roots`; `MediaError` (the same whether or not it exists)
        otherwise."""
        real = os.path.realpath(path)
        for root in self.roots:
            top = os.path.realpath(root)
            if os.path.commonpath([real, top]) == top:
                return real
        raise MediaError("local paths are not served here" if not self.roots
                         else f"{_short(path)} is outside the folders this server serves media from")

    def address(self, url: str) -> str:
        """The address to connect to for `url`: the first its host resolves to, once every one is checked;
        `MediaError` unless all are public (or private ones are allowed)."""
        host = urlsplit(url).hostname or ""
        try:
            addresses = [info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]
        except (socket.gaierror, UnicodeError):
            raise MediaError(f"cannot resolve the host of {_short(url)}") from None
        if not addresses:
            raise MediaError(f"cannot resolve the host of {_short(url)}")
        if not self.private_hosts and not all(ipaddress.ip_address(a.split("%")[0]).is_global for a in addresses):
            raise MediaError(f"{_short(url)}: this server fetches media from public addresses only")
        return addresses[0]


def pinned_request(url: str, address: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """`url` aimed at `address` rather than at its host, with what keeps it the same request: the ``Host``
    header and, for https, the SNI name that the certificate is checked against. (target, headers,
    extensions) for httpx."""
    parts = urlsplit(url)
    literal = f"[{address.split('%')[0]}]" if ":" in address else address
    target = parts._replace(netloc=literal + (f":{parts.port}" if parts.port else "")).geturl()
    host = parts.netloc.rpartition("@")[2]  # any user:password@ is not sent on
    extensions = {"sni_hostname": parts.hostname or ""} if parts.scheme == "https" else {}
    return target, {"Host": host}, extensions


def _short(item: str, limit: int = 80) -> str:
    """The item as an error message shows it (a data: URI can be megabytes long)."""
    return item if len(item) <= limit else item[:limit] + f"... ({len(item)} chars)"


def _from_data_uri(item: str, max_bytes: int) -> bytes:
    header, sep, payload = item.partition(",")
    if not sep:
        raise MediaError(f"data URI without a ',' separator: {_short(item)}")
    if not header.endswith(";base64"):
        raise MediaError(f"data URI is not base64 (expected 'data:<type>;base64,...'): {_short(item)}")
    if len(payload) // 4 * 3 > max_bytes + 2:  # refuse before decoding what would be too large
        raise MediaError(f"data URI carries more than {max_bytes} bytes")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"data URI is not valid base64 ({exc}): {_short(item)}") from None
    if len(raw) > max_bytes:
        raise MediaError(f"data URI carries {len(raw)} bytes, more than {max_bytes}")
    return raw


MAX_REDIRECTS = 3


_client: httpx.Client | None = None
_client_lock = threading.Lock()


def _http_client() -> httpx.Client:
    """One client for every fetch of this process: building an `httpx.Client` loads the CA bundle into a TLS
    context, 19-33 ms on the 2-vCPU VM, which a client per fetch paid on every image by URL. No connection is
    kept: a pinned request's connection belongs to its URL's host, which the pool (keyed by address) cannot see."""
    global _client
    with _client_lock:
        if _client is None:
            _client = httpx.Client(follow_redirects=False, limits=httpx.Limits(max_keepalive_connections=0))
        return _client


def _from_url(item: str, timeout: float, max_bytes: int, policy: MediaPolicy | None) -> bytes:
    # httpx's timeout bounds each operation; the deadline bounds the whole download (a slow trickle)
    deadline = time.monotonic() + timeout
    client = _http_client()
    try:
        url = item
        for _ in range(MAX_REDIRECTS + 1):  # each hop is checked, so a redirect cannot reach a private host
            target, headers, extensions = (pinned_request(url, policy.address(url)) if policy is not None
                                           else (url, {}, {}))
            with client.stream("GET", target, headers=headers, extensions=extensions, timeout=timeout) as resp:
                if resp.is_redirect and "location" in resp.headers:
                    url = urljoin(url, resp.headers["location"])
                    if not url.startswith(("http://", "https://")):
                        raise MediaError(f"GET {_short(item)} redirects out of http(s)")
                    continue
                return _read_answer(item, resp, max_bytes, timeout, deadline)
        raise MediaError(f"GET {_short(item)}: more than {MAX_REDIRECTS} redirects")
    except httpx.HTTPError as exc:
        raise MediaError(f"GET {_short(item)} failed: {type(exc).__name__}: {exc}") from None


def _read_answer(item: str, resp: httpx.Response, max_bytes: int, timeout: float, deadline: float) -> bytes:
    """The body of a GET's final answer, within `max_bytes` and the whole download's `deadline`."""
    if resp.status_code != 200:
        raise MediaError(f"GET {_short(item)} answered {resp.status_code}")
    length = resp.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise MediaError(f"GET {_short(item)}: {length} bytes, more than {max_bytes}")
    chunks, got = [], 0
    for chunk in resp.iter_bytes():
        got += len(chunk)
        if got > max_bytes:
            raise MediaError(f"GET {_short(item)}: more than {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise MediaError(f"GET {_short(item)}: not complete within {timeout} s")
        chunks.append(chunk)
    return b"".join(chunks)


def _from_file(item: str, max_bytes: int, policy: MediaPolicy | None) -> bytes:
    path = unquote(urlsplit(item).path) if item.startswith("file://") else item
    if policy is not None:
        path = policy.local_path(path)
    try:
        # O_NONBLOCK: a FIFO or a device opens without waiting for a writer; only regular files are read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise MediaError(f"{_short(path)} is not a regular file")
            if info.st_size > max_bytes:
                raise MediaError(f"file {_short(path)}: {info.st_size} bytes, more than {max_bytes}")
            raw = f.read(max_bytes + 1)  # the file may have grown since stat
    except OSError as exc:
        raise MediaError(f"cannot read {_short(path)}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise MediaError(f"file {_short(path)}: more than {max_bytes} bytes")
    return raw


def fetch_media(item: str, timeout: float, max_bytes: int, policy: MediaPolicy | None = None) -> bytes:
    """The raw bytes of a media item: a ``data:<type>;base64,`` URI, an ``http(s)://`` URL (fetched within
    `timeout` seconds in all), or a file path (or ``file://`` URI). At most `max_bytes` are accepted. With a
    `policy` (a server fetching for a client), what it does not allow is refused."""
    if not isinstance(item, str) or not item:
        raise MediaError("empty media item")
    if "\0" in item:  # no path or URL holds one (os.open would raise ValueError, not OSError)
        raise MediaError("a media item with a NUL character")
    if item.startswith("data:"):
        return _from_data_uri(item, max_bytes)
    if item.startswith(("http://", "https://")):
        return _from_url(item, timeout, max_bytes, policy)
    return _from_file(item, max_bytes, policy)


def open_image(raw: bytes, name: str = "image") -> Image.Image:
    """Open image bytes (any format PIL reads) lazily: PIL parses the header, so the size is known, and
    decodes no pixel. Decompression bombs (past PIL's `Image.MAX_IMAGE_PIXELS`) are refused here."""
    try:
        with warnings.catch_warnings():
            # PIL warns below its bomb limit and raises above it: a warning is an error here
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(raw))
    except Image.UnidentifiedImageError:
        raise MediaError(f"{_short(name)} is not an image in a format PIL reads ({len(raw)} bytes)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as exc:
        raise MediaError(f"{_short(name)} does not decode as an image: {exc}") from None


def load_rgb(img: Image.Image, name: str = "image") -> Image.Image:
    """Decode an image from `open_image` into a fully loaded RGB image of the size its header gave."""
    size = img.size
    try:
        img.load()
        rgb = img if img.mode == "RGB" else img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt pixel data, an unconvertible mode
        raise MediaError(f"{_short(name)} does not decode as an image: {exc}") from None
    if rgb.size != size:  # the answered sizes came from the header: the embedding must match them
        raise MediaError(f"{_short(name)} decodes to {rgb.size}, not the {size} its header gives")
    return rgb


def decode_image(raw: bytes, name: str = "image") -> Image.Image:
    """Decode image bytes (any format PIL reads) into a fully loaded RGB image."""
    return load_rgb(open_image(raw, name), name)


MAX_MEDIA_BYTES = 32 << 20  # per media item, after base64 decoding or download


def load_image(item: str, timeout: float, max_bytes: int) -> Image.Image:
    """Fetch (`fetch_media`) and decode (`decode_image`) one image item; raises `MediaError`."""
    return decode_image(fetch_media(item, timeout, max_bytes), item)


def content_hash(raw: bytes) -> str:
    """A stable key of media content (sha256, hex)."""
    return hashlib.sha256(raw).hexdigest()
