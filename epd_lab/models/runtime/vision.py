"""`VisionTower`: Qwen2-VL's vision tower written from the architecture, batched across images in calls of a fixed
number of patch rows, each call replayed from a CUDA graph (the fast runtime's encoder on a GPU).

Why a fixed row count (the budget): a GEMM computes a row the same way whatever the other rows hold, but the
kernel a library picks, and so the order of its sums, may change with the row count. With every call `budget`
rows tall, an image meets the same kernels however the images are grouped into requests and parts, so the split
equals the monolithic use bit for bit while the tower still runs many images per call. Images are packed in
order (`budget_calls`); the rows left over are a padding image of zeros, which goes through the GEMMs (their
shape is the point) but not through attention (block-diagonal: one attention call per real image; the padding's
attention output is zeros), and whose output is dropped. An image larger than the budget is a call of its own
size.

Kernels (`kernels.open_ops`): on a GPU the rotary is one Triton kernel that also lays q, k and v out for attention,
and QuickGELU another, where torch ran ~25 small ops a block (float32 casts, rotate_half, copies); the patch
embedding (a Conv3d whose kernel is its stride) is one GEMM. On an H200 one 448² image went from 1,106 kernels and
12.2 ms of GPU time to 530 and 7.0 at the same budget (`data/bench/runtime-h200-2b-vision-budget-full.json`). On the CPU the
same forward runs HF's torch ops.

Why graphs: HF's eager tower launches ~1,100 kernels for one image, and on an H200 their host overhead is three
times the GPU's work. A call's shapes are fixed by the budget and by how its rows split into images (the key),
so each key is captured once, on first use, into one shared memory pool (thread-local capture: a role's other
threads may use the GPU meanwhile); positions and rotary angles are made on the host, outside the graph, and
copied in.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from transformers.activations import QuickGELUActivation

from epd_lab.models.runtime.graph import capture
from epd_lab.models.runtime.kernels import open_ops
from epd_lab.models.runtime.tp import TPGroup, check_heads, input_columns, output_rows

MAX_GRAPHS = 16  # captured call shapes kept (least recently used dropped first)

Linear = tuple[torch.Tensor, torch.Tensor | None]  # (weight, bias) of one linear layer, or a rank's share of it


class _Block(NamedTuple):
    """A vision block's linear layers as this rank holds them: qkv and fc1 column-parallel, proj and fc2
    row-parallel (under TP their biases are added once, after the all-reduce)."""

    qkv: Linear
    proj: Linear
    fc1: Linear
    fc2: Linear


def _linear_tp(x: torch.Tensor, layer: Linear, tp: TPGroup) -> torch.Tensor:
    """A row-parallel layer: the rank's partial product, all-reduced, then the bias; at TP 1 the one GEMM with
    its bias (nn.Linear's bits)."""
    weight, bias = layer
    if tp.size == 1:
        return F.linear(x, weight, bias)
    out = tp.all_reduce(F.linear(x, weight))
    return out if bias is None else out + bias


def budget_calls(patches: list[int], budget: int) -> list[list[int]]:
    """Images (by their patch counts, in order) packed into calls of at most `budget` patch rows: an image joins
    the current call while it fits, else opens the next; an image larger than the budget is a call alone."""
    calls: list[list[int]] = []
    used = budget  # no open call yet
    for i, n in enumerate(patches):
        if used + n > budget:
            calls.append([])
            used = 0
        calls[-1].append(i)
        used += n
    return calls


class VisionTower:
    """The tower of a loaded Qwen2-VL (its weights, not its forward), in budgeted calls; see the module docstring.

    Args:
        tower: ``model.model.visual``.
        budget: patch rows per call; a positive multiple of merge² (4).
        cuda_graphs: replay each call shape from a CUDA graph (a GPU only; False: the same calls eagerly).
        tp: this rank's place in a tensor-parallel group (`runtime.tp`): it keeps its heads' and MLP share's
            weights and all-reduces after proj and fc2. None: the whole tower.
    """

    def __init__(self, tower: torch.nn.Module, budget: int, cuda_graphs: bool = True,
                 tp: TPGroup | None = None) -> None:
        self.tower = tower
        self.merge = tower.spatial_merge_size
        unit = self.merge * self.merge
        if budget < unit or budget % unit:
            raise ValueError(f"the vision budget must be a positive multiple of {unit} patch rows, got {budget}")
        self.budget = budget
        first = tower.blocks[0]
        self.tp = tp = tp or TPGroup(0, 1)
        check_heads(first.attn.num_heads, None, tp.size, "the vision tower")
        start, stop = tp.head_range(first.attn.num_heads)
        self.num_heads = stop - start
        self.blocks = [self._share(block, start, stop) for block in tower.blocks]
        self.device = first.attn.qkv.weight.device
        self.dtype = first.attn.qkv.weight.dtype
        self.inv_freq = tower.rotary_pos_emb.inv_freq.to(self.device, torch.float32)
        self.patch_dim = tower.patch_embed.proj.weight[0].numel()  # channels x temporal x patch x patch
        self.ops = open_ops(self.device)
        # the fused QuickGELU where the tower uses it (every published Qwen2-VL shape), else the tower's own
        self.act = self.ops.quick_gelu if isinstance(first.mlp.act, QuickGELUActivation) else first.mlp.act
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._graphs: OrderedDict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = OrderedDict()
        self._pool = None
        self._pixels: torch.Tensor | None = None  # static inputs of the graphs: [rows, patch_dim]
        self._angles: torch.Tensor | None = None  # [rows, head_dim / 2]

    def _share(self, block: torch.nn.Module, start: int, stop: int) -> _Block:
        """The linear layers of `block` this rank keeps: heads ``[start, stop)``, the same share of the MLP."""
        qkv, proj, fc1, fc2 = block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2
        if self.tp.size == 1:
            return _Block(*((m.weight, m.bias) for m in (qkv, proj, fc1, fc2)))
        dim = proj.weight.shape[0]
        head_dim = dim // block.attn.num_heads
        a, b = start * head_dim, stop * head_dim
        parts = [output_rows(qkv.weight, qkv.bias, j * dim + a, j * dim + b) for j in range(3)]  # its q, k, v rows
        share = fc1.weight.shape[0] // self.tp.size
        m0, m1 = self.tp.rank * share, (self.tp.rank + 1) * share
        return _Block((torch.cat([w for w, _ in parts]), torch.cat([c for _, c in parts])),
                      (input_columns(proj.weight, a, b), proj.bias), output_rows(fc1.weight, fc1.bias, m0, m1),
                      (input_columns(fc2.weight, m0, m1), fc2.bias))

    # ---- host side ----
    def _positions(self, grid: Sequence[int]) -> np.ndarray:
        """(h, w) patch coordinates [t*h*w, 2] of one image, block-major over merge x merge blocks (HF's order)."""
        t, h, w = grid
        m = self.merge
        hpos = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
        wpos = np.broadcast_to(np.arange(w)[None, :], (h, w)).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
        return np.tile(np.stack([hpos.reshape(-1), wpos.reshape(-1)], axis=-1), (t, 1))

    def _angles_of(self, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Rotary angles [rows, head_dim / 2]: the h frequencies, then the w ones (HF's recomposition)."""
        positions = torch.from_numpy(np.concatenate([self._positions(g) for g in grids])).to(self.device)
        return (positions[..., None].float() * self.inv_freq).flatten(1)

    # ---- the forward ----
    def _forward(self, pixels: torch.Tensor, angles: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """The tower over `pixels` [rows, patch_dim] whose first rows split into images of `lengths` (the rest:
        padding, which attends to nothing: its rows' attention output is zeros); no host sync."""
        tower, ops = self.tower, self.ops
        proj = tower.patch_embed.proj  # a Conv3d whose kernel is its stride: a GEMM over flattened patches
        x = F.linear(pixels, proj.weight.view(proj.out_channels, -1), proj.bias)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        rows = x.shape[0]
        pad = rows - sum(lengths)
        sizes = [*lengths, pad] if pad else list(lengths)
        real = len(lengths)  # the padding's share of each split is left out
        for block, share in zip(tower.blocks, self.blocks):
            q, k, v = ops.vision_rope(F.linear(block.norm1(x), *share.qkv), cos, sin, self.num_heads)  # [H, rows, D]
            outs = [F.scaled_dot_product_attention(qi[None], ki[None], vi[None]) for qi, ki, vi in zip(
                q.split(sizes, dim=1)[:real], k.split(sizes, dim=1)[:real], v.split(sizes, dim=1)[:real])]
            if pad:
                outs.append(q.new_zeros(1, self.num_heads, pad, q.shape[-1]))
            out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
            x = x + _linear_tp(out[0].transpose(0, 1).reshape(rows, -1), share.proj, self.tp)
            x = x + _linear_tp(self.act(F.linear(block.norm2(x), *share.fc1)), share.fc2, self.tp)
        return tower.merger(x)

    def _call(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """One call of `budget` rows (or one image's own size); the merged rows of its real images."""
        lengths = [t * h * w for t, h, w in grids]
        rows = sum(lengths)
        pad = max(self.budget, rows) - rows
        key = (*lengths, pad)  # the padding image comes last, with its own rotary positions (never attended)
        angles = self._angles_of(grids + [[1, self.merge, pad // self.merge]] if pad else grids)
        unit = self.merge * self.merge
        if not self.cuda_graphs:
            full = torch.cat([pixels, pixels.new_zeros(pad, pixels.shape[1])]) if pad else pixels
            return self._forward(full.to(self.dtype), angles, tuple(lengths))[:rows // unit]
        graph, out = self._graph(key)
        total = rows + pad
        self._pixels[:rows].copy_(pixels)
        self._pixels[rows:total].zero_()
        self._angles[:total].copy_(angles)
        graph.replay()
        return out[:rows // unit].clone()

    def _graph(self, key: tuple[int, ...]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of a call shape, captured on first use."""
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return self._graphs[key]
        lengths, total = key[:-1], sum(key)
        if self._pixels is None or self._pixels.shape[0] < total:
            if self._graphs:  # the static inputs move: every graph captured on the old ones goes
                self._graphs.clear()
            self._pixels = torch.zeros(total, self.patch_dim, dtype=self.dtype, device=self.device)
            self._angles = torch.zeros(total, self.inv_freq.numel() * 2, device=self.device)
        pixels, angles = self._pixels[:total], self._angles[:total]
        graph, out = capture(lambda: self._forward(pixels, angles, lengths), self.device, self._pool)
        self._pool = graph.pool()
        self._graphs[key] = (graph, out)
        if len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return graph, out

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged embeddings [tokens, hidden] of every image, in order, on the tower's device."""
        grids = image_grid_thw.tolist()
        patches = [t * h * w for t, h, w in grids]
        if sum(patches) != pixel_values.shape[0]:
            raise ValueError(f"grid_thw names {sum(patches)} patches, pixel_values has {pixel_values.shape[0]}")
        pixels = pixel_values.to(self.device, non_blocking=True).to(self.dtype)  # cast where it is cheap
        starts = np.concatenate([[0], np.cumsum(patches)]).tolist()
        return torch.cat([self._call(pixels[starts[c[0]]:starts[c[-1] + 1]], [grids[i] for i in c])
                          for c in budget_calls(patches, self.budget)])
