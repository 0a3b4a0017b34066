"""Seeded sampling where the logits are (the GPU on a GPU), stateless: token ``step`` of a request is a function
of its logits, its temperature, its seed and ``step`` alone.

    tokens = sample(logits, temperatures, seeds, steps)    # logits [B, vocab] -> token ids [B], same device

Temperature 0 is greedy (the argmax). Above 0 a token is drawn from ``softmax(logits / temperature)`` by the
Gumbel-max trick: ``argmax(logits / temperature + g)``, ``g = -log(-log(u))`` for one uniform ``u`` per vocabulary
entry. The uniforms are not drawn from a generator's state but hashed from ``(seed, step, vocab index)``
(`_noise`), so:

- prefill samples token 0 and decode the tokens after it with nothing handed over but the seed: the split draws
  what the monolithic model draws (a generator would have to travel with the request, or be replayed);
- a row's token does not depend on the batch it is in, its position there, or the other rows;
- the noise is a few elementwise integer ops over ``[rows, vocab]`` on the logits' device (no copy of the
  logits to the host, no per-row kernel), in the same integer bits on the CPU and on a GPU.

The uniforms take 23 bits (``(2k + 1) / 2**24``, exact in float32): a draw's probabilities are the softmax's to
within about ``2**-23`` of each. A request without a seed gets a random one per role (`request_seed`): its draws are still
independent, only not reproducible. The CPU and a GPU compute ``log`` and the scaled logits to their own
rounding, so a token drawn where two candidates nearly tie may differ between devices; on one device the same
inputs give the same token.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["request_seed", "sample"]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_F32_MAX = float(np.finfo(np.float32).max)
_NOISE_BITS = 23  # 2k + 1 < 2**24: exact in float32's 24-bit significand
_INDICES: dict[tuple[torch.device, int], torch.Tensor] = {}  # arange(vocab) per device, built once


def request_seed(seed: int | None) -> int:
    """The seed a request's draws use: its own, or for a request that gave none a random one (a non-negative
    int64, as a request's ``seed`` may be)."""
    return secrets.randbits(63) if seed is None else seed


def _splitmix64(x: int) -> int:
    """SplitMix64's finalizer on Python ints: a well-mixed 64-bit key per (seed, step)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _row_key(seed: int, step: int) -> int:
    """The 32-bit key of one (seed, step): every bit of both mixed in."""
    return _splitmix64(_splitmix64(seed & _M64) ^ (step & _M64)) & _M32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for 32-bit values in int64, without overflowing int64: in 16-bit halves of `c`."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), float32 [rows, vocab]: lowbias32 (Wellons' 32-bit integer hash) of ``key ^ index``."""
    index = _INDICES.get((keys.device, vocab))
    if index is None:
        index = _INDICES[(keys.device, vocab)] = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    x = keys[:, None] ^ index
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return ((x >> (32 - _NOISE_BITS)) * 2 + 1).float() * (1.0 / 2 ** (_NOISE_BITS + 1))


def _row_params(temperatures: Sequence[float], seeds: Sequence[int], steps: Sequence[int],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, on `device`: the noise key (int64), the logits' scale (float32: 1/t, capped at float32's largest;
    1 where greedy) and the noise's weight (float32: 1 where drawn, 0 where greedy). One copy to a GPU, from pinned
    memory and not waited for: a copy from pageable memory would wait for the logits' forward to end first, and
    the GPU would idle while the host launched the draw's kernels (1.2 ms a step on the H200)."""
    n = len(temperatures)
    host = torch.empty(3 * n, dtype=torch.int64, pin_memory=device.type == "cuda")
    values = host.numpy()
    values[:n] = [_row_key(seed, step) for seed, step in zip(seeds, steps)]
    # 1/t in float64 on the host: a tiny temperature (1e-198) scales every logit but the largest to -inf, the
    # largest to 0 (shifted first), where dividing by t in float32 would give 0/0
    values[n:2 * n].view(np.float64)[:] = [min(1.0 / t, _F32_MAX) if t > 0 else 1.0 for t in temperatures]
    values[2 * n:] = [t > 0 for t in temperatures]
    params = host.to(device, non_blocking=True)
    return params[:n], params[n:2 * n].view(torch.float64).float(), params[2 * n:].float()


def sample(logits: torch.Tensor, temperatures: Sequence[float], seeds: Sequence[int],
           steps: Sequence[int]) -> torch.Tensor:
    """Token ids [B] (int64, on the logits' device) from logits [B, vocab]: row b greedy where
    ``temperatures[b] == 0``, else drawn at ``temperatures[b]`` with the noise of ``(seeds[b], steps[b])``."""
    if not len(temperatures) == len(seeds) == len(steps) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits need as many temperatures, seeds and steps")
    if any(not t >= 0 for t in temperatures):
        raise ValueError(f"temperatures must be >= 0, got {list(temperatures)}")
    if not any(t > 0 for t in temperatures):
        return logits.argmax(-1)
    keys, scale, weight = _row_params(temperatures, seeds, steps, logits.device)
    x = logits.float()
    # a greedy row's score is its logits less their largest, exactly (x - m == 0 only where x == m): its argmax;
    # its noise is weighed 0 (finite: u lies in (0, 1)), so a mixed batch needs no gather or scatter by row
    scores = (x - x.amax(-1, keepdim=True)).mul_(scale[:, None])
    gumbel = _noise(keys, x.shape[-1]).log_().neg_().log_().neg_().mul_(weight[:, None])
    return scores.add_(gumbel).argmax(-1)
