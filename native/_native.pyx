# cython: boundscheck=False, wraparound=False
"""epd_lab._native: the binding of native/epd_core.c.

Setup (objects, registration, errors) happens here with the GIL; every data path runs in C with the
GIL released. `epd_lab.transfer.engine.TransferEngine` is the public API built on these objects.
"""
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport errno
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from epd_core cimport *

from epd_lab.transfer.errors import (
    AuthenticationError,
    PeerUnreachable,
    ProtocolError,
    RegistrationError,
    RemoteAccessError,
    TransferError,
    TransferTimeout,
)

_ERRORS = {
    EPD_EINVAL: RegistrationError,
    EPD_EREFUSED: RemoteAccessError,
    EPD_ETIMEDOUT: TransferTimeout,
    EPD_ECONN: PeerUnreachable,
    EPD_EPROTO: ProtocolError,
    EPD_EAUTH: AuthenticationError,
}


cdef int check(int rc, const char *err, int err_no) except -1:
    """Turn a native status into the matching exception."""
    if rc == EPD_OK:
        return 0
    msg = err.decode("utf-8", "replace")
    cls = _ERRORS.get(rc)
    if cls is RegistrationError:
        raise RegistrationError(msg)
    if cls is not None:
        raise cls(msg, err_no or None)
    raise TransferError(msg, err_no if rc == EPD_ESYS else None)


cdef class Owner

COPIES = ("memcpy", "stream")  # index = EPD_COPY_MEMCPY, EPD_COPY_STREAM

# The engine's wire (epd_core.h), read by the compiler from the header itself, for Python that speaks it
# (the campaign's fuzz leg): frames are epd_wire_req / epd_wire_rep, little-endian, packed.
WIRE_MAGIC = EPD_WIRE_MAGIC
WIRE_VERSION = EPD_WIRE_VERSION
OP_WRITE, OP_HELLO, OP_CONTROL, OP_AUTH = EPD_OP_WRITE, EPD_OP_HELLO, EPD_OP_CONTROL, EPD_OP_AUTH
ST_OK, ST_REFUSED, ST_BADREQ, ST_CONTROL_ERR, ST_NOAUTH, ST_AUTH_REQUIRED = (
    EPD_ST_OK, EPD_ST_REFUSED, EPD_ST_BADREQ, EPD_ST_CONTROL_ERR, EPD_ST_NOAUTH, EPD_ST_AUTH_REQUIRED)
WIRE_REQ_SIZE = sizeof(epd_wire_req)
WIRE_REP_SIZE = sizeof(epd_wire_rep)


cdef int _copy_kind(str copy) except -1:
    if copy not in COPIES:
        raise ValueError(f"unknown copy {copy!r}; choose one of {', '.join(COPIES)}")
    return EPD_COPY_STREAM if copy == "stream" else EPD_COPY_MEMCPY


def copy_bytes(unsigned char[::1] dst not None, const unsigned char[::1] src not None, str copy) -> None:
    """Copy `src` into `dst` (same length, no overlap) with one of the shm path's copies, ``"memcpy"``
    or ``"stream"``; the stores are complete on return. For calibration, benchmarks and tests."""
    cdef int kind = _copy_kind(copy)
    cdef Py_ssize_t n = src.shape[0]
    if dst.shape[0] != n:
        raise ValueError(f"dst has {dst.shape[0]} bytes, src {n}: they must be equal")
    if n == 0:
        return
    with nogil:
        epd_copy(kind, &dst[0], &src[0], n)


def set_copy_policy(str large_copy, uint64_t large_min) -> None:
    """Writes into a peer's managed buffer copy each block of at least `large_min` bytes with
    `large_copy` (``"memcpy"`` or ``"stream"``); smaller blocks of large writes stream (epd_core.h).
    For the whole process; `epd_lab.transfer.shm_copy` sets it from a measurement."""
    epd_copy_policy_set(_copy_kind(large_copy), large_min)


def copy_policy() -> dict:
    """The copy policy in force: ``large_copy``, ``large_min``, the fixed bounds below which writes
    and blocks always use memcpy (``stream_min``, ``stream_batch_min``), ``stream_isa`` (the
    instructions of the streaming copy here; empty where it is plain memcpy) and ``copy_version``."""
    cdef int large
    cdef uint64_t large_min
    epd_copy_policy_get(&large, &large_min)
    return dict(large_copy=COPIES[large], large_min=large_min, stream_min=EPD_STREAM_MIN,
                stream_batch_min=EPD_STREAM_BATCH_MIN, stream_isa=epd_copy_stream_isa().decode(),
                copy_version=EPD_COPY_VERSION)


def hmac_sha256(bytes key, bytes msg) -> bytes:
    """The native HMAC-SHA256 of the engine's handshake (for its test against Python's `hmac`)."""
    cdef uint8_t out[32]
    epd_hmac_sha256(<const uint8_t *> key, len(key), <const uint8_t *> msg, len(msg), out)
    return PyBytes_FromStringAndSize(<const char *> out, 32)


cdef int _secret_len(bytes secret) except -1:
    if len(secret) > EPD_SECRET_MAX:
        raise ValueError(f"a secret of {len(secret)} bytes; at most {EPD_SECRET_MAX}")
    return len(secret)


cdef class _Vectors:
    """Three C arrays of uint64 (sources, destinations, lengths) built from Python sequences."""
    cdef uint64_t *srcs
    cdef uint64_t *dsts
    cdef uint64_t *lens
    cdef uint64_t *keys  # NULL when no keys were given (bounds checked only)
    cdef int n

    def __cinit__(self, srcs, dsts, lengths, keys=None):
        cdef Py_ssize_t n = len(srcs)
        if n == 0 or len(dsts) != n or len(lengths) != n or (keys is not None and len(keys) != n):
            raise ValueError(f"need equal, non-empty lists of sources, destinations, lengths (and keys) "
                             f"(got {len(srcs)}, {len(dsts)}, {len(lengths)})")
        self.n = n
        self.srcs = <uint64_t *> malloc(4 * n * sizeof(uint64_t))
        if self.srcs == NULL:
            raise MemoryError()
        self.dsts = self.srcs + n
        self.lens = self.srcs + 2 * n
        self.keys = self.srcs + 3 * n if keys is not None else NULL
        if keys is not None:
            for i in range(n):
                self.keys[i] = keys[i]
        for i in range(n):
            length = lengths[i]
            if length <= 0:
                raise ValueError(f"length {length} of write {i}: must be positive")
            self.srcs[i] = srcs[i]
            self.dsts[i] = dsts[i]
            self.lens[i] = length

    def __dealloc__(self):
        free(self.srcs)

    cdef int check_sources(self, Owner owner) except -1:
        """Sources must lie in the writer's own registrations (the lkey's role)."""
        for i in range(self.n):
            if not epd_owner_covers(owner.o, self.srcs[i], self.lens[i]):
                raise RegistrationError(
                    f"source 0x{self.srcs[i]:x} ({self.lens[i]} bytes) of write {i} is not inside memory "
                    f"registered with this engine; register() it first")
        return 0


cdef class _Strided:
    """A C array of strided writes (`epd_strided`) built from sequences or numpy arrays (taken as uint64, without a
    Python object per value), each checked: positive lengths and counts, strides no shorter than a piece,
    extents that do not overflow."""
    cdef epd_strided *w
    cdef int n
    cdef uint64_t nbytes

    def __cinit__(self, srcs, dsts, lengths, counts, src_strides, dst_strides, keys=None):
        import numpy as np

        cdef Py_ssize_t n = len(srcs)
        if n == 0 or any(len(a) != n for a in (dsts, lengths, counts, src_strides, dst_strides)) or (
                keys is not None and len(keys) != n):
            raise ValueError(f"need equal, non-empty lists of sources, destinations, lengths, counts and strides "
                             f"(and keys) (got {len(srcs)} sources)")
        cdef const uint64_t[::1] a_src = np.ascontiguousarray(srcs, dtype=np.uint64)
        cdef const uint64_t[::1] a_dst = np.ascontiguousarray(dsts, dtype=np.uint64)
        cdef const uint64_t[::1] a_len = np.ascontiguousarray(lengths, dtype=np.uint64)
        cdef const uint64_t[::1] a_count = np.ascontiguousarray(counts, dtype=np.uint64)
        cdef const uint64_t[::1] a_sstride = np.ascontiguousarray(src_strides, dtype=np.uint64)
        cdef const uint64_t[::1] a_dstride = np.ascontiguousarray(dst_strides, dtype=np.uint64)
        cdef const uint64_t[::1] a_key = np.ascontiguousarray(np.zeros(n) if keys is None else keys, dtype=np.uint64)
        self.w = <epd_strided *> malloc(n * sizeof(epd_strided))
        if self.w == NULL:
            raise MemoryError()
        self.n = n
        self.nbytes = 0
        cdef Py_ssize_t i
        cdef Py_ssize_t bad = -1
        with nogil:
            for i in range(n):
                self.w[i].src, self.w[i].dst, self.w[i].len = a_src[i], a_dst[i], a_len[i]
                self.w[i].count, self.w[i].key = a_count[i], a_key[i]
                self.w[i].src_stride, self.w[i].dst_stride = a_sstride[i], a_dstride[i]
                if epd_strided_extent(a_len[i], a_count[i], a_dstride[i]) == 0 or \
                        epd_strided_extent(a_len[i], a_count[i], a_sstride[i]) == 0:
                    bad = i
                    break
                self.nbytes += a_len[i] * a_count[i]
        if bad >= 0:
            raise ValueError(f"strided write {bad}: {a_count[bad]} pieces of {a_len[bad]} bytes with strides "
                             f"{a_sstride[bad]}/{a_dstride[bad]}: lengths and counts must be positive and strides "
                             f"at least a piece")

    def __dealloc__(self):
        free(self.w)

    cdef int check_sources(self, Owner owner) except -1:
        """Each source extent must lie in the writer's own registrations (the lkey's role)."""
        for i in range(self.n):
            extent = epd_strided_extent(self.w[i].len, self.w[i].count, self.w[i].src_stride)
            if not epd_owner_covers(owner.o, self.w[i].src, extent):
                raise RegistrationError(
                    f"source 0x{self.w[i].src:x} ({extent} bytes) of strided write {i} is not inside memory "
                    f"registered with this engine; register() it first")
        return 0


cdef int _control_callback(void *ctx, const uint8_t *req, uint32_t length, uint8_t **resp,
                           uint32_t *resp_len) noexcept nogil:
    with gil:
        return _control_call(<Owner> ctx, req, length, resp, resp_len)


cdef int _control_call(Owner owner, const uint8_t *req, uint32_t length, uint8_t **resp,
                       uint32_t *resp_len) noexcept:
    cdef int status = 0
    try:
        handler = owner.control_handler
        if handler is None:
            raise ProtocolError("this engine takes no control requests")
        out = bytes(handler(PyBytes_FromStringAndSize(<const char *> req, length)))
    except BaseException as exc:  # a handler's failure goes back to the requester, never kills the server
        out = f"{type(exc).__name__}: {exc}".encode()
        status = -1
    cdef Py_ssize_t n = len(out)
    cdef uint8_t *buf = <uint8_t *> malloc(n if n else 1)
    if buf == NULL:
        return -1
    memcpy(buf, <const char *> out, n)
    resp[0] = buf
    resp_len[0] = <uint32_t> n
    return status


cdef class Owner:
    """Memory owner: the registration table, managed buffers and the TCP server placing incoming writes."""
    cdef epd_owner *o
    cdef epd_server *srv
    cdef readonly str host
    cdef readonly int port
    cdef readonly int timeout_ms
    cdef public object control_handler

    def __cinit__(self, str host, int port, int timeout_ms, int max_conns=0, int idle_ms=0, bytes secret=b""):
        """`max_conns`: connections served at once (0: no cap); `idle_ms`: a connection idle between requests
        this long is closed (0: never); `secret`: the handshake's shared secret (empty: no handshake)."""
        cdef char err[EPD_ERRLEN]
        cdef bytes bhost = host.encode()
        cdef const char *chost = bhost
        cdef int rc
        cdef epd_server_opts opts
        if timeout_ms <= 0 or max_conns < 0 or idle_ms < 0:
            raise ValueError(f"timeout_ms must be positive and max_conns, idle_ms not negative, got "
                             f"{timeout_ms}, {max_conns}, {idle_ms}")
        opts.timeout_ms = timeout_ms
        opts.max_conns = max_conns
        opts.idle_ms = idle_ms
        opts.secret_len = _secret_len(secret)
        opts.secret = <const uint8_t *> secret
        opts.control = _control_callback
        opts.control_ctx = <void *> self
        self.host = host
        self.timeout_ms = timeout_ms
        check(epd_owner_create(&self.o, timeout_ms, err), err, errno)
        with nogil:
            rc = epd_server_start(&self.srv, self.o, chost, port, &opts, err)
        if rc != EPD_OK:
            epd_owner_destroy(self.o)
            self.o = NULL
            check(rc, err, errno)
        self.port = epd_server_port(self.srv)

    cdef int _alive(self) except -1:
        if self.o == NULL:
            raise ValueError("the engine is closed")
        return 0

    def register(self, uint64_t addr, uint64_t length) -> int:
        """Register; returns the registration's key."""
        cdef char err[EPD_ERRLEN]
        cdef uint64_t key = 0
        self._alive()
        check(epd_owner_register(self.o, addr, length, &key, err), err, errno)
        return key

    def deregister(self, uint64_t addr) -> None:
        cdef char err[EPD_ERRLEN]
        cdef int rc
        self._alive()
        with nogil:
            rc = epd_owner_deregister(self.o, addr, err)
        check(rc, err, errno)

    def covers(self, uint64_t addr, uint64_t length) -> bool:
        self._alive()
        return bool(epd_owner_covers(self.o, addr, length))

    def allocate_managed(self, uint64_t length) -> int:
        cdef char err[EPD_ERRLEN]
        cdef uint64_t addr = 0
        cdef int rc
        self._alive()
        with nogil:
            rc = epd_owner_alloc_managed(self.o, length, &addr, err)
        check(rc, err, errno)
        return addr

    def free_managed(self, uint64_t addr) -> None:
        cdef char err[EPD_ERRLEN]
        self._alive()
        check(epd_owner_free_managed(self.o, addr, err), err, errno)

    def regions(self) -> list:
        cdef int cap = 64, n
        cdef epd_region *buf
        self._alive()
        while True:
            buf = <epd_region *> malloc(cap * sizeof(epd_region))
            if buf == NULL:
                raise MemoryError()
            n = epd_owner_regions(self.o, buf, cap)
            if n <= cap:
                out = [(buf[i].addr, buf[i].length, "managed" if buf[i].kind else "external") for i in range(n)]
                free(buf)
                return out
            free(buf)
            cap = n

    def stats(self) -> dict:
        cdef epd_owner_stats s
        cdef epd_server_stats v
        self._alive()
        epd_owner_stats_get(self.o, &s)
        epd_server_stats_get(self.srv, &v)
        return dict(regions=s.regions, registered_bytes=s.registered_bytes, writes_in=s.writes_in,
                    bytes_in=s.bytes_in, writes_refused=s.writes_refused, writes_in_flight=s.writes_in_flight, managed_buffers=s.managed_arenas,
                    managed_bytes=s.managed_bytes, deregister_timeouts=s.deregister_timeouts,
                    pins_reaped=s.pins_reaped,
                    conns_active=v.conns_active, conns_accepted=v.conns_accepted, conns_refused=v.conns_refused,
                    conns_idle_closed=v.conns_idle_closed, auth_failures=v.auth_failures)

    def hello(self) -> tuple:
        cdef epd_hello h = epd_owner_hello(self.o)
        return (h.pid, h.table_fd, h.nonce)

    def close(self) -> None:
        """Stop the server and free the table and managed buffers. Idempotent."""
        cdef epd_server *srv = self.srv
        self.srv = NULL
        if srv != NULL:
            with nogil:
                epd_server_stop(srv)
        if self.o != NULL:
            epd_owner_destroy(self.o)
            self.o = NULL

    def __dealloc__(self):
        self.close()

    @property
    def closed(self) -> bool:
        return self.o == NULL


cdef class TcpConn:
    """A writer's TCP connection to one peer engine; one reply per write, pipelined in batches."""
    cdef epd_conn *c
    cdef readonly str peer

    def __cinit__(self, str host, int port, int timeout_ms, bytes secret=b""):
        """With `secret`, the shared-secret handshake runs before this returns (`AuthenticationError`)."""
        cdef char err[EPD_ERRLEN]
        cdef bytes bhost = host.encode()
        cdef const char *chost = bhost
        cdef int rc
        cdef uint32_t slen = _secret_len(secret)
        cdef const uint8_t *csecret = <const uint8_t *> secret
        self.peer = f"{host}:{port}"
        with nogil:
            rc = epd_conn_open(&self.c, chost, port, timeout_ms, csecret, slen, err)
        check(rc, err, errno)

    def write(self, Owner owner, srcs, dsts, lengths, keys=None) -> int:
        """Write each (src, dst, length[, key]); returns the bytes written. Raises on the first failure."""
        cdef char err[EPD_ERRLEN]
        cdef _Vectors v = _Vectors(srcs, dsts, lengths, keys)
        cdef int rc
        if self.c == NULL:
            raise ValueError("the connection is closed")
        v.check_sources(owner)
        with nogil:
            rc = epd_conn_write(self.c, v.srcs, v.dsts, v.lens, v.keys, v.n, err)
        check(rc, err, errno)
        return sum(lengths)

    def write_strided(self, Owner owner, srcs, dsts, lengths, counts, src_strides, dst_strides, keys=None) -> int:
        """Strided writes (`epd_strided`: `counts[i]` pieces of `lengths[i]` bytes); returns the bytes written."""
        cdef char err[EPD_ERRLEN]
        cdef _Strided v = _Strided(srcs, dsts, lengths, counts, src_strides, dst_strides, keys)
        cdef int rc
        if self.c == NULL:
            raise ValueError("the connection is closed")
        v.check_sources(owner)
        with nogil:
            rc = epd_conn_write_strided(self.c, v.w, v.n, err)
        check(rc, err, errno)
        return v.nbytes

    def hello(self) -> tuple:
        cdef char err[EPD_ERRLEN]
        cdef epd_hello h
        cdef int rc
        with nogil:
            rc = epd_conn_hello(self.c, &h, err)
        check(rc, err, errno)
        return (h.pid, h.table_fd, h.nonce)

    def control(self, bytes request) -> bytes:
        cdef char err[EPD_ERRLEN]
        cdef uint8_t *resp = NULL
        cdef uint32_t resp_len = 0
        cdef const uint8_t *req = request
        cdef uint32_t n = len(request)
        cdef int rc
        with nogil:
            rc = epd_conn_control(self.c, req, n, &resp, &resp_len, err)
        check(rc, err, errno)
        try:
            return PyBytes_FromStringAndSize(<const char *> resp, resp_len)
        finally:
            free(resp)

    @property
    def broken(self) -> bool:
        return self.c == NULL or bool(epd_conn_broken(self.c))

    @property
    def alive(self) -> bool:
        """False once the peer closed it (its idle timeout) or it broke: a pooled connection to drop."""
        return self.c != NULL and bool(epd_conn_alive(self.c))

    def close(self) -> None:
        if self.c != NULL:
            epd_conn_close(self.c)
            self.c = NULL

    def __dealloc__(self):
        self.close()


cdef class ShmPeer:
    """A writer's view of a same-host peer: its registration table and managed buffers, mapped."""
    cdef epd_shm_peer *p
    cdef readonly int pid

    def __cinit__(self, int pid, int table_fd, uint64_t nonce, int timeout_ms):
        cdef char err[EPD_ERRLEN]
        cdef epd_hello h
        h.pid = pid
        h.table_fd = table_fd
        h.nonce = nonce
        self.pid = pid
        check(epd_shm_attach(&self.p, &h, timeout_ms, err), err, errno)

    def write(self, Owner owner, srcs, dsts, lengths, keys=None) -> int:
        """Write each (src, dst, length[, key]) into the peer; returns the bytes written."""
        cdef char err[EPD_ERRLEN]
        cdef _Vectors v = _Vectors(srcs, dsts, lengths, keys)
        cdef int rc
        if self.p == NULL:
            raise ValueError("the peer is detached")
        v.check_sources(owner)
        with nogil:
            rc = epd_shm_write(self.p, v.srcs, v.dsts, v.lens, v.keys, v.n, err)
        check(rc, err, errno)
        return sum(lengths)

    def write_strided(self, Owner owner, srcs, dsts, lengths, counts, src_strides, dst_strides, keys=None) -> int:
        """Strided writes into the peer (`epd_strided`); returns the bytes written."""
        cdef char err[EPD_ERRLEN]
        cdef _Strided v = _Strided(srcs, dsts, lengths, counts, src_strides, dst_strides, keys)
        cdef int rc
        if self.p == NULL:
            raise ValueError("the peer is detached")
        v.check_sources(owner)
        with nogil:
            rc = epd_shm_write_strided(self.p, v.w, v.n, err)
        check(rc, err, errno)
        return v.nbytes

    def close(self) -> None:
        if self.p != NULL:
            epd_shm_detach(self.p)
            self.p = NULL

    def __dealloc__(self):
        self.close()

