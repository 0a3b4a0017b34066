"""Field types that the wire messages of every layer share (msgspec constraints, checked on decode).

Imports msgspec only: the torch-free proxy decodes `servers.messages` with them, and `ep.messages` (which
imports torch) and `kv.messages` use the same ones.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
# a media item (path, data: URI, URL) never holds a NUL: no file name, URI or URL can, and the OS refuses it with
# an error the media readers do not expect (a 500 the fuzz leg found: "embedded null byte")
MediaItem = Annotated[str, msgspec.Meta(pattern="^[^\x00]*$")]
