"""Type stub of epd_lab._verbs, the libibverbs binding (native/_verbs.pyx)."""
from types import TracebackType
from typing import Any

from typing_extensions import Self, disjoint_base

ACCESS_LOCAL_WRITE: int
ACCESS_REMOTE_WRITE: int
ACCESS_REMOTE_READ: int

WC_SUCCESS: int
WC_WR_FLUSH_ERR: int
WC_REM_ACCESS_ERR: int
WC_RETRY_EXC_ERR: int

def get_device_list() -> list[dict[str, Any]]:
    """Devices as {"name", "guid", "ports"}; each port is query_port's dict plus "gid" (gid[0] as
    ibv_devinfo prints it, or None). [] when there is no device."""
def format_gid(gid: bytes) -> str: ...
def wc_status_str(status: int) -> str: ...

class _Resource:
    """What every verbs object shares: close() (idempotent; a parent closes its children first), and use
    as a context manager."""
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

@disjoint_base
class Context(_Resource):
    @property
    def name(self) -> str: ...
    def __init__(self, name: str | None = None) -> None: ...
    def query_device(self) -> dict[str, Any]:
        """fw_ver, max_mr_size, max_qp, max_qp_wr, max_cqe, phys_port_cnt."""
    def query_port(self, port_num: int) -> dict[str, Any]:
        """port, state ("active", "down", ...), lid, active_mtu and max_mtu in bytes, max_msg_sz,
        gid_tbl_len, link_layer ("infiniband", "ethernet", "unspecified")."""
    def query_gid(self, port_num: int, index: int) -> bytes: ...

@disjoint_base
class PD(_Resource):
    @property
    def context(self) -> Context: ...
    def __init__(self, context: Context) -> None: ...

@disjoint_base
class MR(_Resource):
    @property
    def pd(self) -> PD: ...
    def __init__(self, pd: PD, addr: int, length: int, access: int) -> None: ...
    @property
    def addr(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def lkey(self) -> int: ...
    @property
    def rkey(self) -> int: ...

@disjoint_base
class CQ(_Resource):
    @property
    def context(self) -> Context: ...
    def __init__(self, context: Context, cqe: int = 256) -> None: ...
    @property
    def cqe(self) -> int: ...
    def poll(self, max_entries: int = 16, timeout_s: float = 0.0) -> list[tuple[int, int, int]]:
        """(wr_id, status, vendor_err) of up to max_entries completions; [] on timeout."""

@disjoint_base
class QP(_Resource):
    @property
    def pd(self) -> PD: ...
    @property
    def cq(self) -> CQ: ...
    @property
    def max_send_wr(self) -> int:
        """Send-queue depth the provider gave (at least what was asked)."""
    def __init__(self, pd: PD, cq: CQ, max_send_wr: int = 128) -> None: ...
    @property
    def qp_num(self) -> int: ...
    def to_init(self, port_num: int, access: int = ...) -> None: ...
    def to_rtr(
        self,
        remote_qpn: int,
        remote_psn: int,
        remote_lid: int,
        remote_gid: bytes | None,
        gid_index: int,
        port_num: int,
        mtu: int,
    ) -> None: ...
    def to_rts(self, psn: int) -> None: ...
    def post_rdma_write(
        self,
        wr_id: int,
        local_addr: int,
        length: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
        signaled: bool = True,
    ) -> None: ...
