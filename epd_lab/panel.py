"""An ipywidgets control panel for E→P: pick a topology, launch it, send requests, watch their waterfalls.

    panel = ControlPanel()          # the cell's last expression shows it; or `with ControlPanel() as panel:`
    panel.launch(); panel.send()    # what the Launch and Send buttons do

**Launch** starts (or restarts) a `Cluster` of encoders with the chosen backend and transport, and a receiver
in this process. **Send** runs one request through `EPDPrefill`, checks its logits bit for bit against the
monolithic model, and redraws a `plotly` `FigureWidget` waterfall from the request's spans. A new panel
closes the earlier ones, so re-running a notebook cell leaves no cluster behind; so do `close()` and the end
of a ``with`` block.
"""
from __future__ import annotations

import base64
import contextlib
import html
from collections.abc import Callable
from dataclasses import dataclass

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from epd_lab.ep.media import decode_image
from epd_lab.ep.messages import BACKENDS, DTYPES
from epd_lab.ep.prefill import EPDPrefill, EPDResult, reference_prefill
from epd_lab.launch import Cluster, Topology
from epd_lab.models import configure_torch, load_model
from epd_lab.noise import random_png
from epd_lab.trace import STAGES, request_breakdown, spans_frame
from epd_lab.transfer.registry import ENGINES
from epd_lab.viz.timeline import waterfall

IMAGE_SIZES = (224, 448, 896)
_CELL = "style='padding:0 8px;text-align:right'"  # the stage table's cells
_PANELS: list[ControlPanel] = []  # open panels: a new one closes these (a re-run cell leaks nothing)


@dataclass
class Sent:
    """One request sent from the panel: its result, whether it is bit-exact, and its timings."""

    result: EPDResult
    bit_exact: bool
    breakdown: dict[str, float]  # ms per stage, plus e2e and control_plane (`request_breakdown`)
    frame: pd.DataFrame  # the request's spans (`spans_frame`)


class ControlPanel:
    """Widgets to launch an E→P topology and send requests through it; a context manager.

    Args:
        model: the prefill model (loaded with `load_model(dtype=...)` when None).
        dtype: ``float32`` or ``bfloat16``, for the encoders and the model alike.
        text: the prompt that follows the image.
        seed: seeds the random images (request ``n`` draws from ``seed + n``).
    """

    def __init__(self, model: torch.nn.Module | None = None, dtype: str = "float32",
                 text: str = "what is in this picture?", seed: int = 0) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        for old in list(_PANELS):
            old.close()
        _PANELS.append(self)
        self.dtype, self.seed, self._model = dtype, seed, model
        self.cluster: Cluster | None = None
        self.epd: EPDPrefill | None = None
        self.sent: list[Sent] = []
        self._running = contextlib.ExitStack()
        self.encoders = widgets.IntSlider(value=2, min=1, max=4, description="encoders")
        self.backend = widgets.Dropdown(options=BACKENDS, value="mooncake", description="backend")
        self.transport = widgets.Dropdown(options=ENGINES, value="auto", description="transport")
        self.source = widgets.Dropdown(options=("random", "upload"), value="random", description="image")
        self.images = widgets.IntSlider(value=1, min=1, max=4, description="images")
        self.size = widgets.Dropdown(options=[(f"{s}×{s}", s) for s in IMAGE_SIZES], value=224, description="size")
        self.upload = widgets.FileUpload(accept="image/*", multiple=True, description="upload")
        self.text = widgets.Text(value=text, description="text")
        self.launch_button = widgets.Button(description="Launch", button_style="primary", icon="play")
        self.send_button = widgets.Button(description="Send", button_style="success", icon="paper-plane")
        self.status = widgets.HTML("<i>not launched</i>")
        self.figure = go.FigureWidget(layout={"height": 320, "title": {"text": "no request yet"}})
        self.launch_button.on_click(lambda _: self._guarded(self.launch))
        self.send_button.on_click(lambda _: self._guarded(self.send))
        self.widget = widgets.VBox([
            widgets.HBox([self.encoders, self.backend, self.transport]),
            widgets.HBox([self.source, self.images, self.size, self.upload]),
            widgets.HBox([self.text, self.launch_button, self.send_button]),
            self.status, self.figure])

    @property
    def model(self) -> torch.nn.Module:
        """The prefill model, loaded on first use."""
        if self._model is None:
            configure_torch()  # one thread, as in the encoders: bit-identity across processes
            self._model = load_model(dtype=DTYPES[self.dtype])
        return self._model

    def topology(self) -> Topology:
        """The topology the widgets describe."""
        return Topology(encoders=self.encoders.value, backend=self.backend.value, transport=self.transport.value,
                        dtype=self.dtype)

    def launch(self) -> Cluster:
        """Stop the running cluster, if any, and start the one the widgets describe."""
        if self not in _PANELS:
            raise RuntimeError("this panel is closed; create a new ControlPanel")
        self.stop()
        topo = self.topology()
        self.status.value = f"<i>launching {topo.encoders} encoder(s), {topo.backend} over {topo.transport}…</i>"
        model = self.model
        self.cluster = self._running.enter_context(Cluster(topo))
        self.epd = EPDPrefill(self._running.enter_context(self.cluster.receiver()), model)
        urls = ", ".join(self.cluster.encoder_urls)
        self.status.value = f"launched: {topo.encoders} encoder(s) ({html.escape(urls)}), {topo.backend}, " \
                            f"prefill engine {self.epd.receiver.engine.session_id}"
        return self.cluster

    def send(self) -> Sent:
        """Run one request (the chosen images, then the text) and redraw the waterfall from its spans."""
        if self.epd is None:
            self.launch()
        files = self._image_files()
        items = [f"data:{mime};base64,{base64.b64encode(raw).decode()}" for mime, raw in files]
        result = self.epd.prefill(self.text.value, items, rid=f"panel{len(self.sent)}")
        ref = reference_prefill(self.model, self.text.value, [decode_image(raw) for _, raw in files])
        frame = spans_frame(result.spans)
        sent = Sent(result, torch.equal(result.prefill.logits, ref), request_breakdown(result.spans), frame)
        self.sent.append(sent)
        self._show(sent)
        return sent

    def _image_files(self) -> list[tuple[str, bytes]]:
        """The images to send as (media type, file bytes): the uploaded files, or random PNGs of the chosen size."""
        if self.source.value == "upload":
            if not self.upload.value:
                raise ValueError("no file uploaded: pick some with the upload button, or choose 'random'")
            return [(f["type"] or "image/png", bytes(f["content"])) for f in self.upload.value]
        rng = np.random.default_rng(self.seed + len(self.sent))
        return [("image/png", random_png(rng, self.size.value)) for _ in range(self.images.value)]

    def _show(self, sent: Sent) -> None:
        got, topo = sent.result.received, self.cluster.topology
        fig = waterfall(sent.frame, title=f"request {sent.result.rid}: {topo.encoders} encoder(s), {topo.backend}")
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.add_traces(list(fig.data))
            self.figure.layout = fig.layout
        stages = [s for s in (*STAGES, "e2e", "control_plane") if s in sent.breakdown]
        flag = "<b style='color:green'>True</b>" if sent.bit_exact else "<b style='color:red'>False</b>"
        self.status.value = (
            f"request <code>{sent.result.rid}</code>: {len(got.parts)} part(s), {got.nbytes} embedding bytes; "
            f"logits bit-identical to the monolithic model: {flag}<br>"
            "<table style='border-collapse:collapse'><tr>" + "".join(f"<th {_CELL}>{s}</th>" for s in stages)
            + "</tr><tr>" + "".join(f"<td {_CELL}>{sent.breakdown[s]:.2f}</td>" for s in stages) + "</tr></table>"
            "ms; parts run in parallel, so a stage counts its slowest part")

    def _guarded(self, action: Callable[[], object]) -> None:
        """A button's action: errors go to the status line (a callback's traceback would be lost)."""
        self._enable(False)
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - shown to the user, who can change the settings and retry
            self.status.value = f"<b style='color:red'>{type(exc).__name__}</b>: {html.escape(str(exc))}"
        finally:
            self._enable(self in _PANELS)

    def _enable(self, on: bool) -> None:
        self.launch_button.disabled = self.send_button.disabled = not on

    def stop(self) -> None:
        """Stop the cluster and the receiver (the panel stays usable: Launch starts them again)."""
        self._running.close()
        self.cluster = self.epd = None

    def close(self) -> None:
        """Stop the cluster and disable the buttons; the widgets stay on show with the last request. Idempotent."""
        self.stop()
        if self in _PANELS:
            _PANELS.remove(self)
            self._enable(False)
            self.status.value += "<br><i>panel closed, cluster stopped (a new panel starts afresh)</i>"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __enter__(self) -> ControlPanel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
