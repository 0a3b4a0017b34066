"""Errors of the transfer engine.

Two families, as pyverbs has them: misuse of the API (`RegistrationError`, a `ValueError`) and
failures of a transfer (`TransferError` and its kinds), which carry an errno where the system gave one.
"""
from __future__ import annotations


class RegistrationError(ValueError):
    """register/deregister misuse: zero length, overlap, double registration, unknown pointer."""


class TransferError(RuntimeError):
    """A transfer failed. `errno` is set when the failure came from a system call."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class RemoteAccessError(TransferError):
    """The owner of the destination refused the write: it is not inside memory the owner registered
    (the rkey/bounds check of an RDMA NIC)."""


class PeerUnreachable(TransferError, ConnectionError):
    """The peer could not be reached, refused the connection, or died."""


class TransferTimeout(TransferError, TimeoutError):
    """The peer made no progress within the engine's timeout (frozen or overloaded)."""


class ProtocolError(TransferError):
    """The peer sent bytes that are not the engine's protocol."""


class AuthenticationError(TransferError, PermissionError):
    """The shared-secret handshake with the peer failed: one side has no secret or another one
    (`epd_lab.security`)."""


class TransportUnavailable(TransferError):
    """The requested transport cannot run here (no RDMA device, peer on another host, package missing)."""
