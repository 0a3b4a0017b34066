"""Which kernels a device runs: `open_ops`. Its own module so that `ops` (the torch forms) and `triton_ops` (the
fused forms, built on them) import one way only."""
from __future__ import annotations

import torch

from epd_lab.models.runtime.ops import TorchOps


def open_ops(device: torch.device) -> type[TorchOps]:
    """The kernels for `device`: Triton's fused ones on CUDA, torch ops elsewhere."""
    if device.type == "cuda":
        from epd_lab.models.runtime.triton_ops import TritonOps
        return TritonOps
    return TorchOps
