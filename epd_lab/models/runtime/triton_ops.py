"""The runtime's fused kernels on CUDA, in Triton (imported only on a CUDA device: `kernels.open_ops`).

Four kernels replace the ~20 small torch ops of a decoder layer (norms in float32, residual adds, rotary, the
cache writes, the activation) so that a layer is 10 launches: add+RMSNorm, QKV GEMM, rotary+store, paged
attention (split, combine), O GEMM, add+RMSNorm, gate-up GEMM, SiLU*up, down GEMM. Two more serve the vision
tower (`runtime.vision`): its rotary, which also lays q, k and v out for attention (~20 float32 ops and copies
a block in torch), and its QuickGELU (three ops). Every kernel computes in float32 and rounds once into the
model's dtype. Each program's work depends only on its own row (or sequence), never on the batch
around it, so these kernels are batch-invariant; the GEMMs between them are cuBLAS's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from epd_lab.models.runtime.ops import TorchOps

DECODE_SPLITS = 16  # shares of a sequence attended in parallel: a lone sequence still fills 16 x KV-heads programs


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, eps, N,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype).to(tl.float32)  # the residual stream is kept in the model's dtype, as HF's add
        tl.store(r_out_ptr + row * N + cols, x.to(dtype), mask=mask)
    var = tl.sum(x * x, axis=0) / N
    y = (x * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (w * y).to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (s * u).to(dtype), mask=mask)


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, k_cache_ptr, v_cache_ptr,
                       H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)
    dtype = q_ptr.dtype.element_ty
    src = qkv_ptr + t * (H + 2 * HKV) * D + h * D
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    c1 = tl.load(cos_ptr + t * D + i).to(tl.float32)
    c2 = tl.load(cos_ptr + t * D + HALF + i).to(tl.float32)
    s1 = tl.load(sin_ptr + t * D + i).to(tl.float32)
    s2 = tl.load(sin_ptr + t * D + HALF + i).to(tl.float32)
    o1 = (x1 * c1 - x2 * s1).to(dtype)
    o2 = (x2 * c2 + x1 * s2).to(dtype)
    if h < H:
        dst = q_ptr + (t * H + h) * D
        tl.store(dst + i, o1)
        tl.store(dst + HALF + i, o2)
    else:
        kh = h - H
        dst = k_ptr + (t * HKV + kh) * D
        tl.store(dst + i, o1)
        tl.store(dst + HALF + i, o2)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:  # < 0: a padding row of a captured batch, nothing to keep
            cache = k_cache_ptr + (slot * HKV + kh) * D
            tl.store(cache + i, o1)
            tl.store(cache + HALF + i, o2)
            d = tl.arange(0, D)
            v = tl.load(qkv_ptr + t * (H + 2 * HKV) * D + (H + HKV + kh) * D + d)
            tl.store(v_cache_ptr + (slot * HKV + kh) * D + d, v)


@triton.jit
def _vision_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, rows, H: tl.constexpr, D: tl.constexpr,
                        HALF_P2: tl.constexpr):
    # program (row, head): q and k rotated in float32 and rounded once, v copied, each into [H, rows, D]
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF_P2)
    mask = i < HALF
    dtype = q_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + t * D + i, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + t * D + HALF + i, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + t * D + i, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + t * D + HALF + i, mask=mask, other=0.0)
    src = qkv_ptr + t * 3 * H * D + h * D
    dst = (h * rows + t) * D
    x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + dst + i, (x1 * c1 - x2 * s1).to(dtype), mask=mask)
    tl.store(q_ptr + dst + HALF + i, (x2 * c2 + x1 * s2).to(dtype), mask=mask)
    x1 = tl.load(src + H * D + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + H * D + HALF + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(k_ptr + dst + i, (x1 * c1 - x2 * s1).to(dtype), mask=mask)
    tl.store(k_ptr + dst + HALF + i, (x2 * c2 + x1 * s2).to(dtype), mask=mask)
    tl.store(v_ptr + dst + i, tl.load(src + 2 * H * D + i, mask=mask), mask=mask)
    tl.store(v_ptr + dst + HALF + i, tl.load(src + 2 * H * D + HALF + i, mask=mask), mask=mask)


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x / (1.0 + tl.exp(-1.702 * x))).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, scale,
                               max_blocks, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                               GP: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                               IEEE: tl.constexpr):
    # Flash-decoding: program (sequence, KV head, split) runs an online softmax of the G query heads of that KV
    # head over its share of the sequence, BLOCK_N tokens a step (gathered through the block table), on tensor
    # cores; the combine kernel merges the splits. A sequence's shares depend on its own length only.
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(len_ptr + b)
    chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = b * H + kh * G + g
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        valid = tok < end
        block = tl.load(table_ptr + b * max_blocks + tok // BS, mask=valid, other=0).to(tl.int64)
        rows = ((block * BS + tok % BS) * HKV + kh) * D
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    part = heads * SPLITS + split
    tl.store(m_ptr + part, m, mask=g < G)
    tl.store(l_ptr + part, l, mask=g < G)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])


@triton.jit
def _paged_decode_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (sequence, query head)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(m_ptr + row * SPLITS + s)
    l = tl.load(l_ptr + row * SPLITS + s)
    acc = tl.load(acc_ptr + (row * SPLITS + s)[:, None] * D + d[None, :])
    top = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # an empty split weighs nothing
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)  # a padding row (n = 0): zeros
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


class TritonOps(TorchOps):
    """`TorchOps`' kernels fused in Triton, for a CUDA device (same signatures, except that `decode_attention`
    reads ``seq_lens`` on the GPU: no host sync, so it can be captured in a CUDA graph)."""

    name = "triton"

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        n = x.shape[-1]
        out = torch.empty_like(x)
        r_out = torch.empty_like(x) if residual is not None else x
        _add_rms_norm_kernel[(x.numel() // n,)](x, residual if residual is not None else x, weight, out, r_out,
                                                eps, n, HAS_RESIDUAL=residual is not None,
                                                BLOCK=triton.next_power_of_2(n))
        return out, r_out

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        n = gate_up.shape[-1] // 2
        out = gate_up.new_empty((*gate_up.shape[:-1], n))
        block = 1024
        _silu_mul_kernel[(gate_up.numel() // (2 * n), triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
        return out

    @staticmethod
    def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        q = qkv.new_empty((tokens, num_heads, head_dim))
        k = qkv.new_empty((tokens, num_kv_heads, head_dim))
        _rope_store_kernel[(tokens, num_heads + num_kv_heads)](qkv, cos, sin, slots, q, k, k_cache, v_cache,
                                                               H=num_heads, HKV=num_kv_heads, D=head_dim)
        v = qkv.view(tokens, num_heads + 2 * num_kv_heads, head_dim)[:, num_heads + num_kv_heads:]
        return q, k, v

    @staticmethod
    def vision_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = qkv.shape[0]
        head_dim = qkv.shape[1] // (3 * num_heads)
        qkv, cos, sin = qkv.contiguous(), cos.float().contiguous(), sin.float().contiguous()
        q, k, v = (qkv.new_empty((num_heads, rows, head_dim)) for _ in range(3))
        _vision_rope_kernel[(rows, num_heads)](qkv, cos, sin, q, k, v, rows, H=num_heads, D=head_dim,
                                               HALF_P2=triton.next_power_of_2(head_dim // 2))
        return q, k, v

    @staticmethod
    def quick_gelu(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        block = 1024
        _quick_gelu_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block)
        return out

    @staticmethod
    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[-2], k_cache.shape[1]
        group = num_heads // num_kv_heads
        m = q.new_empty((batch, num_heads, DECODE_SPLITS), dtype=torch.float32)
        l = torch.empty_like(m)
        acc = q.new_empty((batch, num_heads, DECODE_SPLITS, head_dim), dtype=torch.float32)
        _paged_decode_split_kernel[(batch, num_kv_heads, DECODE_SPLITS)](
            q.contiguous(), k_cache, v_cache, block_tables, seq_lens, m, l, acc, scale, block_tables.shape[1],
            H=num_heads, HKV=num_kv_heads, D=head_dim, G=group, GP=max(16, triton.next_power_of_2(group)),
            BS=block_size, BLOCK_N=max(32, block_size), SPLITS=DECODE_SPLITS, IEEE=q.dtype == torch.float32)
        out = torch.empty_like(q)
        _paged_decode_combine_kernel[(batch * num_heads,)](m, l, acc, out, D=head_dim, SPLITS=DECODE_SPLITS)
        return out
