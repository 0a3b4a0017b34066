"""When each request of `epd-lab bench serve` is sent: an open-loop arrival schedule, as `vllm bench serve`'s.

Inter-arrival gaps are drawn from a gamma distribution of shape `burstiness` and mean ``1 / rate``: burstiness 1
is a Poisson process, below 1 burstier, above 1 more regular (the gaps' squared coefficient of variation is
``1 / burstiness``), infinite a fixed gap. An infinite rate sends every request at once. As vLLM does, the gaps
are then scaled so that the last request is due at ``n / rate``: runs with different seeds send at the same mean
rate (unscaled sums drift by 1-2%), and the scaling leaves the gaps' shape (their CV) unchanged.

The schedule is computed before the run, so that a test checks it without sleeping, and the sender only waits.
"""
from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds from the start at which each of `n` requests is due (non-decreasing, the first gap included).

    Raises:
        ValueError: `n` < 1, or a rate or burstiness that is not positive.
    """
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be positive (inf: all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    return offsets * (n / rate / offsets[-1])
