"""`Registration`: what registering a buffer gives back, the same for every engine.

It lives in its own module so that each engine (ours in `epd_lab.transfer.engine`, Mooncake's
adapter in `epd_lab.transfer.mooncake`) can return it without importing the other (when it lived in
`engine`, `engine` imported `mooncake`, which imported `Registration` from `engine`: an import cycle).
"""
from __future__ import annotations

from typing import NamedTuple


class Registration(NamedTuple):
    """What `register_buffer` registered: the address, the size and the registration's key (0 from
    an engine without per-registration keys, as Mooncake's)."""

    ptr: int
    nbytes: int
    key: int
