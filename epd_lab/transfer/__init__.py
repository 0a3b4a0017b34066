"""The transfer engine: one-sided writes into memory a peer registered beforehand."""
from epd_lab.transfer.buffers import as_array, buffer_info
from epd_lab.transfer.engine import (
    PROTOCOLS,
    Registration,
    TransferEngine,
    TransferStatus,
    open_engine,
    parse_session_id,
)
from epd_lab.transfer.errors import (
    PeerUnreachable,
    ProtocolError,
    RegistrationError,
    RemoteAccessError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)

__all__ = [
    "PROTOCOLS",
    "PeerUnreachable",
    "ProtocolError",
    "Registration",
    "RegistrationError",
    "RemoteAccessError",
    "TransferEngine",
    "TransferError",
    "TransferStatus",
    "TransferTimeout",
    "TransportUnavailable",
    "as_array",
    "buffer_info",
    "open_engine",
    "parse_session_id",
]
