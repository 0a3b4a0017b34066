"""The fuzz leg: generated bad input at every server and every listening socket of a running `Cluster`.

    report = fuzz(cluster, inputs_per_server=10_000, frames_per_socket=2_000, seed=1, time_budget_s=1800)

What is sent, each by Hypothesis from `seed` (so a run is replayable: the same seed draws the same inputs):

- **HTTP**, per server: schemathesis (positive and negative generation) over the server's ``/openapi.json``,
  with each POST route's body schema added from the msgspec struct the route decodes (`BODY_TYPES`; the
  routes read their raw body, so FastAPI's schema has none), or from an OpenAI-shaped schema for the proxy;
  then some bodies are re-wrapped: truncated, deeply nested, msgpack instead of JSON, random bytes, lone
  surrogates, a wrong content type. Known values of this cluster (its side channel's URL, its engines'
  session ids) are planted in some bodies so that checks past the schema are reached.
- **Frames**, per socket, found from ``/proc`` (every TCP socket a cluster process listens on): transfer
  engine ports get `epd_wire_req` headers with any magic/version/op/address/length/key and truncated payloads;
  ZMQ sockets (their type read from the ZMTP handshake) get random, near-valid and truncated msgpack through
  a matching ZMQ socket, plus raw bytes that are not ZMTP; HTTP ports get raw bytes that are not HTTP.
- **A guarded engine** in this process (the same native server as every role's): frames aimed around one
  registered region with guard bytes on both sides; every accepted write must lie inside the region, with its
  key or key 0, land byte for byte, and leave the guards intact (with the shared secret in the environment, no
  frame may land: none has passed the engine's handshake).

HTTP inputs are sent once each (Hypothesis draws small cases again), 4 at a time while the next are drawn. With
the shared secret in the environment (`epd_lab.security`) the inputs carry its bearer and most ZMQ frames its tag.

A failure is a 5xx, a reset or broken answer, a streamed 200 that ends in an error event, no answer within the
bound (a hang), a process that exited, a socket that no longer speaks its protocol after its frames, or, after
the frames, a legitimate chat through the proxy that no longer succeeds. Each failure is listed with the
case that produced it (its body, or frame bytes) and the seed.
"""
from __future__ import annotations

import base64
import copy
import json
import os
import random
import socket
import struct
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import msgspec
import numpy as np
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import HypothesisWarning

from epd_lab import security
from epd_lab.campaign.verdict import Progress
from epd_lab._native import (OP_AUTH, OP_CONTROL, OP_HELLO, OP_WRITE, ST_AUTH_REQUIRED, ST_BADREQ, ST_CONTROL_ERR,
                             ST_OK, ST_REFUSED, WIRE_MAGIC, WIRE_VERSION)
from epd_lab.ep.messages import EncodeRequest, SchedulerReceiveUrl, SendRequest
from epd_lab.noise import image_uri
from epd_lab.servers.messages import AbortRequest, DecodeRequest, PrefillRequest
from epd_lab.wire_types import WIRE_REP, WIRE_REQ

__all__ = ["BODY_TYPES", "augmented_spec", "fuzz", "fuzz_guarded_engine", "fuzz_http", "fuzz_socket",
           "listening_sockets", "wire_frames", "zmtp_socket_type"]

# the struct each POST route decodes from its raw body (their OpenAPI entries have no body schema)
BODY_TYPES: dict[str, type] = {"/encode": EncodeRequest, "/send": SendRequest,
                               "/scheduler_receive_url": SchedulerReceiveUrl, "/v1/prefill": PrefillRequest,
                               "/v1/abort": AbortRequest, "/v1/decode": DecodeRequest}
CHEAP_MAX_TOKENS = 4  # valid OpenAI bodies generate at most this many tokens (the leg probes input, not decode)
SLACK_S = 5.0  # a request's bound: the cluster's timeout plus this


class _Stop(Exception):
    """The time budget ran out: Hypothesis's loop is left at once."""


def _run(strategy: st.SearchStrategy, n: int, seed: int, deadline: float, fn: Callable[[Any], bool | None]) -> int:
    """Draw examples of `strategy` from `seed` (no shrinking, no database: the same seed draws the same sequence)
    and call `fn` on each until it has taken `n` (a call returning False did not take its example: a repeat) or
    until `deadline` (monotonic), which counts only once one was taken: Hypothesis's first draws from a spec can
    take seconds on a loaded host, and a target must be reached at least once; returns how many it took."""
    calls = 0

    @hypothesis_seed(seed)
    @settings(max_examples=max(1, 4 * n), database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(strategy)
    def run(example: Any) -> None:
        nonlocal calls
        if calls >= n or (calls and time.monotonic() > deadline):
            raise _Stop
        if fn(example) is not False:
            calls += 1

    with warnings.catch_warnings():  # leaving by _Stop makes Hypothesis repr the last example: large ones warn
        warnings.simplefilter("ignore", HypothesisWarning)
        try:
            run()
        except _Stop:
            pass
    return calls


def _repro(data: bytes | None, limit: int = 4096) -> dict[str, Any]:
    """Bytes as they can be replayed from a JSON report: text when UTF-8, else base64 (the start, if long)."""
    if data is None:
        return {}
    head = data[:limit]
    try:
        shown: dict[str, Any] = {"text": head.decode()}
    except UnicodeDecodeError:
        shown = {"base64": base64.b64encode(head).decode()}
    return {**shown, "length": len(data), **({"truncated_at": limit} if len(data) > limit else {})}


@dataclass
class _Tally:
    """Counts by outcome of one target, and its failing cases."""

    outcomes: Counter = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    sent: int = 0

    def add(self, outcome: str, failed: bool, case: dict[str, Any], limit: int = 20) -> None:
        self.sent += 1
        self.outcomes[outcome] += 1
        if failed and len(self.failures) < limit:
            self.failures.append({"outcome": outcome, "index": self.sent - 1, **case})


# ---------------------------------------------------------------- HTTP ----
_WEIRD_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -1e308, 5e-324]),
    st.text(max_size=40), st.sampled_from(["", "\x00", "\udcff", "𝔘𝔫𝔦", "../../../etc/passwd", "/proc/self/fd/1",
                                           "tcp://*:0", "127.0.0.1:0", "%s%n"]),
    st.integers(1, 1 << 16).map(lambda n: "A" * n))
_WEIRD = st.recursive(_WEIRD_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def _openai_schemas() -> dict[str, dict[str, Any]]:
    """JSON schemas of the proxy's bodies, valid ones generating at most `CHEAP_MAX_TOKENS` tokens."""
    text_part = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string", "maxLength": 64}},
                 "required": ["type", "text"]}
    image_part = {"type": "object", "properties": {
        "type": {"const": "image_url"},
        "image_url": {"type": "object", "properties": {"url": {"type": "string", "maxLength": 64}}, "required": ["url"]}},
        "required": ["type", "image_url"]}
    message = {"type": "object", "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
        "content": {"anyOf": [{"type": "string", "maxLength": 64},
                              {"type": "array", "items": {"anyOf": [text_part, image_part]}, "maxItems": 3}]}},
        "required": ["role", "content"]}
    common = {"model": {"type": "string", "maxLength": 32},
              "max_tokens": {"type": "integer", "minimum": 1, "maximum": CHEAP_MAX_TOKENS},
              "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "seed": {"type": "integer"},
              "stream": {"type": "boolean"},
              "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}}
    chat = {"type": "object", "properties": {**common, "messages": {"type": "array", "items": message, "minItems": 1,
                                                                   "maxItems": 3}},
            "required": ["messages", "max_tokens"]}
    completion = {"type": "object", "properties": {**common, "prompt": {"anyOf": [
        {"type": "string", "maxLength": 128}, {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 8}]}}, "required": ["prompt", "max_tokens"]}
    return {"/v1/chat/completions": chat, "/v1/completions": completion}


def augmented_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A server's OpenAPI with a JSON request body on each POST route: the schema of the struct it decodes where
    this module knows it, any JSON where not."""
    spec = copy.deepcopy(spec)
    known = {p: t for p, t in BODY_TYPES.items() if "post" in spec.get("paths", {}).get(p, {})}
    refs, components = msgspec.json.schema_components(list(known.values()), ref_template="#/components/schemas/{name}")
    bodies = dict(zip(known, refs))
    bodies.update({p: s for p, s in _openai_schemas().items() if "post" in spec.get("paths", {}).get(p, {})})
    spec.setdefault("components", {}).setdefault("schemas", {}).update(components)
    for path, ops in spec.get("paths", {}).items():  # a POST route this module has no schema for: any JSON
        if "post" in ops and path not in bodies:
            bodies[path] = {}
    for path, schema in bodies.items():
        spec["paths"][path]["post"]["requestBody"] = {"required": True,
                                                      "content": {"application/json": {"schema": schema}}}
    return spec


@dataclass(frozen=True)
class HttpCase:
    """One request: what a failure lists to replay it."""

    method: str
    path: str
    params: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None
    content_type: str | None = "application/json"
    wrap: str = "json"  # how the body was made: json, truncated, nested, msgpack, bytes, surrogate, ...

    def record(self) -> dict[str, Any]:
        return {"method": self.method, "path": self.path, "params": dict(self.params), "content_type": self.content_type,
                "wrap": self.wrap, "body": _repro(self.body)}


def _dumps(body: Any, **kw: Any) -> str:
    """JSON text of anything a generator drew (bytes as latin-1 text)."""
    return json.dumps(body, default=lambda v: v.decode("latin-1") if isinstance(v, bytes) else repr(v), **kw)


def _plant(body: Any, known: dict[str, list[str]], rnd: random.Random) -> Any:
    """Put this cluster's own side-channel URLs, session ids and item paths into some string fields, so that
    checks past the schema (producer allow-lists, session lookups, media policy) are reached; keep valid OpenAI
    bodies cheap (no max_tokens a real decode would spend seconds on)."""
    if isinstance(body, dict):
        out = {}
        for k, v in body.items():
            names = known.get(k)
            out[k] = rnd.choice(names) if names and isinstance(v, str) and rnd.random() < 0.5 else _plant(v, known, rnd)
            if k in ("max_tokens", "max_completion_tokens") and isinstance(v, int) and not isinstance(v, bool) \
                    and CHEAP_MAX_TOKENS < v <= 4096:
                out[k] = 4097 + v  # still out of range, answered before any compute
        return out
    if isinstance(body, list):
        return [_plant(v, known, rnd) for v in body]
    return body


@st.composite
def _wrapped(draw: Any, cases: st.SearchStrategy, known: dict[str, list[str]]) -> HttpCase:
    """A schemathesis case as an `HttpCase`, its body sometimes re-wrapped into something that is not JSON of it."""
    case = draw(cases)
    rnd = random.Random(draw(st.integers(0, 2**32)))
    params = tuple(sorted((str(k), v if isinstance(v, str) else _dumps(v)) for k, v in (case.query or {}).items()))
    raw = getattr(case, "body", None)
    if case.method.upper() == "GET" or type(raw).__name__ == "NotSet":
        return HttpCase(case.method.upper(), case.formatted_path, params, None, None, "none")
    body = _plant(raw, known, rnd)
    wrap = draw(st.sampled_from(["json"] * 6 + ["truncated", "nested", "msgpack", "bytes", "surrogate", "weird",
                                                 "content_type", "empty"]))
    data = _dumps(body).encode()
    ctype = "application/json"
    if wrap == "truncated":
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    elif wrap == "nested":
        depth = draw(st.sampled_from([64, 512, 4096, 100_000]))
        data = b'{"a":' * depth + b"1" + b"}" * depth if draw(st.booleans()) else b"[" * depth + b"]" * depth
    elif wrap == "msgpack":
        data = _msgpack(body)
        ctype = "application/msgpack"
    elif wrap == "bytes":
        data = draw(st.binary(max_size=512))
    elif wrap == "surrogate":  # a lone surrogate escaped (valid JSON text), or as raw invalid UTF-8
        data = _dumps(body).replace('"', '"\\ud800', 1).encode() if draw(st.booleans()) else \
            _dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass") + "\udcff".encode("utf-8", "surrogatepass")
    elif wrap == "weird":  # a field of the valid body replaced by, or joined with, anything
        if isinstance(body, dict) and body and draw(st.booleans()):
            body = {**body, draw(st.sampled_from(sorted(body))): draw(_WEIRD)}
        else:
            body = {**(body if isinstance(body, dict) else {}), draw(st.text(max_size=8)): draw(_WEIRD)}
        data = _dumps(body).encode("utf-8", "surrogatepass")
    elif wrap == "content_type":
        ctype = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                      "application/json; charset=utf-16", "\x7f"]))
    elif wrap == "empty":
        data = b""
    return HttpCase("POST", case.formatted_path, params, data, ctype, wrap)


def _http_strategy(spec: dict[str, Any], known: dict[str, list[str]]) -> st.SearchStrategy:
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(augmented_spec(spec))
    cases = st.one_of(schema.as_strategy(generation_mode=GenerationMode.POSITIVE),
                      schema.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    return _wrapped(cases, known)


def fuzz_http(url: str, spec: dict[str, Any], *, n: int, seed: int, deadline: float, timeout: float,
              known: dict[str, list[str]] | None = None, concurrency: int = 4) -> dict[str, Any]:
    """Send up to `n` distinct generated requests to the server at `url` (its OpenAPI `spec`) until `deadline`,
    `concurrency` at a time (Hypothesis draws in this thread; answers that wait on a timeout do not stall the
    draw); outcome counts by status class and by route, and the failing cases (5xx, broken answer, no answer
    within `timeout`)."""
    tally, by_route, samples = _Tally(), Counter(), {}
    seconds_by_route: Counter = Counter()
    slowest: list[tuple[float, dict[str, Any]]] = []  # the five slowest answers, with their cases
    t0 = time.monotonic()
    known = known or {}
    seen: set[HttpCase] = set()
    lock = threading.Lock()
    slots = threading.BoundedSemaphore(concurrency)

    def exchange(client: httpx.Client, case: HttpCase) -> None:
        headers = {"content-type": case.content_type} if case.content_type else {}
        start = time.monotonic()
        try:
            with client.stream(case.method, case.path, params=case.params, content=case.body,
                               headers=headers) as response:
                text = b"".join(response.iter_bytes())
            status = response.status_code
            outcome = f"{status // 100}xx"
            failed = status >= 500
            if status == 200 and b'"error"' in text and b"data:" in text:
                outcome, failed = "stream_error", True  # an SSE stream that ended in an error event
            detail = text[:300].decode(errors="replace")
        except httpx.TimeoutException as exc:
            outcome, failed, status, detail = "hang", True, None, f"no answer within {timeout} s ({exc!r})"
        except httpx.HTTPError as exc:
            outcome, failed, status, detail = "broken", True, None, repr(exc)
        finally:
            slots.release()
        if status == 200 and case.path == "/v1/prefill" and case.body:
            _abort_prefill(client, case.body)  # a prefill that succeeded holds KV for a decode that never comes
        seconds = time.monotonic() - start
        key = f"{case.method} {case.path} {outcome}"
        found = {"case": case.record(), "status": status, "detail": detail, "seconds": round(seconds, 3)}
        with lock:
            by_route[key] += 1
            seconds_by_route[key] += seconds
            slowest.append((seconds, found))
            slowest.sort(key=lambda t: -t[0])
            del slowest[5:]
            samples.setdefault(key, found)
            tally.add(outcome, failed, found)

    with httpx.Client(base_url=url, timeout=timeout, headers=_auth(),
                      limits=httpx.Limits(max_connections=concurrency + 1)) as client, \
            ThreadPoolExecutor(concurrency, thread_name_prefix="fuzz-http") as pool:
        def send(case: HttpCase) -> bool:
            if case in seen:  # Hypothesis draws small cases again; each input is sent once
                return False
            seen.add(case)
            slots.acquire()
            pool.submit(exchange, client, case)
            return True

        _run(_http_strategy(spec, known), n, seed, deadline, send)
    return {"inputs": tally.sent, "elapsed_s": round(time.monotonic() - t0, 1), "outcomes": dict(tally.outcomes),
            "by_route": dict(sorted(by_route.items())),
            "seconds_by_route": {k: round(v, 2) for k, v in sorted(seconds_by_route.items())},
            "slowest": [case for _, case in slowest], "samples": samples, "failures": tally.failures}


def _auth() -> dict[str, str]:
    """The bearer of the deployment's shared secret, when this process's environment holds one (`EPD_SECRET`):
    the inputs then reach the routes behind it."""
    return security.bearer_header(security.load_secret())


def _abort_prefill(client: httpx.Client, body: bytes) -> None:
    try:
        rid = msgspec.json.decode(body, type=PrefillRequest).request_id
        client.post("/v1/abort", content=msgspec.json.encode(AbortRequest(rid)))
    except (msgspec.DecodeError, httpx.HTTPError):
        pass


# ------------------------------------------------------------- sockets ----
def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(host, port) of every TCP socket process `pid` listens on (from ``/proc``: its socket inodes, matched in
    the namespace's ``net/tcp`` and ``net/tcp6``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = open(f"/proc/{pid}/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = cols[1].split(":")
            raw = bytes.fromhex(addr)
            if family == socket.AF_INET:
                host = socket.inet_ntop(family, raw[::-1])
            else:
                host = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.append((host, int(port, 16)))
    return sorted(set(found))


def zmtp_socket_type(host: str, port: int, timeout: float = 1.0) -> str | None:
    """The ZMQ socket type listening at host:port (read from its ZMTP 3 READY command), None when it does not
    speak ZMTP."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(greeting)
            buf = b""
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
                if len(buf) >= 66 and buf[0] == 0xFF and buf[9] == 0x7F:
                    size = buf[65] if buf[64] == 0x04 else None
                    if size is not None and len(buf) >= 66 + size:
                        return _ready_socket_type(buf[66:66 + size])
    except OSError:
        return None
    return None


def _is_engine(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a transfer engine listens at host:port: a writer's connection (with the deployment's shared
    secret, when the environment holds one) gets its HELLO answered."""
    from epd_lab import _native
    from epd_lab.transfer.errors import TransferError

    try:
        conn = _native.TcpConn(host, port, int(timeout * 1000), security.load_secret() or b"")
    except (TransferError, OSError):
        return False
    try:
        conn.hello()
        return True
    except (TransferError, OSError):
        return False
    finally:
        conn.close()


def _socket_alive(kind: str, host: str, port: int) -> bool:
    """Whether the socket still answers its own protocol: an engine its HELLO, ZMQ its handshake, HTTP a GET."""
    if kind == "engine":
        return _is_engine(host, port)
    if kind.startswith("zmq:"):
        return zmtp_socket_type(host, port) == kind[4:]
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/1.1") if kind == "http" else True
    except OSError:
        return False


def _ready_socket_type(cmd: bytes) -> str | None:
    if not cmd.startswith(b"\x05READY"):
        return None
    i = 6
    while i < len(cmd):
        n = cmd[i]
        name = cmd[i + 1:i + 1 + n]
        (vlen,) = struct.unpack(">I", cmd[i + 1 + n:i + 5 + n])
        value = cmd[i + 5 + n:i + 5 + n + vlen]
        if name.lower() == b"socket-type":
            return value.decode()
        i += 5 + n + vlen
    return None


@st.composite
def wire_frames(draw: Any, targets: tuple[int, ...] = (), keys: tuple[int, ...] = ()) -> tuple[bytes, bool, dict]:
    """An engine frame: an `epd_wire_req` with any field (mostly the right magic and version, so the op is
    reached), a payload, and whether it is cut short. `targets` and `keys` are addresses and keys to aim near."""
    u64 = st.integers(0, 2**64 - 1)

    def mostly(n: int) -> bool:  # true for about n in 10 draws (a die, not Hypothesis's own choice weighting)
        return draw(st.integers(0, 9)) < n

    magic = WIRE_MAGIC if mostly(9) else draw(st.sampled_from([0, WIRE_MAGIC ^ 1]) | st.integers(0, 2**32 - 1))
    version = WIRE_VERSION if mostly(9) else draw(st.sampled_from([0, 1, 3, 0xFFFF]))
    op = OP_WRITE if mostly(8) else draw(st.sampled_from([OP_HELLO, OP_CONTROL, 0, OP_AUTH, 0xFFFF]))
    if targets and mostly(7):
        addr = max(0, min(2**64 - 1, draw(st.sampled_from(targets)) + draw(st.integers(-8192, 8192))))
    else:
        addr = draw(u64 | st.sampled_from([0, 1, 2**63, 2**64 - 1, 2**64 - 8]))
    length = draw(st.integers(0, 4096)) if mostly(8) else draw(
        st.sampled_from([2**20, 2**20 + 1, 2**32, 2**40, 2**40 + 1, 2**63, 2**64 - 1]))
    key = draw(st.sampled_from([0, *keys])) if mostly(6) else draw(u64)
    seq = draw(u64)
    payload_len = min(length, 4096) if mostly(8) else draw(st.integers(0, 64))
    payload = draw(st.binary(min_size=payload_len, max_size=payload_len))
    frame = WIRE_REQ.pack(magic, version, op, seq, addr, length, key) + payload
    cut = None if mostly(8) else draw(st.integers(0, len(frame)))
    if cut is not None:
        frame = frame[:cut]
    fields = {"magic": magic, "version": version, "op": op, "seq": seq, "addr": addr, "length": length, "key": key,
              "payload_len": len(payload), "cut": cut}
    return frame, cut is not None or len(payload) < length, fields


def _engine_exchange(host: str, port: int, frame: bytes, short: bool, timeout: float
                     ) -> tuple[str, tuple[int, ...] | None]:
    """Send one frame on its own connection; its outcome (``ok``, ``refused``, ``badreq``, ``control_err``,
    ``auth_required``, ``closed``, ``hang``, ``conn_refused``) and the reply header."""
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return "conn_refused", None
    with s:
        s.settimeout(timeout)
        try:
            s.sendall(frame)
            if short or len(frame) < WIRE_REQ.size:
                s.shutdown(socket.SHUT_WR)  # the rest never comes: the owner must give up, not wait
            buf = b""
            while len(buf) < WIRE_REP.size:
                chunk = s.recv(WIRE_REP.size - len(buf))
                if not chunk:
                    return "closed", None
                buf += chunk
        except socket.timeout:
            return "hang", None
        except OSError:
            return "closed", None  # reset: the owner dropped a connection it had no use for
    rep = WIRE_REP.unpack(buf)
    return {ST_OK: "ok", ST_REFUSED: "refused", ST_BADREQ: "badreq", ST_CONTROL_ERR: "control_err",
            ST_AUTH_REQUIRED: "auth_required"}.get(
        rep[1], f"status_{rep[1]}"), rep


def _msgpack(obj: Any) -> bytes:
    """msgpack of anything a generator drew (what msgpack cannot hold, such as a lone surrogate or an int past
    64 bits, as its repr)."""
    try:
        return msgspec.msgpack.encode(obj)
    except (OverflowError, TypeError, UnicodeEncodeError):
        return msgspec.msgpack.encode(repr(obj))


def _zmq_payloads() -> st.SearchStrategy:
    """Frames for the side channel and the notify socket: random bytes, near-valid msgpack of their messages
    (a tag, their field names, any values), truncated msgpack, several frames."""
    names = ["request_id", "request_ids", "remote_hostname", "remote_port", "kv_caches_base_addr",
             "block_ids", "session_id", "rkeys", "block_len", "req_id", "part_idx", "modality", "shape", "dtype",
             "grid_thw", "error", "spans", "data"]
    tags = ["metadata", "query", "notify", "data", "TRANS_DONE", "plan", "bogus"]
    near = st.fixed_dictionaries({"type": st.sampled_from(tags)},
                                 optional={n: _WEIRD for n in names}).map(_msgpack)
    truncated = st.tuples(near, st.integers(0, 64)).map(lambda t: t[0][:max(0, len(t[0]) - 1 - t[1])])
    one = st.one_of(st.binary(max_size=256), near, truncated)
    return st.lists(one, min_size=1, max_size=3)


_HTTP_JUNK = (b"GET / HTTP/1.1\r\n", b"POST /v1/prefill HTTP/1.1\r\nContent-Length: 99999\r\n\r\n{",
              b"GET /" + b"A" * 70000 + b" HTTP/1.1\r\n\r\n", b"\r\n\r\n\r\n",
              b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 2000 + b"\r\n",
              b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n")
_ZMTP_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00NULL" + b"\x00" * 48


def _raw_junk() -> st.SearchStrategy:
    """Bytes for a port's own protocol to choke on: random, a cut ZMTP greeting, a cut or broken HTTP request."""
    return st.one_of(st.binary(max_size=512), st.integers(0, 63).map(lambda n: _ZMTP_GREETING[:n]),
                     st.integers(0, len(_HTTP_JUNK) - 1).map(lambda i: _HTTP_JUNK[i]))


def _raw_exchange(host: str, port: int, data: bytes, timeout: float) -> str:
    """Send junk on a fresh connection, close our side, read until the peer closes: ``answered`` (it said
    something), ``closed`` (it said nothing), ``hang`` (it kept the connection past `timeout`)."""
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return "conn_refused"
    said = b""
    with s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                said += chunk
        except socket.timeout:
            return "hang"
        except OSError:
            pass
    if said.startswith(b"HTTP/1.") and said[9:10] == b"5":
        return "http_5xx"
    return "answered" if said else "closed"


def fuzz_socket(host: str, port: int, kind: str, *, n: int, seed: int, deadline: float, timeout: float) -> dict[str, Any]:
    """Up to `n` frames at one socket of `kind` (``engine``, ``http``, or ``zmq:TYPE``) until `deadline`."""
    tally = _Tally()
    t0 = time.monotonic()
    if kind == "engine":
        def send(example: tuple[bytes, bool, dict]) -> None:
            frame, short, fields = example
            outcome, _ = _engine_exchange(host, port, frame, short, timeout)
            # an accepted write at an address drawn blind would have landed in memory nobody gave out
            failed = outcome in ("hang", "conn_refused") or (outcome == "ok" and fields["op"] == OP_WRITE)
            tally.add(outcome, failed, {"frame": _repro(frame, 256), "fields": fields})
        _run(wire_frames(), n, seed, deadline, send)
    elif kind == "http":
        def send_raw(data: bytes) -> None:
            outcome = _raw_exchange(host, port, data, timeout)
            tally.add(outcome, outcome in ("hang", "conn_refused", "http_5xx"), {"frame": _repro(data, 256)})
        _run(_raw_junk(), n, seed, deadline, send_raw)
    else:
        _fuzz_zmq(host, port, kind.split(":", 1)[1], n, seed, deadline, timeout, tally)
    return {"kind": kind, "frames": tally.sent, "elapsed_s": round(time.monotonic() - t0, 1),
            "outcomes": dict(tally.outcomes), "failures": tally.failures}


def _fuzz_zmq(host: str, port: int, peer_type: str, n: int, seed: int, deadline: float, timeout: float,
              tally: _Tally) -> None:
    """Frames through a ZMQ socket of the type that pairs with `peer_type` (one in eight as raw TCP junk)."""
    mine = {"ROUTER": zmq.DEALER, "PULL": zmq.PUSH, "REP": zmq.DEALER, "DEALER": zmq.DEALER, "SUB": zmq.PUB}.get(
        peer_type, zmq.DEALER)
    ctx = zmq.Context()
    sock = ctx.socket(mine)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    sock.connect(f"tcp://{host}:{port}")
    # with the shared secret, most frames carry a valid tag so that they reach the decoder behind it
    secret = security.load_secret()
    domain = security.KV_ASK if peer_type == "ROUTER" else security.EP_NOTIFY
    try:
        def send(example: tuple[bool, Any]) -> None:
            raw, data = example
            if raw:
                outcome = _raw_exchange(host, port, data, timeout)
                tally.add(f"raw_{outcome}", outcome in ("hang", "conn_refused"), {"frame": _repro(data, 256)})
                return
            if secret is not None and tally.sent % 8:
                data = [security.sign(secret, domain, data[0]), *data[1:]]
            frames = ([b""] if peer_type == "ROUTER" else []) + data  # a REQ's empty delimiter, or none
            try:
                sock.send_multipart(frames)
                outcome = "sent"
            except zmq.Again:
                outcome = "blocked"  # the peer stopped taking frames for `timeout`
            while sock.poll(0):  # the side channel answers each ask; read what came back
                sock.recv_multipart()
                outcome += "+reply"
            tally.add(outcome, outcome.startswith("blocked"), {"frames": [_repro(f, 256) for f in data]})
        _run(st.one_of(st.tuples(st.just(True), _raw_junk()), *[st.tuples(st.just(False), _zmq_payloads())] * 7),
             n, seed, deadline, send)
    finally:
        sock.close(linger=0)
        ctx.term()


# ------------------------------------------------------- guarded engine ----
def fuzz_guarded_engine(*, n: int, seed: int, deadline: float, region: int = 64 << 10, guard: int = 4096,
                        timeout: float = 2.0) -> dict[str, Any]:
    """Frames at a transfer engine in this process whose one registered region has `guard` bytes of a known
    pattern on each side. Checks, frame by frame, that a write is accepted only inside the region (with its
    key, or key 0: bounds only; none at all when the environment holds the shared secret, as no frame passed the
    handshake) and, at the end, that the region holds exactly the accepted payloads and the guards are intact;
    the owner's refused-writes counter is reported."""
    from epd_lab.transfer.engine import TransferEngine

    tally = _Tally()
    pattern = np.frombuffer(np.random.default_rng(seed).bytes(region + 2 * guard), dtype=np.uint8)
    buf = pattern.copy()
    shadow = pattern.copy()  # what the buffer must hold: the pattern, with every accepted write applied
    base = buf.ctypes.data + guard
    # with the shared secret in the environment the engine runs its handshake first: a frame sent without it must
    # never land, so then no write may be accepted at all
    authenticated = security.load_secret() is not None
    with TransferEngine(protocol="tcp", timeout=timeout) as engine:
        rkey = engine.register(base, region)
        host, port = engine.session_id.rsplit(":", 1)

        def send(example: tuple[bytes, bool, dict]) -> None:
            frame, short, f = example
            outcome, _ = _engine_exchange(host, int(port), frame, short, timeout)
            inside = base <= f["addr"] and f["addr"] + f["length"] <= base + region and f["length"] > 0
            may = (inside and f["key"] in (0, rkey) and f["op"] == OP_WRITE and f["magic"] == WIRE_MAGIC
                   and f["version"] == WIRE_VERSION and not authenticated)
            failed = outcome == "hang" or (outcome == "ok" and f["op"] == OP_WRITE and not may)
            if may and len(frame) >= WIRE_REQ.size:
                # an allowed write lands as far as its bytes came (a cut one too: the owner receives in place)
                got = np.frombuffer(frame[WIRE_REQ.size:WIRE_REQ.size + f["length"]], dtype=np.uint8)
                off = f["addr"] - buf.ctypes.data
                shadow[off:off + len(got)] = got
            tally.add(outcome, failed, {"frame": _repro(frame, 256), "fields": f})

        _run(wire_frames(targets=(base, base + region), keys=(rkey, rkey ^ 1)), n, seed, deadline, send)
        stats = engine.stats()
        engine.deregister(base)
    guards_intact = bool(np.array_equal(buf[:guard], pattern[:guard]) and
                         np.array_equal(buf[guard + region:], pattern[guard + region:]))
    region_exact = bool(np.array_equal(buf, shadow))
    if not guards_intact:
        tally.add("guard_overwritten", True, {})
    elif not region_exact:
        tally.add("region_mismatch", True, {})
    return {"frames": tally.sent, "outcomes": dict(tally.outcomes), "guards_intact": guards_intact,
            "region_exact": region_exact, "authenticated": authenticated, "writes_in": stats["writes_in"],
            "writes_refused": stats["writes_refused"],
            "failures": tally.failures}


# ---------------------------------------------------------------- leg ----
def _tiny_png() -> str:
    return image_uri(0, 32)


def _legit_chat(proxy_url: str, timeout: float) -> tuple[bool, str]:
    """One chat with an image through the proxy (encoder, engine writes, notify, side channel, decode)."""
    body = {"model": "any", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _tiny_png()}}, {"type": "text", "text": "what is it?"}]}]}
    try:
        r = httpx.post(proxy_url + "/v1/chat/completions", json=body, timeout=timeout, headers=_auth())
    except httpx.HTTPError as exc:
        return False, repr(exc)
    return r.status_code == 200, f"{r.status_code} {r.text[:300]}"


def _roles(cluster: Any) -> list[tuple[str, str, int]]:
    """(name, url, pid) of every server, in `Cluster.procs` order."""
    return [(log.stem, url, proc.pid) for log, url, proc in zip(cluster.logs, cluster.urls(), cluster.procs)]


def _crashes(cluster: Any) -> list[dict[str, Any]]:
    return [{"process": name, "returncode": proc.poll()}
            for (name, _, _), proc in zip(_roles(cluster), cluster.procs) if proc.poll() is not None]


def fuzz(cluster: Any, *, inputs_per_server: int, frames_per_socket: int, seed: int, time_budget_s: float,
         progress: Progress | None = None) -> dict[str, Any]:
    """Fuzz every server and every listening socket of a running `cluster` (see the module docstring).

    Stops each target at its count or at its share of `time_budget_s`, whichever comes first (the report says
    how many were sent). Returns a JSON-able report: ``servers`` and ``sockets`` (counts by outcome, failing
    cases), ``guarded_engine``, ``crashes``, ``legit_before``/``legit_after``, ``failures`` (all of them, each
    naming its target, case and the seed), ``ok`` (no failure at all), ``seed`` and ``elapsed_s``.
    """
    say = progress or (lambda msg: None)
    t0 = time.monotonic()
    end = t0 + time_budget_s
    timeout = cluster.topology.timeout + SLACK_S
    roles = _roles(cluster)
    health = {url: httpx.get(url + "/health", timeout=timeout, headers=_auth()).json() for _, url, _ in roles}
    http_ports = {int(url.rsplit(":", 1)[1]) for _, url, _ in roles}
    engines = {int(h["session_id"].rsplit(":", 1)[1]) for h in health.values() if "session_id" in h}
    kv_urls = [h["kv_url"] for h in health.values() if "kv_url" in h]
    known = {"remote_url": kv_urls, "session_id": [h["session_id"] for h in health.values() if "session_id" in h],
             "receive_url": [u.removeprefix("tcp://") for u in kv_urls], "url": ["/etc/passwd", "/proc/self/fd/1",
                                                                                   "file:///etc/shadow"]}
    legit_before = _legit_chat(cluster.proxy_url, timeout) if cluster.proxy_url else (None, "no proxy")
    say(f"fuzz: {len(roles)} servers, seed {seed}, legit chat before: {legit_before[1][:60]}")

    # the slices of the budget: HTTP 60 %, frames 35 %, the guarded engine the rest; the servers' HTTP shares are
    # counted from here, after the legit chat, so that a slow host's set-up does not eat the first server's share
    t_http = time.monotonic()
    http_end = t0 + 0.6 * time_budget_s
    servers: dict[str, Any] = {}
    for i, (name, url, _) in enumerate(roles):
        share = t_http + max(0.0, http_end - t_http) * (i + 1) / len(roles)
        spec = httpx.get(url + "/openapi.json", timeout=timeout, headers=_auth())
        if spec.status_code != 200:
            servers[name] = {"url": url, "inputs": 0, "outcomes": {"openapi_5xx": 1}, "failures": [
                {"outcome": "openapi_5xx", "case": {"method": "GET", "path": "/openapi.json"},
                 "status": spec.status_code, "detail": spec.text[:300]}]}
            continue
        servers[name] = {"url": url, **fuzz_http(url, spec.json(), n=inputs_per_server, seed=seed + i,
                                                 deadline=min(share, end), timeout=timeout, known=known)}
        say(f"fuzz: {name} {servers[name]['inputs']} inputs {servers[name]['outcomes']}")

    targets = []
    for name, url, pid in roles:
        for host, port in listening_sockets(pid):
            kind = "http" if port in http_ports else "engine" if port in engines or _is_engine(host, port) else None
            if kind is None:  # not named by /health (a role's second engine is found by its HELLO answer)
                found = zmtp_socket_type(host, port)
                kind = f"zmq:{found}" if found else "tcp"
            targets.append((name, host, port, kind))
    frames_end = t0 + 0.95 * time_budget_s
    sockets: dict[str, Any] = {}
    start = time.monotonic()
    for i, (name, host, port, kind) in enumerate(targets):
        share = start + (frames_end - start) * (i + 1) / max(1, len(targets))
        kind_run = "http" if kind == "tcp" else kind  # an unknown protocol gets raw junk
        rep = fuzz_socket(host, port, kind_run, n=frames_per_socket, seed=seed + 100 + i, deadline=min(share, end),
                          timeout=timeout)
        rep["alive_after"] = _socket_alive(kind, host, port)  # it still speaks its protocol to a fresh peer
        if not rep["alive_after"]:
            rep["failures"].append({"outcome": "dead_after_frames"})
        sockets[f"{name} {host}:{port}"] = {"owner": name, **rep}
        say(f"fuzz: {name} {host}:{port} ({kind}) {sockets[f'{name} {host}:{port}']['frames']} frames")

    guarded = fuzz_guarded_engine(n=frames_per_socket, seed=seed + 1000, deadline=max(end, time.monotonic() + 1))
    say(f"fuzz: guarded engine {guarded['frames']} frames, guards intact: {guarded['guards_intact']}")
    legit_after = _legit_chat(cluster.proxy_url, timeout) if cluster.proxy_url else (None, "no proxy")
    crashes = _crashes(cluster)

    failures = []
    for name, rep in servers.items():
        failures += [{"target": f"http {name}", "seed": seed, **f} for f in rep["failures"]]
    for name, rep in sockets.items():
        failures += [{"target": f"socket {name}", "seed": seed, **f} for f in rep["failures"]]
    failures += [{"target": "guarded engine", "seed": seed, **f} for f in guarded["failures"]]
    failures += [{"target": c["process"], "seed": seed, "outcome": "crash", **c} for c in crashes]
    for when, (ok, detail) in (("before", legit_before), ("after", legit_after)):
        if ok is False:
            failures.append({"target": "proxy", "seed": seed, "outcome": f"legit_chat_{when}_failed", "detail": detail})
    return {"seed": seed, "elapsed_s": round(time.monotonic() - t0, 1), "time_budget_s": time_budget_s,
            "inputs_per_server": inputs_per_server, "frames_per_socket": frames_per_socket,
            "servers": servers, "sockets": sockets, "guarded_engine": guarded, "crashes": crashes,
            "legit_before": {"ok": legit_before[0], "detail": legit_before[1]},
            "legit_after": {"ok": legit_after[0], "detail": legit_after[1]},
            "failures": failures, "ok": not failures}
