"""Strided writes (`batch_transfer_sync_write_strided`): every piece lands where its stride puts it and the gaps stay
untouched, on shm and tcp, into managed and external memory; the owner checks each entry's whole extent; a
malformed entry or an unregistered source is refused before anything moves (two processes)."""
from __future__ import annotations

import numpy as np
import pytest

from epd_lab.transfer import RegistrationError, RemoteAccessError
from epd_lab.transfer.engine import strided_pieces

PIECE, COUNT, DST_STRIDE = 256, 64, 512


def _expected(writer, src_stride: int, nbytes: int, entries: list[tuple[int, int]]) -> bytes:
    """The peer region after the entries (src offset, dst offset) of COUNT pieces each; zeros elsewhere."""
    out = np.zeros(nbytes, dtype=np.uint8)
    for src_off, dst_off in entries:
        for k in range(COUNT):
            s, d = src_off + k * src_stride, dst_off + k * DST_STRIDE
            out[d:d + PIECE] = writer.src[s:s + PIECE]
    return out.tobytes()


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "external"])
@pytest.mark.parametrize("src_stride", [PIECE, 3 * PIECE], ids=["source-contiguous", "source-strided"])
def test_every_piece_lands_at_its_stride_and_the_gaps_stay(peer, writer, managed, src_stride):
    nbytes = 2 * COUNT * DST_STRIDE
    dst = peer.alloc(nbytes, managed=managed)
    base = writer.src.ctypes.data
    entries = [(0, 0), (COUNT * src_stride, PIECE), (7, COUNT * DST_STRIDE + 64)]  # interleaved; odd alignment
    writer.batch_transfer_sync_write_strided(
        peer.session_id, [base + s for s, _ in entries], [dst + d for _, d in entries], [PIECE] * 3, [COUNT] * 3,
        [src_stride] * 3, [DST_STRIDE] * 3)
    assert peer.read(dst, nbytes) == _expected(writer, src_stride, nbytes, entries)
    s = peer.stats()
    assert (s["writes_in"], s["bytes_in"], s["writes_refused"]) == (3, 3 * COUNT * PIECE, 0)
    assert writer.stats()["bytes_out"] == 3 * COUNT * PIECE


def test_the_pieces_of_a_path_without_strided_writes_place_the_same_bytes(peer, writer):
    nbytes = COUNT * DST_STRIDE
    strided, pieces = peer.alloc(nbytes), peer.alloc(nbytes)
    args = ([writer.src.ctypes.data], [PIECE], [COUNT], [3 * PIECE], [DST_STRIDE])
    writer.batch_transfer_sync_write_strided(peer.session_id, args[0], [strided], *args[1:])
    srcs, dsts, lengths, _ = strided_pieces(args[0], [pieces], *args[1:])
    assert len(srcs) == COUNT
    writer.batch_transfer_sync_write(peer.session_id, srcs, dsts, lengths)
    assert peer.read(strided, nbytes) == peer.read(pieces, nbytes) != bytes(nbytes)


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "external"])
def test_an_extent_past_the_registration_is_refused_and_nothing_lands(peer, writer, managed):
    """The last piece would end one byte past the region: the owner refuses the entry as a whole."""
    nbytes = (COUNT - 1) * DST_STRIDE + PIECE
    dst = peer.alloc(nbytes, managed=managed)
    with pytest.raises(RemoteAccessError, match="refused the strided write"):
        writer.batch_transfer_sync_write_strided(peer.session_id, [writer.src.ctypes.data], [dst + 1], [PIECE],
                                                 [COUNT], [PIECE], [DST_STRIDE])
    assert peer.read(dst, nbytes) == bytes(nbytes)
    assert peer.stats()["writes_refused"] == 1
    # the connection and the peer stay usable
    writer.batch_transfer_sync_write_strided(peer.session_id, [writer.src.ctypes.data], [dst], [PIECE], [COUNT],
                                             [PIECE], [DST_STRIDE])
    assert peer.read(dst, PIECE) == writer.src[:PIECE].tobytes()


def test_malformed_entries_and_unregistered_sources_are_refused_before_anything_moves(peer, writer):
    dst = peer.alloc(COUNT * DST_STRIDE)
    src = writer.src.ctypes.data
    for lengths, counts, src_strides, dst_strides in (([PIECE], [COUNT], [PIECE], [PIECE - 1]),  # overlapping
                                                      ([PIECE], [0], [PIECE], [DST_STRIDE]),
                                                      ([0], [COUNT], [PIECE], [DST_STRIDE]),
                                                      ([PIECE], [COUNT], [PIECE - 1], [DST_STRIDE])):
        with pytest.raises(ValueError, match="strided write 0"):
            writer.batch_transfer_sync_write_strided(peer.session_id, [src], [dst], lengths, counts, src_strides,
                                                     dst_strides)
    with pytest.raises(RegistrationError, match="source .* of strided write 0 is not inside memory registered"):
        writer.batch_transfer_sync_write_strided(peer.session_id, [src + len(writer.src) - PIECE], [dst], [PIECE],
                                                 [2], [PIECE], [DST_STRIDE])
    assert peer.read(dst, COUNT * DST_STRIDE) == bytes(COUNT * DST_STRIDE)
    assert peer.stats()["writes_in"] == 0
