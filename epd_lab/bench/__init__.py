"""Benchmarks: `epd-lab bench transfer` and `epd-lab bench epd`."""
from __future__ import annotations

import json
import os


def read_json(path: str) -> dict:
    """A benchmark's result, as `write_json` wrote it."""
    with open(path) as f:
        return json.load(f)


def write_json(path: str, result: dict) -> None:
    """Write a benchmark's result (creating the folder) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
