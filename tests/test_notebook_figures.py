"""Every plotly figure in a committed notebook also shows where plotly's JavaScript does not run (a code host, an
HTML export without it): each output that carries a plotly figure carries an ``image/png`` beside it, in the same
output (``epd_lab.viz.static_pngs``) or later in the same cell."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLOTLY = "application/vnd.plotly.v1+json"


def committed_notebooks() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "notebooks/*.ipynb"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def figures_without_png(notebook: dict) -> list[str]:
    """Where a plotly output has no PNG beside it: ``cell <i>, output <j>``."""
    missing = []
    for i, cell in enumerate(notebook["cells"]):
        outputs = cell.get("outputs", [])
        for j, output in enumerate(outputs):
            data = output.get("data", {})
            if PLOTLY in data and "image/png" not in data and not any(
                    "image/png" in later.get("data", {}) for later in outputs[j + 1:]):
                missing.append(f"cell {i}, output {j}")
    return missing


def test_the_rule_finds_a_figure_without_its_png():
    figure = {"output_type": "display_data", "data": {PLOTLY: {}}}
    png = {"output_type": "display_data", "data": {"image/png": "iVBOR"}}
    assert figures_without_png({"cells": [{"outputs": [figure]}, {"outputs": [png]}]}) == ["cell 0, output 0"]
    assert figures_without_png({"cells": [{"outputs": [figure, png]}]}) == []
    assert figures_without_png({"cells": [{"outputs": [{"data": {PLOTLY: {}, "image/png": "iVBOR"}}]}]}) == []


@pytest.mark.parametrize("path", committed_notebooks(), ids=lambda p: p.name)
def test_every_plotly_output_has_a_png_beside_it(path):
    notebook = json.loads(path.read_text())
    assert figures_without_png(notebook) == [], f"{path.name}: plotly outputs without a PNG (static_pngs() missing?)"


def test_an_nbconvert_export_shows_every_figure_as_an_image():
    """nbconvert's HTML (what a code host or an offline export shows, no plotly JavaScript running) carries one
    image per plotly figure of a committed notebook."""
    from nbconvert import HTMLExporter

    path = ROOT / "notebooks" / "02_backends_compared.ipynb"
    notebook = json.loads(path.read_text())
    figures = sum(PLOTLY in o.get("data", {}) for c in notebook["cells"] for o in c.get("outputs", []))
    html, _ = HTMLExporter().from_filename(str(path))
    assert figures and html.count('src="data:image/png;base64,') >= figures
