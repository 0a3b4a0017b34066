# cython: language_level=3
"""libibverbs for epd_lab: device discovery and the RC queue-pair objects that RDMA WRITE needs.

The pyverbs shape: one class per verbs object (`Context`, `PD`, `MR`, `CQ`, `QP`), each with an
idempotent `close()` that `__dealloc__` also calls, each a context manager; closing a parent closes
its children. System failures raise `TransferError(message, errno)`; misuse raises `ValueError`.
Objects are not thread-safe: one thread uses a QP and its CQ at a time.

Compiled on these machines but never run against hardware: none of them has an RDMA device.
"""
import weakref

cimport cython
from libc.errno cimport ENODEV, errno
from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset, strerror
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cimport libibverbs as v

from epd_lab.transfer.errors import TransferError

ACCESS_LOCAL_WRITE = v.IBV_ACCESS_LOCAL_WRITE
ACCESS_REMOTE_WRITE = v.IBV_ACCESS_REMOTE_WRITE
ACCESS_REMOTE_READ = v.IBV_ACCESS_REMOTE_READ

WC_SUCCESS = v.IBV_WC_SUCCESS
WC_WR_FLUSH_ERR = v.IBV_WC_WR_FLUSH_ERR
WC_REM_ACCESS_ERR = v.IBV_WC_REM_ACCESS_ERR
WC_RETRY_EXC_ERR = v.IBV_WC_RETRY_EXC_ERR

_MTU_BYTES = {v.IBV_MTU_256: 256, v.IBV_MTU_512: 512, v.IBV_MTU_1024: 1024,
              v.IBV_MTU_2048: 2048, v.IBV_MTU_4096: 4096}
_MTU_ENUM = {nbytes: mtu for mtu, nbytes in _MTU_BYTES.items()}
_PORT_STATES = {v.IBV_PORT_NOP: "nop", v.IBV_PORT_DOWN: "down", v.IBV_PORT_INIT: "init",
                v.IBV_PORT_ARMED: "armed", v.IBV_PORT_ACTIVE: "active",
                v.IBV_PORT_ACTIVE_DEFER: "active_defer"}
_LINK_LAYERS = {v.IBV_LINK_LAYER_UNSPECIFIED: "unspecified",
                v.IBV_LINK_LAYER_INFINIBAND: "infiniband",
                v.IBV_LINK_LAYER_ETHERNET: "ethernet"}
_PSN_LIMIT = 1 << 24  # QP numbers and PSNs are 24-bit on the wire

# RC path parameters: ack timeout 4.096 us * 2**14 ~ 67 ms, 7 retries, so a dead peer turns into a
# RETRY_EXC_ERR completion within about a second instead of a hang. (RNR retries only concern
# SENDs, which need a posted receive; an RDMA WRITE never waits for one.)
cdef enum:
    _ACK_TIMEOUT = 14
    _RETRY_CNT = 7
    _RNR_RETRY = 7
    _MIN_RNR_TIMER = 12
    # Routed RoCEv2 crosses IP hops; 1 (what ibv_rc_pingpong uses) only reaches the local subnet.
    _HOP_LIMIT = 64


cdef object _system_error(str verb, int err):
    """TransferError for a failed verb: the verb, strerror and errno (None when none was set)."""
    if err == 0:
        return TransferError(f"{verb} failed (no errno set)", None)
    return TransferError(f"{verb} failed: {strerror(err).decode()} (errno {err})", err)


cdef object _closed(str what):
    return ValueError(f"{what} is closed")


cdef int _close_children(object children) except -1:
    # A snapshot: closing a child may drop the last reference to it and shrink the weak set.
    for child in list(children):
        child.close()
    return 0


cdef unsigned int _check_port(int port_num) except 0:
    if not 1 <= port_num <= 255:
        raise ValueError(f"port_num must be in 1..255, got {port_num}")
    return port_num


cdef unsigned int _check_24bit(str what, long long value) except? 0xFFFFFFFF:
    if not 0 <= value < _PSN_LIMIT:
        raise ValueError(f"{what} must be a 24-bit value, got {value}")
    return <unsigned int>value


cdef str _format_guid(uint64_t guid):
    text = f"{guid:016x}"
    return ":".join(text[i:i + 4] for i in range(0, 16, 4))


def format_gid(bytes gid not None):
    """A 16-byte GID as ibv_devinfo prints it: eight groups of four hex digits."""
    if len(gid) != 16:
        raise ValueError(f"a GID is 16 bytes, got {len(gid)}")
    return ":".join(gid[i:i + 2].hex() for i in range(0, 16, 2))


def wc_status_str(int status):
    """The libibverbs name of a work-completion status, e.g. 'remote access error'."""
    return v.ibv_wc_status_str(<v.ibv_wc_status>status).decode()


cdef dict _describe(v.ibv_device *device):
    cdef Context ctx
    info = {
        "name": v.ibv_get_device_name(device).decode(),
        "guid": _format_guid(v.be64toh(v.ibv_get_device_guid(device))),
        "ports": [],
    }
    ctx = Context.__new__(Context)
    try:
        ctx._open(device)
    except TransferError:
        return info  # listed but not openable (permissions, a dead device): ports unknown
    with ctx:
        for port_num in range(1, ctx.query_device()["phys_port_cnt"] + 1):
            try:
                port = ctx.query_port(port_num)
            except TransferError:
                continue
            try:
                port["gid"] = format_gid(ctx.query_gid(port_num, 0))
            except TransferError:
                port["gid"] = None
            info["ports"].append(port)
    return info


def get_device_list():
    """Every RDMA device with its name, node GUID and ports (state, lid, active_mtu, gid[0]).

    Returns [] when there is none, including when the kernel has no RDMA support at all
    (ibv_get_device_list returns NULL with ENOSYS): "no device" is an answer, not an error.
    """
    cdef int num = 0
    cdef int i
    cdef v.ibv_device **devices = v.ibv_get_device_list(&num)
    if devices == NULL:
        return []
    try:
        return [_describe(devices[i]) for i in range(num)]
    finally:
        v.ibv_free_device_list(devices)


cdef class _Resource:
    """What every verbs object shares: an idempotent close() and use as a context manager.

    A subclass implements `_close` and its own ``__dealloc__`` calling it: Cython clears a subclass's object
    fields (its parents, its children) before the base's ``__dealloc__`` runs, and closing needs them.
    """

    cdef object __weakref__

    cdef int _close(self) except -1:
        return 0

    def close(self) -> None:
        """Release the object, its children first (see the class's docstring). Idempotent."""
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._close()


# Each parent keeps a weak set of its children: a child holds its parent alive, and the parent's
# close() closes the children first (QPs and MRs before their PD and CQ, all before the device).
# no_gc_clear: __dealloc__ needs the parent references to close in the right order, even when the
# collector frees the object as part of a cycle.
@cython.no_gc_clear
cdef class Context(_Resource):
    """An opened RDMA device (ibv_open_device). `Context()` opens the first device.

    close() closes every PD, MR, CQ and QP made from this context, then the device.
    """

    cdef v.ibv_context *ctx
    cdef readonly str name
    cdef object _children

    def __cinit__(self, *args, **kwargs):
        self._children = weakref.WeakSet()

    def __init__(self, name: str | None = None):
        cdef int num = 0
        cdef int i
        cdef v.ibv_device **devices = v.ibv_get_device_list(&num)
        if devices == NULL:
            raise _system_error("ibv_get_device_list", errno)
        try:
            names = [v.ibv_get_device_name(devices[i]).decode() for i in range(num)]
            if not names:
                raise TransferError("no RDMA device: ibv_get_device_list returned none", ENODEV)
            if name is None:
                i = 0
            elif name in names:
                i = names.index(name)
            else:
                raise ValueError(f"no RDMA device named {name!r}; devices: {', '.join(names)}")
            # The device pointers die with the list: open before freeing it.
            self._open(devices[i])
        finally:
            v.ibv_free_device_list(devices)

    cdef int _open(self, v.ibv_device *device) except -1:
        self.name = v.ibv_get_device_name(device).decode()
        self.ctx = v.ibv_open_device(device)
        if self.ctx == NULL:
            raise _system_error(f"ibv_open_device({self.name})", errno)
        return 0

    def query_device(self) -> dict:
        """Device limits this binding uses: fw_ver, max_mr_size, max_qp, max_qp_wr, max_cqe,
        phys_port_cnt."""
        cdef v.ibv_device_attr attr
        if self.ctx == NULL:
            raise _closed("Context")
        rc = v.ibv_query_device(self.ctx, &attr)
        if rc != 0:
            raise _system_error("ibv_query_device", rc)
        return {
            "fw_ver": attr.fw_ver.decode(errors="replace"),
            "max_mr_size": attr.max_mr_size,
            "max_qp": attr.max_qp,
            "max_qp_wr": attr.max_qp_wr,
            "max_cqe": attr.max_cqe,
            "phys_port_cnt": attr.phys_port_cnt,
        }

    def query_port(self, int port_num) -> dict:
        """Port attributes: port, state ('active', 'down', ...), lid, active_mtu and max_mtu in
        bytes, max_msg_sz, gid_tbl_len, link_layer ('infiniband' or 'ethernet' for RoCE)."""
        cdef v.ibv_port_attr attr
        if self.ctx == NULL:
            raise _closed("Context")
        memset(&attr, 0, sizeof(attr))
        rc = v.ibv_query_port(self.ctx, _check_port(port_num), &attr)
        if rc != 0:
            raise _system_error(f"ibv_query_port({self.name}, {port_num})", rc)
        return {
            "port": port_num,
            "state": _PORT_STATES.get(attr.state, str(attr.state)),
            "lid": attr.lid,
            "active_mtu": _MTU_BYTES.get(attr.active_mtu, 0),
            "max_mtu": _MTU_BYTES.get(attr.max_mtu, 0),
            "max_msg_sz": attr.max_msg_sz,
            "gid_tbl_len": attr.gid_tbl_len,
            "link_layer": _LINK_LAYERS.get(attr.link_layer, str(attr.link_layer)),
        }

    def query_gid(self, int port_num, int index) -> bytes:
        """Entry `index` of the port's GID table, 16 raw bytes."""
        cdef v.ibv_gid gid
        if self.ctx == NULL:
            raise _closed("Context")
        if index < 0:
            raise ValueError(f"GID index must be >= 0, got {index}")
        rc = v.ibv_query_gid(self.ctx, _check_port(port_num), index, &gid)
        if rc != 0:
            raise _system_error(f"ibv_query_gid({self.name}, {port_num}, {index})", errno)
        return (<char *>gid.raw)[:16]

    cdef int _close(self) except -1:
        if self.ctx == NULL:
            return 0
        _close_children(self._children)
        if v.ibv_close_device(self.ctx) != 0:
            raise _system_error("ibv_close_device", errno)
        self.ctx = NULL
        return 0

    def __dealloc__(self):
        self._close()

    def __repr__(self):
        return f"<Context {self.name!r}{' closed' if self.ctx == NULL else ''}>"


@cython.no_gc_clear
cdef class PD(_Resource):
    """A protection domain (ibv_alloc_pd): MRs and QPs of one PD may be used together.

    close() closes this PD's MRs and QPs, then deallocates it.
    """

    cdef v.ibv_pd *pd
    cdef readonly Context context
    cdef object _children

    def __cinit__(self, *args, **kwargs):
        self._children = weakref.WeakSet()

    def __init__(self, Context context not None):
        if context.ctx == NULL:
            raise _closed("Context")
        self.pd = v.ibv_alloc_pd(context.ctx)
        if self.pd == NULL:
            raise _system_error("ibv_alloc_pd", errno)
        self.context = context
        context._children.add(self)

    cdef int _close(self) except -1:
        if self.pd == NULL:
            return 0
        _close_children(self._children)
        rc = v.ibv_dealloc_pd(self.pd)
        if rc != 0:
            raise _system_error("ibv_dealloc_pd", rc)
        self.pd = NULL
        return 0

    def __dealloc__(self):
        self._close()


@cython.no_gc_clear
cdef class MR(_Resource):
    """A registered memory region (ibv_reg_mr). The caller keeps the memory alive until close(), which
    deregisters it (ibv_dereg_mr)."""

    cdef v.ibv_mr *mr
    cdef readonly PD pd

    def __init__(self, PD pd not None, uintptr_t addr, size_t length, int access):
        if pd.pd == NULL:
            raise _closed("PD")
        if addr == 0 or length == 0:
            raise ValueError(f"cannot register addr={addr:#x} length={length}: null or empty")
        self.mr = v.ibv_reg_mr(pd.pd, <void *>addr, length, access)
        if self.mr == NULL:
            raise _system_error(f"ibv_reg_mr(addr={addr:#x}, length={length})", errno)
        self.pd = pd
        pd._children.add(self)

    @property
    def addr(self) -> int:
        if self.mr == NULL:
            raise _closed("MR")
        return <uintptr_t>self.mr.addr

    @property
    def length(self) -> int:
        if self.mr == NULL:
            raise _closed("MR")
        return self.mr.length

    @property
    def lkey(self) -> int:
        if self.mr == NULL:
            raise _closed("MR")
        return self.mr.lkey

    @property
    def rkey(self) -> int:
        if self.mr == NULL:
            raise _closed("MR")
        return self.mr.rkey

    cdef int _close(self) except -1:
        if self.mr == NULL:
            return 0
        rc = v.ibv_dereg_mr(self.mr)
        if rc != 0:
            raise _system_error("ibv_dereg_mr", rc)
        self.mr = NULL
        return 0

    def __dealloc__(self):
        self._close()

    def __repr__(self):
        if self.mr == NULL:
            return "<MR closed>"
        return (f"<MR addr={<uintptr_t>self.mr.addr:#x} length={self.mr.length} "
                f"lkey={self.mr.lkey:#x} rkey={self.mr.rkey:#x}>")


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef int _poll_until(v.ibv_cq *cq, int max_entries, v.ibv_wc *wc, double timeout_s) noexcept nogil:
    # Busy-poll: ibv_poll_cq is a call into the provider's user-space ring, no system call.
    cdef double deadline = _now() + timeout_s
    cdef int n
    while True:
        n = v.ibv_poll_cq(cq, max_entries, wc)
        if n != 0 or _now() >= deadline:
            return n


@cython.no_gc_clear
cdef class CQ(_Resource):
    """A completion queue (ibv_create_cq) without a completion channel: it is busy-polled.

    close() destroys the QPs that use this CQ, then the CQ.
    """

    cdef v.ibv_cq *cq
    cdef readonly Context context
    cdef object _children

    def __cinit__(self, *args, **kwargs):
        self._children = weakref.WeakSet()

    def __init__(self, Context context not None, int cqe=256):
        if context.ctx == NULL:
            raise _closed("Context")
        if cqe < 1:
            raise ValueError(f"cqe must be >= 1, got {cqe}")
        self.cq = v.ibv_create_cq(context.ctx, cqe, NULL, NULL, 0)
        if self.cq == NULL:
            raise _system_error(f"ibv_create_cq(cqe={cqe})", errno)
        self.context = context
        context._children.add(self)

    @property
    def cqe(self) -> int:
        """The capacity the provider gave (at least what was asked)."""
        if self.cq == NULL:
            raise _closed("CQ")
        return self.cq.cqe

    def poll(self, int max_entries=16, double timeout_s=0.0) -> list:
        """Busy-poll, without the GIL, until at least one completion arrives or `timeout_s` passes.

        Returns up to `max_entries` (wr_id, status, vendor_err) tuples; [] on timeout.
        `timeout_s=0` polls once.
        """
        cdef v.ibv_wc *wc
        cdef int n, i
        if self.cq == NULL:
            raise _closed("CQ")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        wc = <v.ibv_wc *>malloc(max_entries * sizeof(v.ibv_wc))
        if wc == NULL:
            raise MemoryError()
        try:
            with nogil:
                n = _poll_until(self.cq, max_entries, wc, timeout_s)
            if n < 0:
                raise TransferError(f"ibv_poll_cq failed (returned {n})", None)
            return [(wc[i].wr_id, <int>wc[i].status, wc[i].vendor_err) for i in range(n)]
        finally:
            free(wc)

    cdef int _close(self) except -1:
        if self.cq == NULL:
            return 0
        _close_children(self._children)
        rc = v.ibv_destroy_cq(self.cq)
        if rc != 0:
            raise _system_error("ibv_destroy_cq", rc)
        self.cq = NULL
        return 0

    def __dealloc__(self):
        self._close()


@cython.no_gc_clear
cdef class QP(_Resource):
    """A reliable-connected queue pair (ibv_create_qp, IBV_QPT_RC) for RDMA WRITE.

    Bring it up with to_init -> to_rtr -> to_rts after exchanging (qp_num, psn, lid, gid) with the
    peer out of band. Work requests are unsignaled unless asked: sq_sig_all is 0. close() destroys the QP
    (work still queued is dropped).
    """

    cdef v.ibv_qp *qp
    cdef readonly PD pd
    cdef readonly CQ cq
    cdef readonly unsigned int max_send_wr

    def __init__(self, PD pd not None, CQ cq not None, unsigned int max_send_wr=128):
        cdef v.ibv_qp_init_attr init_attr
        if pd.pd == NULL:
            raise _closed("PD")
        if cq.cq == NULL:
            raise _closed("CQ")
        if pd.context is not cq.context:
            raise ValueError("the PD and the CQ belong to different contexts")
        if max_send_wr < 1:
            raise ValueError("max_send_wr must be >= 1")
        memset(&init_attr, 0, sizeof(init_attr))
        init_attr.send_cq = cq.cq
        init_attr.recv_cq = cq.cq
        init_attr.cap.max_send_wr = max_send_wr
        # Nothing is ever received, but some providers refuse a zero-sized receive queue.
        init_attr.cap.max_recv_wr = 1
        init_attr.cap.max_send_sge = 1
        init_attr.cap.max_recv_sge = 1
        init_attr.qp_type = v.IBV_QPT_RC
        init_attr.sq_sig_all = 0
        self.qp = v.ibv_create_qp(pd.pd, &init_attr)
        if self.qp == NULL:
            raise _system_error(f"ibv_create_qp(max_send_wr={max_send_wr})", errno)
        # The provider writes back the capacities it actually gave.
        self.max_send_wr = init_attr.cap.max_send_wr
        self.pd = pd
        self.cq = cq
        pd._children.add(self)
        cq._children.add(self)

    @property
    def qp_num(self) -> int:
        if self.qp == NULL:
            raise _closed("QP")
        return self.qp.qp_num

    cdef int _modify(self, v.ibv_qp_attr *attr, int mask, str verb) except -1:
        if self.qp == NULL:
            raise _closed("QP")
        rc = v.ibv_modify_qp(self.qp, attr, mask)
        if rc != 0:
            raise _system_error(verb, rc)
        return 0

    def to_init(self, int port_num, int access=v.IBV_ACCESS_REMOTE_WRITE) -> None:
        """RESET -> INIT on `port_num`; `access` is what remote peers may do through this QP."""
        cdef v.ibv_qp_attr attr
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = v.IBV_QPS_INIT
        attr.pkey_index = 0
        attr.port_num = _check_port(port_num)
        attr.qp_access_flags = access
        self._modify(&attr, v.IBV_QP_STATE | v.IBV_QP_PKEY_INDEX | v.IBV_QP_PORT
                     | v.IBV_QP_ACCESS_FLAGS, "ibv_modify_qp(INIT)")

    def to_rtr(self, long long remote_qpn, long long remote_psn, int remote_lid,
               remote_gid, int gid_index, int port_num, int mtu) -> None:
        """INIT -> RTR: connect to the peer's QP.

        `remote_gid` (16 bytes) adds a global route header, which RoCE always needs; None routes
        by `remote_lid` alone (InfiniBand within a subnet). `mtu` is in bytes (256..4096).
        """
        cdef v.ibv_qp_attr attr
        if mtu not in _MTU_ENUM:
            raise ValueError(f"mtu must be one of {sorted(_MTU_ENUM)}, got {mtu}")
        if not 0 <= remote_lid <= 0xFFFF:
            raise ValueError(f"remote_lid must be a 16-bit value, got {remote_lid}")
        if not 0 <= gid_index <= 255:
            raise ValueError(f"gid_index must be in 0..255, got {gid_index}")
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = v.IBV_QPS_RTR
        attr.path_mtu = _MTU_ENUM[mtu]
        attr.dest_qp_num = _check_24bit("remote_qpn", remote_qpn)
        attr.rq_psn = _check_24bit("remote_psn", remote_psn)
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = _MIN_RNR_TIMER
        attr.ah_attr.dlid = remote_lid
        attr.ah_attr.sl = 0
        attr.ah_attr.src_path_bits = 0
        attr.ah_attr.port_num = _check_port(port_num)
        if remote_gid is not None:
            if not isinstance(remote_gid, bytes) or len(remote_gid) != 16:
                raise ValueError(f"remote_gid must be 16 bytes or None, got {remote_gid!r}")
            attr.ah_attr.is_global = 1
            memcpy(attr.ah_attr.grh.dgid.raw, <const char *>remote_gid, 16)
            attr.ah_attr.grh.sgid_index = gid_index
            attr.ah_attr.grh.hop_limit = _HOP_LIMIT
        self._modify(&attr, v.IBV_QP_STATE | v.IBV_QP_AV | v.IBV_QP_PATH_MTU | v.IBV_QP_DEST_QPN
                     | v.IBV_QP_RQ_PSN | v.IBV_QP_MAX_DEST_RD_ATOMIC | v.IBV_QP_MIN_RNR_TIMER,
                     "ibv_modify_qp(RTR)")

    def to_rts(self, long long psn) -> None:
        """RTR -> RTS: the send queue starts at `psn` (the one the peer was told)."""
        cdef v.ibv_qp_attr attr
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = v.IBV_QPS_RTS
        attr.sq_psn = _check_24bit("psn", psn)
        attr.timeout = _ACK_TIMEOUT
        attr.retry_cnt = _RETRY_CNT
        attr.rnr_retry = _RNR_RETRY
        attr.max_rd_atomic = 1
        self._modify(&attr, v.IBV_QP_STATE | v.IBV_QP_SQ_PSN | v.IBV_QP_TIMEOUT
                     | v.IBV_QP_RETRY_CNT | v.IBV_QP_RNR_RETRY | v.IBV_QP_MAX_QP_RD_ATOMIC,
                     "ibv_modify_qp(RTS)")

    def post_rdma_write(self, uint64_t wr_id, uintptr_t local_addr, size_t length,
                        unsigned int lkey, uint64_t remote_addr, unsigned int rkey,
                        bint signaled=True) -> None:
        """Post one IBV_WR_RDMA_WRITE of `length` bytes (one SGE), without the GIL.

        An unsignaled write produces a completion only if it fails; a later signaled one on the
        same QP completes after it (RC executes in order).
        """
        cdef v.ibv_sge sge
        cdef v.ibv_send_wr wr
        cdef v.ibv_send_wr *bad_wr = NULL
        cdef int rc
        if self.qp == NULL:
            raise _closed("QP")
        if length == 0 or length > 0xFFFFFFFF:
            raise ValueError(f"length must be in 1..2**32-1 (one SGE), got {length}")
        sge.addr = local_addr
        sge.length = <unsigned int>length
        sge.lkey = lkey
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = wr_id
        wr.sg_list = &sge
        wr.num_sge = 1
        wr.opcode = v.IBV_WR_RDMA_WRITE
        wr.send_flags = v.IBV_SEND_SIGNALED if signaled else 0
        wr.wr.rdma.remote_addr = remote_addr
        wr.wr.rdma.rkey = rkey
        with nogil:
            rc = v.ibv_post_send(self.qp, &wr, &bad_wr)
        if rc != 0:
            # ENOMEM here means the send queue is full: more unsignaled work than max_send_wr.
            raise _system_error("ibv_post_send(RDMA_WRITE)", rc)

    cdef int _close(self) except -1:
        if self.qp == NULL:
            return 0
        rc = v.ibv_destroy_qp(self.qp)
        if rc != 0:
            raise _system_error("ibv_destroy_qp", rc)
        self.qp = NULL
        return 0

    def __dealloc__(self):
        self._close()

    def __repr__(self):
        if self.qp == NULL:
            return "<QP closed>"
        return f"<QP qp_num={self.qp.qp_num} max_send_wr={self.max_send_wr}>"
