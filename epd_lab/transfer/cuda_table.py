"""A same-host owner's registration table, read and pinned from Python (the `cuda` transport's check).

The native core publishes each engine's registration table in a memfd (native/epd_core.c, ``table_t``);
a same-host writer maps it and, before each write, pins the registration covering each block (so that a
deregister waits for the write) or refuses the write and counts it in the owner's ``writes_refused``. The
shm path does this in C around its memcpy. The `cuda` transport copies with the GPU instead, so it does
the same steps here, on the same shared table, with the same atomic operations (libatomic's out-of-line
``__atomic_fetch_add``, the lock-free instruction the C side inlines): pin, re-check, copy, release.

These pins are counted in the slot itself, unlike the shm path's, which are counted per writer process so
that the owner drops those of a writer that died mid-copy: a cuda writer killed mid-copy still leaves its pins
until the owner's deregister gives up (twice the timeout).

The layout below mirrors ``table_t``/``slot_t`` in epd_core.c up to the slots (the shm writers' records follow); `tests/test_cuda.py` checks it against
the C side on every machine (a region registered by the native owner must be seen here, with its key).
"""
from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import struct
from typing import Sequence

import numpy as np

from epd_lab.transfer.errors import PeerUnreachable, RemoteAccessError, TransportUnavailable

TABLE_MAGIC = 0x32304C4254445045  # "EPDTBL02"
MAX_ARENAS, TABLE_CAP = 256, 8192
SLOT_ACTIVE = 1
_HEADER = 128  # magic, nonce, pid, used, writes_in, bytes_in, writes_refused, arena_epoch, pins_reaped, pad[8]
_ARENA_REC = 32
_SLOTS = _HEADER + MAX_ARENAS * _ARENA_REC
_SLOT = 64
TABLE_BYTES = _SLOTS + TABLE_CAP * _SLOT
# byte offsets inside the header and inside a slot (epd_core.c)
_OFF_NONCE, _OFF_PID, _OFF_USED = 8, 16, 20
_OFF_WRITES_IN, _OFF_BYTES_IN, _OFF_REFUSED = 24, 32, 40
_SLOT_DTYPE = np.dtype({"names": ["addr", "length", "state", "inflight", "key"],
                        "formats": ["<u8", "<u8", "<u4", "<i4", "<u8"],
                        "offsets": [0, 8, 16, 32, 40], "itemsize": _SLOT})
_SEQ_CST = 5
_SLOT_LIVE = struct.Struct("<QQI20xQ")  # addr, length, state, (kind, arena, inflight, pad), key


def _atomics():
    try:
        lib = ctypes.CDLL("libatomic.so.1")
    except OSError as exc:
        raise TransportUnavailable(f"the cuda transport pins registrations with libatomic: {exc}") from exc
    add4, add8 = lib.__atomic_fetch_add_4, lib.__atomic_fetch_add_8
    add4.argtypes = (ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int)
    add4.restype = ctypes.c_uint32
    add8.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int)
    add8.restype = ctypes.c_uint64
    return add4, add8


class Pins:
    """Registrations pinned for one write; `release` them once the bytes are in place (or not)."""

    __slots__ = ("_table", "_slots", "_writes", "_nbytes", "keys")

    @property
    def nbytes(self) -> int:
        """The bytes of the blocks pinned."""
        return self._nbytes

    def __init__(self, table: "PeerTable", slots: list[int], writes: int, nbytes: int,
                 keys: tuple[int, ...] = ()) -> None:
        self._table, self._slots, self._writes, self._nbytes = table, slots, writes, nbytes
        self.keys = keys  # of the registrations pinned

    def release(self, landed: bool) -> None:
        """Unpin; count the blocks and bytes in the owner's ``writes_in``/``bytes_in`` if they landed."""
        t = self._table
        for i in self._slots:
            t._add4(t._slot_addr(i) + 32, 0xFFFFFFFF, _SEQ_CST)  # inflight -= 1
        self._slots = []
        if landed:
            t._add8(t._base + _OFF_WRITES_IN, self._writes, _SEQ_CST)
            t._add8(t._base + _OFF_BYTES_IN, self._nbytes, _SEQ_CST)


class PeerTable:
    """The registration table of the same-host engine `pid`, mapped (as ``ShmPeer`` maps it in C).

    Args:
        pid, table_fd, nonce: what the owner's HELLO answered (``TcpConn.hello()``).
    """

    def __init__(self, pid: int, table_fd: int, nonce: int) -> None:
        self._add4, self._add8 = _atomics()
        try:
            fd = os.open(f"/proc/{pid}/fd/{table_fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise PeerUnreachable(f"cannot open the registration table of pid {pid}: {exc}", exc.errno) from exc
        try:
            self._map = mmap.mmap(fd, TABLE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, got_nonce, got_pid = struct.unpack_from("<QQi", self._map, 0)
        if magic != TABLE_MAGIC or got_nonce != nonce or got_pid != pid:
            self.close()
            raise PeerUnreachable(f"pid {pid}'s table does not match its HELLO (not the engine behind that port)")
        self.pid = pid
        self._raw = np.frombuffer(self._map, dtype=np.uint8)
        self._base = self._raw.ctypes.data
        self._used = self._raw[_OFF_USED:_OFF_USED + 4].view("<u4")
        self._slots = self._raw[_SLOTS:].view(_SLOT_DTYPE)
        self._rebuild()

    def _slot_addr(self, i: int) -> int:
        return self._base + _SLOTS + i * _SLOT

    def _rebuild(self) -> None:
        """Snapshot the live registrations, sorted by address (they never overlap: the owner refuses that).
        The snapshot only proposes a slot; `_live` confirms it against the shared fields each time."""
        s = self._slots[:int(self._used[0])]
        live = np.flatnonzero(s["state"] == SLOT_ACTIVE)
        order = np.argsort(s["addr"][live])
        live = live[order]
        self._c_slots = live
        self._c_starts = s["addr"][live].copy()
        self._c_stops = self._c_starts + s["length"][live]
        self._c_keys = s["key"][live].copy()
        self._l_starts = self._c_starts.tolist()
        self._l_rows = list(zip(live.tolist(), self._c_starts.tolist(), self._c_stops.tolist(),
                                self._c_keys.tolist()))

    def _live(self, slot: int, addr: int, stop: int, key: int) -> bool:
        """Whether the shared slot still holds exactly this live registration."""
        a, n, state, k = _SLOT_LIVE.unpack_from(self._map, _SLOTS + slot * _SLOT)
        return state == SLOT_ACTIVE and a == addr and a + n == stop and k == key

    def _find(self, dsts: np.ndarray, ends: np.ndarray, keys: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Per block, the snapshot row covering it (and carrying its key) and whether there is one."""
        j = np.searchsorted(self._c_starts, dsts, side="right") - 1
        jj = np.maximum(j, 0)
        if not len(self._c_starts):
            return jj, np.zeros(len(dsts), dtype=bool)
        hit = (j >= 0) & (ends <= self._c_stops[jj]) & (ends > dsts)
        if keys is not None:
            hit &= (keys == 0) | (keys == self._c_keys[jj])
        return jj, hit

    def _keys_of(self, rows: list[int]) -> tuple[int, ...]:
        return tuple(self._l_rows[r][3] for r in rows)

    def _pin_rows(self, rows: list[int]) -> tuple[list[int], bool]:
        """Pin the snapshot rows' slots, then confirm each is still that registration (pin first, then
        re-check: the owner marks a slot REVOKING before it waits for pins, epd_core.c)."""
        slots = []
        ok = True
        for r in rows:
            slot, addr, stop, key = self._l_rows[r]
            self._add4(self._slot_addr(slot) + 32, 1, _SEQ_CST)
            slots.append(slot)
            ok = ok and self._live(slot, addr, stop, key)
        return slots, ok

    def pin(self, dsts: np.ndarray | Sequence[int], lengths: np.ndarray | Sequence[int],
            keys: Sequence[int] | None = None, span: tuple[int, int] | None = None,
            sizes: tuple[int, int] | None = None) -> Pins:
        """Pin the registration covering each ``[dst, dst+length)`` (with `keys`: under that key).

        `span`: ``(min(dsts), max(dst + length))`` and `sizes`: ``(min(lengths), sum(lengths))``, where the
        caller has them already. Raises
        `RemoteAccessError` (and counts one refused write in the owner's table) when a block is not inside
        a live registration; nothing stays pinned then.
        """
        if len(dsts) <= 4:
            return self._pin_few(list(dsts), list(lengths), None if keys is None else list(keys))
        d = np.asarray(dsts, dtype=np.uint64)
        ln = np.asarray(lengths, dtype=np.uint64)
        karr = None if keys is None else np.asarray(keys, dtype=np.uint64)
        lo, hi = span if span is not None else (int(d.min()), int((d + ln).max()))
        shortest, total = sizes if sizes is not None else (int(ln.min()), int(ln.sum()))
        if shortest == 0:
            self._refuse(lo, 0, False)
        hit = None
        for attempt in (0, 1):
            # the common case: every block inside one registration (a request's blocks in one KV tensor)
            r = bisect.bisect_right(self._l_starts, lo) - 1
            if r >= 0 and hi <= self._l_rows[r][2] and (karr is None or self._keys_ok(karr, self._l_rows[r][3])):
                distinct = [r]
            else:
                rows, hit = self._find(d, d + ln, karr)
                distinct = np.flatnonzero(np.bincount(rows, minlength=len(self._l_rows))).tolist() \
                    if hit.all() else None
            if distinct is not None:
                slots, ok = self._pin_rows(distinct)
                if ok:
                    return Pins(self, slots, len(d), total, self._keys_of(distinct))
                Pins(self, slots, 0, 0).release(landed=False)
            if attempt == 0:
                self._rebuild()  # a registration came or went since the snapshot: look again
        j = int(np.flatnonzero(~hit)[0]) if hit is not None and not hit.all() else 0
        self._refuse(int(d[j]), int(ln[j]), karr is not None and bool(karr[j]))

    @staticmethod
    def _keys_ok(karr: np.ndarray, key: int) -> bool:
        lo, hi = int(karr.min()), int(karr.max())
        return (lo == hi == key) or bool(((karr == key) | (karr == 0)).all())

    def _pin_few(self, dsts: list[int], lengths: list[int], keys: list[int] | None) -> Pins:
        """`pin` for a handful of blocks, without numpy."""
        for attempt in (0, 1):
            rows = []
            for i, (dst, n) in enumerate(zip(dsts, lengths)):
                r = bisect.bisect_right(self._l_starts, dst) - 1
                if r < 0 or n <= 0:
                    break
                _, _, stop, key = self._l_rows[r]
                if dst + n > stop or (keys is not None and keys[i] and keys[i] != key):
                    break
                rows.append(r)
            if len(rows) == len(dsts):
                distinct = rows if len(rows) == 1 else sorted(set(rows))
                slots, ok = self._pin_rows(distinct)
                if ok:
                    return Pins(self, slots, len(dsts), sum(lengths), self._keys_of(distinct))
                Pins(self, slots, 0, 0).release(landed=False)
            if attempt == 0:
                self._rebuild()
        i = len(rows) if len(rows) < len(dsts) else 0
        self._refuse(dsts[i], lengths[i], keys is not None and bool(keys[i]))

    def key_at(self, dst: int) -> int | None:
        """The key of the live registration holding `dst`, or None (from the snapshot, refreshed on a miss)."""
        for attempt in (0, 1):
            r = bisect.bisect_right(self._l_starts, dst) - 1
            if r >= 0:
                slot, addr, stop, key = self._l_rows[r]
                if dst < stop and self._live(slot, addr, stop, key):
                    return key
            if attempt == 0:
                self._rebuild()
        return None

    def _refuse(self, dst: int, length: int, keyed: bool) -> None:
        self._add8(self._base + _OFF_REFUSED, 1, _SEQ_CST)
        under = " under that key" if keyed else ""
        raise RemoteAccessError(f"pid {self.pid} refused the write of {length} bytes to 0x{dst:x}: not inside "
                                f"memory it registered{under}")

    def close(self) -> None:
        """Unmap the table. Idempotent."""
        m, self._map = getattr(self, "_map", None), None
        self._slots = self._used = self._raw = self._c_starts = self._c_stops = self._c_keys = None  # the views go first: mmap refuses to close under them
        if m is not None:
            m.close()
