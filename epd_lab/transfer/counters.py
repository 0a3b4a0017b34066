"""Counters of an engine as a writer, shared by our engine and the Mooncake adapter."""
from __future__ import annotations

import threading


class WriteCounters:
    """``writes_out``, ``bytes_out``, ``failures_out``, and ``bytes_out_<path>`` by the path the bytes took
    (``tcp``, ``shm``, ``verbs``: which link a deployment really uses); safe to update from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {"writes_out": 0, "bytes_out": 0, "failures_out": 0}

    def count(self, writes: int = 0, nbytes: int = 0, failed: bool = False, path: str = "") -> None:
        """Add one call's outcome: `writes` blocks of `nbytes` in all over `path` (when named), or a failure."""
        with self._lock:
            self._values["writes_out"] += writes
            self._values["bytes_out"] += nbytes
            self._values["failures_out"] += failed
            if path:
                self._values[f"bytes_out_{path}"] = self._values.get(f"bytes_out_{path}", 0) + nbytes

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters."""
        with self._lock:
            return dict(self._values)
