"""Pointers and sizes of tensors and arrays, and views over raw registered memory."""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


def buffer_info(obj: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous torch tensor (host or CUDA memory: the engine registers either),
    numpy array or writable buffer."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor, without importing torch
        if obj.device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor on {obj.device}: only host and CUDA memory can be registered")
        if not obj.is_contiguous():
            raise ValueError("tensor is not contiguous; call .contiguous() first")
        return obj.data_ptr(), obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("array is not C-contiguous; use np.ascontiguousarray first")
        return obj.ctypes.data, obj.nbytes
    view = memoryview(obj)
    if not view.contiguous:
        raise ValueError("buffer is not contiguous")
    arr = np.frombuffer(view, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def as_array(ptr: int, nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
    """A numpy view of `nbytes` at `ptr` (e.g. of a managed buffer). The view does not own the memory:
    keep the engine (and the buffer) alive while it is used."""
    dtype = np.dtype(dtype)
    if nbytes % dtype.itemsize:
        raise ValueError(f"{nbytes} bytes is not a whole number of {dtype}")
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype)
