"""Every notebook runs top to bottom in a fresh kernel, and its cells of stable facts
(`# NBVAL_CHECK_OUTPUT`) print what the committed run printed."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


@pytest.fixture(autouse=True)
def hermetic_jupyter(tmp_path, monkeypatch):
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_stable_outputs_match(path):
    committed = nbformat.read(path, as_version=4)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    checked = 0
    for old, new in zip(committed.cells, nb.cells):
        if old.cell_type == "code" and "NBVAL_CHECK_OUTPUT" in old.source:
            assert _text(old), f"committed notebook has no output for:\n{old.source}"
            assert _text(new) == _text(old), old.source
            checked += 1
    assert checked > 0
