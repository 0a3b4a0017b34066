"""Tensor parallelism for the fast runtime: a role's model split over `tp_size` rank processes, as vLLM and SGLang
split it.

    with tp_group(rank, size, init_method) as tp:          # torch.distributed: gloo on the CPU, NCCL on GPUs
        runtime = open_runtime("fast", model, cache, tp=tp)  # cache: PagedKVCache of tp.kv_heads(config) heads

How the weights split (Megatron's scheme, which vLLM's `QKVParallelLinear` / `RowParallelLinear` follow):
- attention: Q, K and V column-parallel by heads (rank r holds query heads ``[r H/tp, (r+1) H/tp)``); o_proj
  row-parallel (the same heads' input columns), its partial sums added by an all-reduce;
- KV heads: split as the query heads while ``tp_size <= num_kv_heads``; past that each KV head is replicated on
  ``tp_size / num_kv_heads`` consecutive ranks (rank r holds KV head ``r // (tp_size / num_kv_heads)``), as vLLM
  replicates them, so every rank's query heads find their KV head locally;
- MLP: gate and up column-parallel, down row-parallel with an all-reduce;
- the embedding, the norms and the LM head replicated: every rank ends with the full logits, bit-identical
  across ranks (they come out of the same all-reduced hidden state), so every rank draws the same token without
  a broadcast. A vocab-parallel head would save memory at 7B's 152k vocabulary; here it would add an all-gather a
  step for nothing the workbench measures;
- the vision tower the same way (qkv column-parallel by heads, proj row-parallel, fc1 column- and fc2
  row-parallel), its biases of row-parallel layers added once after the all-reduce; patch embedding and merger
  replicated.

Every rank loads the whole model and keeps views (slices) of its share: simple, and memory-heavy on a GPU (say so
when sizing). Bits: a TP group's answers are deterministic and the split equals the monolithic use at the same
TP bit for bit; against TP 1 they differ by the all-reduce's summation order (tests state the bound).
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from epd_lab.kv.tp_plan import kv_head_range


@dataclass(frozen=True)
class TPGroup:
    """One rank's place in a tensor-parallel group: `rank` of `size`, and the torch.distributed group its
    all-reduces run on (None for size 1: no collectives)."""

    rank: int
    size: int
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"a TP rank must lie in [0, tp_size), got rank {self.rank} of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a TP group of more than one rank needs a process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group's ranks, in place (the identity at size 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def head_range(self, num_heads: int) -> tuple[int, int]:
        """This rank's query (or vision) heads ``[start, stop)``; `num_heads` must divide by the size."""
        check_heads(num_heads, None, self.size)
        per = num_heads // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads ``[start, stop)``: a share of them, or the one it replicates."""
        return kv_head_range(num_kv_heads, self.size, self.rank)


def check_heads(num_heads: int, num_kv_heads: int | None, tp_size: int, what: str = "the model") -> None:
    """Raise ValueError, naming the sizes and the valid choices, unless `tp_size` divides `num_heads` and either
    divides or is a multiple of `num_kv_heads` (the layouts vLLM accepts)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    valid = [n for n in range(1, num_heads + 1) if num_heads % n == 0 and (
        num_kv_heads is None or num_kv_heads % n == 0 or n % num_kv_heads == 0)]
    if tp_size not in valid:
        kv = "" if num_kv_heads is None else f" and {num_kv_heads} KV heads"
        raise ValueError(f"tp_size {tp_size} does not split {what}'s {num_heads} attention heads{kv}; "
                         f"choose one of {valid}")


def text_heads(config: Any) -> tuple[int, int, int]:
    """(attention heads, KV heads, head_dim) of a Qwen2-VL config or its text config."""
    text = getattr(config, "text_config", config)
    heads = text.num_attention_heads
    return heads, text.num_key_value_heads, getattr(text, "head_dim", None) or text.hidden_size // heads


def check_model(config: Any, tp_size: int) -> None:
    """Raise ValueError at start when `tp_size` cannot split a Qwen2-VL's text or vision attention."""
    heads, kv_heads, _ = text_heads(config)
    check_heads(heads, kv_heads, tp_size, "the language model")
    text = getattr(config, "text_config", config)
    widths = [("the language model's MLP", text.intermediate_size)]
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        check_heads(vision.num_heads, None, tp_size, "the vision tower")
        widths.append(("the vision tower's MLP", int(vision.embed_dim * vision.mlp_ratio)))
    for what, width in widths:
        if width % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide {what}'s {width} columns")


def output_rows(weight: torch.Tensor, bias: torch.Tensor | None, start: int, stop: int,
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output rows ``[start, stop)`` of a linear layer (a column-parallel share): views, no copy."""
    return weight[start:stop], None if bias is None else bias[start:stop]


def input_columns(weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Input columns ``[start, stop)`` of a linear layer's weight (a row-parallel share), contiguous."""
    return weight[:, start:stop].contiguous()


def rendezvous() -> str:
    """A fresh rendezvous for one group: a file named by a uuid (no port to pick, nothing to collide)."""
    return (Path(tempfile.gettempdir()) / f"epd-tp-{uuid.uuid4().hex}").as_uri()


@contextlib.contextmanager
def tp_group(rank: int, size: int, init_method: str, backend: str | None = None,
             timeout_s: float = 60.0) -> Iterator[TPGroup]:
    """This process as rank `rank` of a `size`-rank group that meets at `init_method` (`rendezvous()`'s file, or
    ``tcp://host:port`` across hosts); gloo on the CPU, NCCL when `backend` says so. Gloo's own sockets stay on
    loopback unless ``GLOO_SOCKET_IFNAME`` names another interface. The group is torn down on exit. `timeout_s`
    bounds the rendezvous and every collective: a dead rank fails the others' next collective within it instead
    of hanging them."""
    if size == 1:
        yield TPGroup(0, 1)
        return
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend or "gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield TPGroup(rank, size, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
        if init_method.startswith("file://") and rank == 0:
            Path(init_method[len("file://"):]).unlink(missing_ok=True)


def _rank_main(fn: Callable[..., Any], rank: int, size: int, init_method: str, out: Any, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        with tp_group(rank, size, init_method) as tp:
            # by value: torch's queue would pass tensors as shared memory that dies with this process
            out.put((rank, True, pickle.dumps(fn(tp, *args))))
    except BaseException as exc:  # the parent raises it with the rank's traceback
        out.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Run ``fn(tp, *args)`` on each rank of a fresh `size`-rank group, one spawned process a rank (gloo, one
    torch thread each), and return the ranks' results in rank order. `fn` and `args` must be picklable (a
    module-level function). A rank that raises, dies or runs past `timeout_s` raises RuntimeError here; every
    rank process is gone when this returns."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = rendezvous()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, size, init, out, args), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < size:
            try:
                rank, ok, value = out.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"TP rank {dead[0]} of {size} died (exit code {procs[dead[0]].exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"TP group of {size} ranks did not finish within {timeout_s:.0f} s")
                continue
            if not ok:  # a rank that died is the cause of its peers' failed collectives: name it first
                for p in procs:
                    p.join(timeout=max(0.0, min(2.0, deadline - time.monotonic())) / size)
                dead = [f"TP rank {r} of {size} died (exit code {p.exitcode}); " for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r != rank]
                raise RuntimeError(f"{''.join(dead)}TP rank {rank} of {size} failed: {value}")
            results[rank] = pickle.loads(value)  # our own child's result, over a local pipe
        return [results[r] for r in range(size)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
        if init.startswith("file://"):
            Path(init[len("file://"):]).unlink(missing_ok=True)
