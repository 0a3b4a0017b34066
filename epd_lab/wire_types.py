"""Field types that the wire messages of every layer share (msgspec constraints, checked on decode), and the
transfer engine's frame headers as `struct`s for what speaks that wire raw (the fuzz leg, the tests).

Imports msgspec only: the torch-free proxy decodes `servers.messages` with them, and `ep.messages` (which
imports torch) and `kv.messages` use the same ones.
"""
from __future__ import annotations

import struct
from typing import Annotated

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
# a media item (path, data: URI, URL) never holds a NUL: no file name, URI or URL can, and the OS refuses it with
# an error the media readers do not expect (a 500 the fuzz leg found: "embedded null byte")
MediaItem = Annotated[str, msgspec.Meta(pattern="^[^\x00]*$")]

# native/epd_core.h: epd_wire_req {u32 magic, u16 version, u16 op, u64 seq, addr, length, key}; epd_wire_rep
# {u32 magic, i32 status, u64 seq, length}. The magic, version, ops and statuses come from the header through
# `epd_lab._native`, and tests/test_fuzz.py holds these sizes to the compiler's.
WIRE_REQ = struct.Struct("<IHHQQQQ")
WIRE_REP = struct.Struct("<IiQQ")
