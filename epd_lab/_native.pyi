"""Type stub of epd_lab._native (native/_native.pyx over native/epd_core.c)."""
from typing import Any, Callable, Sequence

from typing_extensions import Buffer

COPIES: tuple[str, str]

# the engine's wire, from native/epd_core.h
WIRE_MAGIC: int
WIRE_VERSION: int
OP_WRITE: int
OP_HELLO: int
OP_CONTROL: int
OP_AUTH: int
ST_OK: int
ST_REFUSED: int
ST_BADREQ: int
ST_CONTROL_ERR: int
ST_NOAUTH: int
ST_AUTH_REQUIRED: int
WIRE_REQ_SIZE: int
WIRE_REP_SIZE: int

def copy_bytes(dst: Buffer, src: Buffer, copy: str) -> None:
    """Copy `src` into `dst` (same length, no overlap) with ``"memcpy"`` or ``"stream"``; the stores are
    complete on return."""

def set_copy_policy(large_copy: str, large_min: int) -> None:
    """Blocks of at least `large_min` bytes in large shm writes use `large_copy`; smaller ones stream."""

def copy_policy() -> dict[str, Any]:
    """``large_copy``, ``large_min``, ``stream_min``, ``stream_batch_min``, ``stream_isa``, ``copy_version``."""

def hmac_sha256(key: bytes, msg: bytes) -> bytes: ...

class Owner:
    """Memory owner: the registration table, managed buffers and the TCP server placing incoming writes."""

    host: str
    port: int
    timeout_ms: int
    control_handler: Callable[[bytes], bytes] | None
    def __init__(self, host: str, port: int, timeout_ms: int, max_conns: int = 0, idle_ms: int = 0,
                 secret: bytes = b"") -> None: ...
    def register(self, addr: int, length: int) -> int: ...
    def deregister(self, addr: int) -> None: ...
    def covers(self, addr: int, length: int) -> bool: ...
    def allocate_managed(self, length: int) -> int: ...
    def free_managed(self, addr: int) -> None: ...
    def regions(self) -> list[tuple[int, int, str]]: ...
    def stats(self) -> dict[str, int]: ...
    def hello(self) -> tuple[int, int, int]: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...

class TcpConn:
    """A writer's TCP connection to one peer engine; one reply per write, pipelined in batches."""

    peer: str
    def __init__(self, host: str, port: int, timeout_ms: int, secret: bytes = b"") -> None: ...
    def write(self, owner: Owner, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int],
              keys: Sequence[int] | None = None) -> int: ...
    def write_strided(self, owner: Owner, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int],
                      counts: Sequence[int], src_strides: Sequence[int], dst_strides: Sequence[int],
                      keys: Sequence[int] | None = None) -> int: ...
    def hello(self) -> tuple[int, int, int]: ...
    def control(self, request: bytes) -> bytes: ...
    @property
    def broken(self) -> bool: ...
    @property
    def alive(self) -> bool: ...
    def close(self) -> None: ...

class ShmPeer:
    """A writer's view of a same-host peer: its registration table and managed buffers, mapped."""

    pid: int
    def __init__(self, pid: int, table_fd: int, nonce: int, timeout_ms: int) -> None: ...
    def write(self, owner: Owner, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int],
              keys: Sequence[int] | None = None) -> int: ...
    def write_strided(self, owner: Owner, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int],
                      counts: Sequence[int], src_strides: Sequence[int], dst_strides: Sequence[int],
                      keys: Sequence[int] | None = None) -> int: ...
    def close(self) -> None: ...
