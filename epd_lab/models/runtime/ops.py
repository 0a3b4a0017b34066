"""The runtime's kernels, each in two forms: torch ops (any device; HF's own sequence of operations where one
exists) and, on a CUDA device, a fused Triton kernel (`epd_lab.models.runtime.triton_ops`).

`kernels.open_ops(device)` picks the form once. The torch form is what the CPU runs and what CI tests; the Triton
form is what makes a decode step 10 kernels a layer (about nano-vllm's count) instead of ~30, which is what a CUDA
graph of a small model is bound by (GPU-NOTES.md). The two agree to rounding, not bit for bit: fused kernels round
once where HF's bfloat16 ops round after every op. Bit-identity is a contract *within* one form (split vs
monolithic use of the same runtime), never across forms.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2's RMSNorm, HF's sequence: the statistics in float32, the scale applied in the input dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's ``x * cos + rotate_half(x) * sin``; `cos`/`sin` broadcast over heads."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class TorchOps:
    """Every kernel as torch ops: the CPU's runtime, and the GPU's reference."""

    name = "torch"

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the new residual stream, in the model's dtype) and its RMSNorm; no residual: x's."""
        if residual is not None:
            x = residual + x
        return rms_norm(x, weight, eps), x

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a fused gate-up projection ``[..., 2 * intermediate]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a fused QKV ``[T, (H + 2 Hkv) D]``, rotate Q and K by ``cos``/``sin`` ``[T, D]``, store K and V of
        token t at row ``slots[t]`` of the flat caches (``slots[t] < 0``: not stored). Returns (q [T, H, D],
        k [T, Hkv, D], v [T, Hkv, D]) with q and k rotated."""
        tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        q, k, v = qkv.view(tokens, num_heads + 2 * num_kv_heads, head_dim).split(
            [num_heads, num_kv_heads, num_kv_heads], dim=1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keep = slots >= 0
        rows = slots[keep]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, rows, k[keep])
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, rows, v[keep])
        return q, k, v

    @staticmethod
    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """One query token per sequence, ``q`` [B, H, D], over the first ``seq_lens[b]`` tokens of the blocks
        ``block_tables[b]`` (block ids, [B, max_blocks]): per sequence, unpadded and unmasked, as HF's decode step
        attends. Returns [B, H, D]."""
        num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
        block_size = k_cache.shape[1]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        rows = []
        for b, n in enumerate(seq_lens.tolist()):
            t = torch.arange(n, device=q.device)
            slots = block_tables[b, t // block_size] * block_size + t % block_size
            k = flat_k[slots].transpose(0, 1).unsqueeze(0)
            v = flat_v[slots].transpose(0, 1).unsqueeze(0)
            rows.append(F.scaled_dot_product_attention(q[b:b + 1].unsqueeze(2), k, v, scale=scale,
                                                       enable_gqa=True))
        return torch.cat(rows).squeeze(2)

    @staticmethod
    def vision_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A vision block's fused QKV ``[rows, 3 H D]`` split, q and k rotated by ``cos``/``sin`` ``[rows, D]`` in
        float32 and rounded once into the input's dtype (HF's ``apply_rotary_pos_emb_vision``). Returns q, k, v as
        ``[H, rows, D]``, attention's layout."""
        rows = qkv.shape[0]
        q, k, v = qkv.view(rows, 3, num_heads, -1).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = (rotate(t.float(), cos, sin).to(qkv.dtype) for t in (q, k))
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    @staticmethod
    def quick_gelu(x: torch.Tensor) -> torch.Tensor:
        """``x * sigmoid(1.702 x)``, HF's ``QuickGELUActivation`` (the Qwen2-VL vision MLP's activation)."""
        return x * torch.sigmoid(1.702 * x)
