"""Figures to files: PNG through kaleido (which drives a local Chromium), and one offline HTML report.

kaleido 1.x starts a browser for each export call (2–4 s here), so `save_pngs` exports many figures in one
call. Nothing is fetched from the network: kaleido's MathJax (a CDN script) is off, and the HTML report
inlines plotly.js once. PNGs are written with a palette of at most `PNG_COLORS` colours (a plot has few; 3-6x
smaller files than plotly's RGBA).

`static_pngs()` makes every ``fig.show()`` of a notebook put a PNG beside plotly's own output, in the same output
(``plotly_mimetype+epd_png``), so that a notebook shows its figures where plotly's JavaScript does not run
(code hosts, nbconvert to HTML without it). One browser serves the whole kernel.
"""
from __future__ import annotations

import atexit
import base64
import datetime
import html
import io
import os
import shutil
from pathlib import Path
from typing import Callable, Mapping, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

Section = tuple[str, Union[go.Figure, pd.DataFrame, str]]


def chromium_path() -> str:
    """The Chromium that kaleido will drive: ``$BROWSER_PATH`` when set, else one on ``PATH``, else
    /usr/bin/chromium. Raises `RuntimeError` saying what to install when there is none."""
    if forced := os.environ.get("BROWSER_PATH"):
        if os.path.isfile(forced) and os.access(forced, os.X_OK):
            return forced
        raise RuntimeError(f"BROWSER_PATH={forced!r} is not an executable file: point it at Chromium or Chrome, "
                           "or unset it to use Debian's /usr/bin/chromium")
    for path in (shutil.which("chromium"), shutil.which("chromium-browser"), shutil.which("google-chrome"),
                 "/usr/bin/chromium"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise RuntimeError("PNG export needs Chromium and none was found: install Debian's `chromium` package "
                       "(apt-get install chromium) or set BROWSER_PATH to a Chromium or Chrome executable")


def _height(fig: go.Figure, width: int, height: int | None) -> int:
    return int(height or fig.layout.height or round(width * 0.55))


PNG_COLORS = 128  # a palette of at most this many colours


def quantize_png(data: bytes, colors: int = PNG_COLORS) -> bytes:
    """`data` (a PNG) with a palette of at most `colors` colours, written with PNG's optimizer."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    image.save(out, "PNG", optimize=True)
    return out.getvalue()


def static_pngs(width: int = 760, height: int | None = None, colors: int = PNG_COLORS) -> None:
    """From now on in this process, ``fig.show()`` outputs plotly's figure and a PNG of it (`width` px wide;
    `height`: as in `save_pngs`) in one output bundle. Starts one kaleido browser, kept until the process ends."""
    import kaleido
    import plotly.io as pio
    from plotly.io._base_renderers import MimetypeRenderer

    class PngBeside(MimetypeRenderer):
        def to_mimebundle(self, fig_dict):
            fig = go.Figure(fig_dict)
            png = kaleido.calc_fig_sync(fig_dict, opts={"format": "png", "width": width,
                                                        "height": _height(fig, width, height)})
            return {"image/png": base64.b64encode(quantize_png(png, colors)).decode()}

    kaleido.start_sync_server(path=chromium_path(), mathjax=False, silence_warnings=True)
    atexit.register(kaleido.stop_sync_server, silence_warnings=True)
    pio.renderers["epd_png"] = PngBeside()
    pio.renderers.default = "plotly_mimetype+epd_png"


def save_pngs(figs: Mapping[str, go.Figure], directory: str | Path, width: int = 1100,
              height: int | None = None, scale: float = 1.0) -> dict[str, Path]:
    """Write each figure as ``<directory>/<name>.png`` in one kaleido call (one browser start for all).

    `height` defaults to each figure's ``layout.height``, else 0.55 × `width`.
    """
    import kaleido

    if not figs:
        return {}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / f"{name}.png" for name in figs}
    specs = [{"fig": fig.to_dict(), "path": paths[name],
              "opts": {"format": "png", "width": width, "height": _height(fig, width, height), "scale": scale}}
             for name, fig in figs.items()]
    # mathjax=False: kaleido would otherwise fetch MathJax from a CDN (offline here); plotly.js is plotly.py's own
    kaleido.write_fig_from_object_sync(specs, kopts={"path": chromium_path(), "mathjax": False},
                                       cancel_on_error=True)
    for path in paths.values():
        path.write_bytes(quantize_png(path.read_bytes()))
    return paths


def save_png(fig: go.Figure, path: str | Path, width: int = 1100, height: int | None = None,
             scale: float = 1.0) -> Path:
    """Write one figure as PNG (`height`: as in `save_pngs`)."""
    path = Path(path)
    if path.suffix != ".png":
        raise ValueError(f"{path}: the name must end in .png")
    written = save_pngs({path.stem: fig}, path.parent, width, height, scale)
    return written[path.stem]


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } .meta { color: #666; margin-top: 0; }
section { margin: 2.5em 0; } nav ol { columns: 2; }
table.frame { border-collapse: collapse; font-size: 0.9em; font-variant-numeric: tabular-nums; }
table.frame th, table.frame td { border-bottom: 1px solid #ddd; padding: 0.25em 0.7em; text-align: right; }
table.frame th { background: #f3f3f3; } .table-wrap { overflow-x: auto; }
"""


def _render(item: go.Figure | pd.DataFrame | str, index: int, float_format: Callable[[float], str]) -> str:
    if isinstance(item, go.Figure):
        return item.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{index}",
                            default_width="100%", default_height=f"{item.layout.height or 480}px",
                            config={"displaylogo": False, "responsive": True})
    if isinstance(item, pd.DataFrame):
        keep_index = not isinstance(item.index, pd.RangeIndex)
        table = item.to_html(index=keep_index, border=0, classes="frame", float_format=float_format, na_rep="")
        return f'<div class="table-wrap">{table}</div>'
    if isinstance(item, str):
        return "\n".join(f"<p>{html.escape(p).replace(chr(10), '<br>')}</p>" for p in item.split("\n\n") if p.strip())
    raise TypeError(f"a report section holds a plotly Figure, a pandas DataFrame or a str, not {type(item).__name__}")


def html_report(sections: Sequence[Section], path: str | Path, title: str,
                float_format: Callable[[float], str] = "{:.2f}".format) -> Path:
    """Write one self-contained HTML file: plotly.js inlined once, then each ``(heading, item)`` in order.

    An item is a plotly Figure (interactive), a DataFrame (an HTML table; floats through `float_format`)
    or a str (paragraphs split at blank lines). The file opens offline: it references nothing external.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    toc = "".join(f'<li><a href="#section-{i}">{html.escape(h)}</a></li>' for i, (h, _) in enumerate(sections))
    body = "\n".join(f'<section id="section-{i}"><h2>{html.escape(heading)}</h2>\n{_render(item, i, float_format)}'
                     f"</section>" for i, (heading, item) in enumerate(sections))
    path.write_text(
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
        f"<style>{_CSS}</style>\n"
        f'<script type="text/javascript">{get_plotlyjs()}</script>\n</head>\n<body>\n'
        f'<h1>{html.escape(title)}</h1>\n<p class="meta">written {created}</p>\n<nav><ol>{toc}</ol></nav>\n'
        f"{body}\n</body>\n</html>\n", encoding="utf-8")
    return path
