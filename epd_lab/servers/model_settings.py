"""A model role's settings: where and how its model runs, the ``--model``, ``--device``, ``--dtype`` and ``--runtime``
options every model role shares (`ModelSettings`, the base of their settings), and the paged KV cache's ``--kv-blocks`` and
``--block-size`` that prefill, decode and the monolithic floor add (`PagedKVSettings`), and the ``--transport``
of the roles that open a transfer engine (`transport_option`).

A role on ``cuda[:N]`` keeps its model and what it computes on that GPU: the encoder its embeddings (and its
embedding cache), prefill and decode their paged KV cache, registered with the transfer engine, which then
moves them GPU to GPU (`epd_lab.transfer.cuda`). ``--dtype auto`` is bfloat16 on CUDA and float32 on the CPU.
A role makes its device current with `epd_lab.models.catalog.use_device`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from epd_lab.models import DEFAULT_MODEL_DIR, DTYPE_NAMES, resolve_dtype
from epd_lab.models.catalog import DEVICE_NAME
from epd_lab.models.runtime import RUNTIMES
from epd_lab.serving.settings import ServerSettings, check_at_least, check_choice, option
from epd_lab.transfer.registry import ENGINES, transports

__all__ = ["DEVICE_HELP", "DTYPE_HELP", "DTYPE_NAMES", "MODEL_HELP", "RUNTIME_HELP", "RUNTIME_NAMES", "ModelSettings",
           "PagedKVSettings", "check_placement", "check_transport", "transport_option"]

MODEL_HELP = "a local model directory, or a model shape: tiny, qwen2-vl-2b, qwen2-vl-7b (default: tiny)"
DEVICE_HELP = "cpu, cuda or cuda:N: where the model runs and the role's embeddings or KV cache live"
DTYPE_HELP = "the model's dtype; auto: bfloat16 on CUDA, float32 on the CPU"
RUNTIME_NAMES = tuple(RUNTIMES)
RUNTIME_HELP = ("the model runtime: fast (its own forward over the paged KV cache; CUDA graphs and Triton kernels on "
                "a GPU; HF's bits on the CPU) or hf (HF transformers eager, the KV copied in and out of its cache)")


def transport_option(engines: str) -> Any:
    """The ``--transport`` field of the roles that open transfer engines (encoder, prefill, decode; the launcher's
    `Topology` for all of them): one default (``auto``) and one set of choices (`ENGINES`). `engines` ends the
    help: which engines the role opens, since one text cannot serve every role (the encoder's engine works only
    on the mooncake backend, the prefill opens two, decode one)."""
    return option("auto", f"the transfer engine's protocol ({engines})", choices=ENGINES)


def check_transport(settings: Any) -> None:
    """In the ``__post_init__`` of a role with `transport_option`: `ValueError` unless ``transport`` is registered
    (the command line's check, for Python callers; one registered after import counts too)."""
    check_choice(settings, "transport", transports())


def check_placement(settings: Any) -> None:
    """In a settings dataclass's ``__post_init__``: refuse a malformed ``device`` and turn ``dtype`` "auto"
    into the dtype it means there (so that messages and logs name the real one). Whether the device exists is
    checked where the role starts (`epd_lab.models.resolve_device`)."""
    if not DEVICE_NAME.fullmatch(settings.device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {settings.device!r}")
    object.__setattr__(settings, "dtype", resolve_dtype(settings.dtype, settings.device))


@dataclasses.dataclass(slots=True, frozen=True, kw_only=True)
class ModelSettings(ServerSettings):
    """What a model role (encoder, prefill, decode, monolithic) is started with beyond its address: its model and
    where and how it runs (`check_placement`)."""

    model: str | None = option(None, MODEL_HELP)
    device: str = option("cpu", DEVICE_HELP)
    dtype: str = option("auto", DTYPE_HELP, choices=DTYPE_NAMES)
    runtime: str = option("fast", RUNTIME_HELP, choices=RUNTIME_NAMES)

    def __post_init__(self) -> None:
        ServerSettings.__post_init__(self)
        check_placement(self)

    @property
    def model_name(self) -> str:
        """The model's name as the role reports it (/health; the encoder's cache key): ``--model`` as given, or
        the tiny model's."""
        return self.model or DEFAULT_MODEL_DIR.name


@dataclasses.dataclass(slots=True, frozen=True, kw_only=True)
class PagedKVSettings(ModelSettings):
    """A model role with a paged KV cache (prefill, decode, monolithic): its size."""

    kv_blocks: int = option(512, "blocks in the paged KV cache")
    block_size: int = option(16, "tokens per KV block")

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        check_at_least(self, 1, "kv_blocks", "block_size")

