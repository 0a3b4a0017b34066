"""What a campaign leg reports: its progress lines while it runs, and in its result the targets of its verdict
and the percentiles of what it measured."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

Progress = Callable[[str], None]  # where a leg writes its progress lines (print, by default)


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/max and n of `values` (None when empty)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    q = np.percentile(values, [50, 90, 99])
    return {"n": len(values), "p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "max": float(max(values))}


def target(name: str, passed: bool, measured: Any, goal: str) -> dict[str, Any]:
    """One target of a leg's verdict."""
    return {"target": name, "passed": bool(passed), "measured": measured, "goal": goal}
