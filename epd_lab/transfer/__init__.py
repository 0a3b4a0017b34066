"""The transfer engine: one-sided writes into memory a peer registered beforehand."""
from epd_lab.transfer.buffers import as_array, buffer_info
from epd_lab.transfer.engine import PROTOCOLS, TransferEngine, TransferStatus, parse_session_id
from epd_lab.transfer.errors import (
    AuthenticationError,
    PeerUnreachable,
    ProtocolError,
    RegistrationError,
    RemoteAccessError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from epd_lab.transfer.registration import Registration
from epd_lab.transfer.registry import ENGINES, open_engine, register_transport, transports

__all__ = [
    "AuthenticationError",
    "ENGINES",
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
    "register_transport",
    "transports",
]
