"""Which model a role runs, on which device, in which dtype: ``--model``, ``--device``, ``--dtype`` resolved.

`open_model` is the one call every role (encoder, prefill, decode) makes to get its model: the tiny model
(`models.tiny`), a Qwen2-VL at a published size with seeded random weights (`models.shapes`), or real weights
from a local directory, placed on the device asked. Whatever the source, the model comes back in the form the
bit-identity of the EPD split relies on: vision tower image-invariant (`models.vision`), the attention
implementation `tiny.ATTN_IMPLEMENTATION`, EOS off for the random-weight ones (so generation never stops early);
the rest of those preconditions are in docs/protocols.md, "What bit-identity rests on".
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from transformers import Qwen2VLForConditionalGeneration

from epd_lab.models import shapes
from epd_lab.models.tiny import ATTN_IMPLEMENTATION, load_model
from epd_lab.models.vision import make_image_invariant

__all__ = ["DEVICE_NAME", "DTYPE_NAMES", "MODEL_SHAPES", "model_device", "open_model", "resolve_device", "resolve_dtype",
           "synchronize", "use_device"]

DTYPE_NAMES = ("auto", "float32", "bfloat16")
# The names `open_model` takes besides a directory (for a CLI's help); a name wins over a directory of that name.
MODEL_SHAPES = ("tiny", *shapes.SHAPES)
DEVICE_NAME = re.compile(r"cpu|cuda(?::(\d+))?")  # what --device takes (group 1: the GPU's index)


def resolve_dtype(name: str, device: str | torch.device) -> str:
    """The dtype name ``--dtype name`` means on `device`: "auto" is "bfloat16" on a CUDA device and "float32"
    on the CPU; "float32" and "bfloat16" are returned as they are. Raises ValueError naming the choices.

    `device` is only looked at for its type (a string is not parsed further), so this runs before the device
    is resolved or checked, and never touches CUDA.
    """
    if name == "auto":
        return "bfloat16" if str(device).split(":", 1)[0] == "cuda" else "float32"
    if name in DTYPE_NAMES:
        return name
    raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")


def resolve_device(name: str) -> torch.device:
    """The torch device ``--device name`` names: "cpu", "cuda" (the current CUDA device, ``cuda:0`` unless the
    process set another) or "cuda:N". Raises ValueError for a malformed name, when CUDA is asked and no CUDA
    device is visible, and for N past the visible devices. "cpu" never touches CUDA; "cuda" initialises CUDA
    only where this process already has (to read its current device)."""
    match = DEVICE_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N (N a device index)")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is visible to this process "
                         "(torch.cuda.is_available() is False); use --device cpu")
    count = torch.cuda.device_count()
    if match.group(1) is None:
        # Before CUDA is initialised the current device is 0; reading it through current_device() would
        # initialise CUDA, which a parent process that forks roles must not do.
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    index = int(match.group(1))
    if index >= count:
        raise ValueError(f"--device {name}: this process sees {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1} (CUDA_VISIBLE_DEVICES renumbers them)")
    return torch.device("cuda", index)


def use_device(name: str) -> torch.device:
    """Where a role starts: the device ``--device name`` names (`resolve_device`: a GPU that is not there is a
    ValueError with the reason), made this process's current CUDA device, so that what runs without naming
    one (the transfer engine's CUDA calls, ``torch.cuda.synchronize()``) runs on the role's GPU."""
    device = resolve_device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a span ends when the work did (kernels run asynchronously);
    nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device the model's parameters are on (all of them, for every model `open_model` returns)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        raise ValueError(f"{type(model).__name__} has no parameters, hence no device") from None


def open_model(model: str | os.PathLike[str] | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """The model a role runs, in `dtype`, on `device`, in eval mode.

    - None or "tiny": the saved tiny model (`tiny.load_model(None, dtype)`: every process loads the same
      saved bytes, built on first use), moved to `device`.
    - a name in `shapes.SHAPES` ("qwen2-vl-2b", "qwen2-vl-7b"): that architecture with random weights drawn
      from `seed`, every tensor allocated on `device` in `dtype` from the start (`shapes.build_shape_model`),
      then made image-invariant and set to `tiny.ATTN_IMPLEMENTATION` as `load_model` does. On the CPU this is
      allowed but slow, and needs the memory: 7B in float32 is ~33 GB (2B ~9 GB); the tests use small shapes.
    - anything else: a local model directory (real weights), `load_model(path, dtype)` on the CPU and then
      ``.to(device)``. Not straight onto the device: `from_pretrained(device_map=...)` needs `accelerate` in
      the pinned transformers (5.x), which this project does not depend on; the CPU copy is freed after.

    A shape name is looked up before the file system: a directory called "qwen2-vl-2b" is "./qwen2-vl-2b".
    `device` is "cpu", "cuda" or "cuda:N" (checked by `resolve_device`), or a torch.device; other device types
    are taken as they are (``torch.device("meta")`` builds a shape without memory, e.g. to count parameters).
    `seed` only chooses a shape's weights: the tiny model is the saved seed-0 one and a directory has its own,
    so a non-zero seed there raises ValueError rather than being ignored.
    """
    target = _as_device(device)
    name = os.fspath(model) if model is not None else "tiny"
    if name in shapes.SHAPES:  # looked up now, not in MODEL_SHAPES: tests register small shapes
        built = shapes.build_shape_model(name, target, dtype=dtype, seed=seed)
        built.set_attn_implementation(ATTN_IMPLEMENTATION)  # explicit: every process must run the same kernels
        return make_image_invariant(built)
    if seed != 0:
        raise ValueError(f"seed={seed} only applies to a model shape ({', '.join(shapes.SHAPES)}); "
                         f"{name!r} has fixed weights")
    if name == "tiny":
        return load_model(None, dtype).to(target)
    path = Path(name)
    if not path.is_dir():
        raise ValueError(f"--model {name!r}: not a model shape ({', '.join(MODEL_SHAPES)}) "
                         "and not a local directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name!r}: the directory has no config.json (expected a saved Qwen2-VL, "
                         "as save_pretrained writes it)")
    return load_model(path, dtype).to(target)


def _as_device(device: str | torch.device) -> torch.device:
    # cpu/cuda go through resolve_device (its checks; a bare "cuda" gets its index, so that model_device compares
    # equal to the device asked); "meta" passes as it is, as does any torch.device of another type.
    if isinstance(device, torch.device):
        if device.type not in ("cpu", "cuda"):
            return device
        device = "cpu" if device.type == "cpu" else ("cuda" if device.index is None else f"cuda:{device.index}")
    elif device == "meta":
        return torch.device("meta")
    return resolve_device(device)
