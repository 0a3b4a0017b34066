"""The plotly figures draw what the spans and benchmarks hold, and their exports are real files.

- Waterfall: one bar per span of a real E→P request (two encode servers, the receiver and prefill in this
  process) at its start and duration, in start order, coloured by stage; labels and geometry on hand-made
  spans; small multiples from a real `Recorder`.
- Critical path: its own row on top (the path's spans in stage colours, the gaps hatched grey) over the spans,
  those off the path faded; the real request's path tiles its spans' envelope and runs through ViT and prefill.
- Bandwidth: one line per contiguous path of ``data/bench/transfer.json`` plus the memcpy limit.
- Sweep: heatmap cells and line points are the aggregates of the table's rows.
- Export: a PNG through kaleido and Debian's Chromium (magic bytes and IHDR size), and an HTML report that
  references nothing external, inlines plotly.js once, and renders every figure in Chromium with the network
  blocked. Both skip, saying why, when Chromium (or Playwright) is missing.
"""
from __future__ import annotations

import re
import struct

import pandas as pd
import pytest
from plotly.offline import get_plotlyjs

from epd_lab.ep.messages import part_req_id
from epd_lab.ep.prefill import EPDPrefill
from epd_lab.launch import Cluster, Topology
from epd_lab.models import configure_torch, load_model
from epd_lab.noise import noise_images
from epd_lab.trace import Recorder, Span, critical_path, spans_frame
from epd_lab.viz import (STAGE_ORDER, bandwidth_curves, chromium_path, critical_path_waterfall, html_report,
                         load_bench, request_spans, save_png, save_pngs, stage_color, stage_distributions,
                         sweep_heatmap, sweep_lines, waterfall, waterfalls)
from epd_lab.viz.runtime import load_runtime, runtime_figure, runtime_frame
from epd_lab.viz.split import RESULTS, e2e_frame, load_e2e, split_figure, split_pays

pytestmark = pytest.mark.timeout(240)


def _chromium() -> str:
    try:
        return chromium_path()
    except RuntimeError as exc:
        pytest.skip(f"no Chromium for kaleido/Playwright: {exc}")


@pytest.fixture(scope="module")
def epd_frame(tmp_path_factory) -> pd.DataFrame:
    """The spans of one real E→P request whose two images went to two encode servers."""
    d = tmp_path_factory.mktemp("img")
    paths = [str(d / f"{i}.png") for i in range(2)]
    for path, image in zip(paths, noise_images([(448, 448), (224, 112)], 3)):
        image.save(path)
    configure_torch()
    model = load_model()
    with Cluster(Topology(encoders=2, backend="mooncake", timeout=30)) as cluster, cluster.receiver() as rx:
        result = EPDPrefill(rx, model).prefill("draw me", paths, rid="viz0")
    return spans_frame(result.spans)


def _bars(fig):
    return [t for t in fig.data if t.type == "bar"]


def test_waterfall_has_one_bar_per_span_of_a_real_request(epd_frame):
    fig = waterfall(epd_frame)
    bars = _bars(fig)
    assert sum(len(t.x) for t in bars) == len(epd_frame)
    rows = request_spans(epd_frame, "viz0").set_index("label")
    for t in bars:
        assert set(rows.loc[list(t.y), "stage"]) == {t.name} and t.marker.color == stage_color(t.name)
        assert list(t.base) == pytest.approx(list(rows.loc[list(t.y), "start_ms"]))
        assert list(t.x) == pytest.approx(list(rows.loc[list(t.y), "duration_ms"]))
    # rows top to bottom in order of start, from 0 (the request's first span)
    order = list(fig.layout.yaxis.categoryarray)
    starts = [rows.loc[label, "start_ms"] for label in order]
    assert starts == sorted(starts) and starts[0] == 0 and fig.layout.yaxis.autorange == "reversed"
    names = [t.name for t in bars]
    assert names == sorted(names, key=STAGE_ORDER.index)  # legend in protocol order
    # both parts, each encoded on its own encode server; on the timeline a part's ViT ends before its write
    vit = {label: rows.loc[label, "node"] for label in order if label.startswith("vit · part")}
    assert len(vit) == 2 and len(set(vit.values())) == 2 and all(n.startswith("encoder:") for n in vit.values())
    for part in (0, 1):
        node = vit[next(label for label in vit if label.startswith(f"vit · part {part} "))]
        assert rows.loc[f"vit · part {part} · {node}", "end_ms"] <= rows.loc[f"transfer · part {part} · {node}",
                                                                             "start_ms"]
    assert order[-1] == "prefill · prefill"  # prefill starts last: it waits for every part


def test_waterfall_labels_and_geometry():
    ms = 1_000_000
    spans = [Span("r1", 0, "http_encode", "prefill", 10 * ms, 14 * ms),
             Span("r1_local_part_1", 1, "vit", "encoder:4321", 11 * ms, 13 * ms, 4096),
             Span("r1_local_part_1", 1, "vit", "encoder:4321", 13 * ms, 15 * ms, 4096),
             Span("r1", -1, "prefill", "prefill", 15 * ms, 17 * ms),
             Span("r1", 3, "decode_step", "decode:9", 18 * ms, 19 * ms),
             Span("r0", -1, "e2e", "proxy:1", 1 * ms, 2 * ms)]
    frame = spans_frame(spans)
    assert list(_bars(waterfall(frame))[0].y) == ["e2e · proxy:1"]  # None: the request that started first
    fig = waterfall(frame, "r1")
    assert list(fig.layout.yaxis.categoryarray) == [
        "http_encode · part 0 · prefill", "vit · part 1 · encoder:4321", "vit · part 1 · encoder:4321 (2)",
        "prefill · prefill", "decode_step · token 3 · decode:9"]
    geometry = {y: (b, x) for t in _bars(fig) for y, b, x in zip(t.y, t.base, t.x)}
    assert geometry["vit · part 1 · encoder:4321 (2)"] == (3.0, 2.0)
    assert geometry["decode_step · token 3 · decode:9"] == (8.0, 1.0)
    assert [t.name for t in _bars(fig)] == ["http_encode", "vit", "prefill", "decode_step"]
    assert list(_bars(fig)[1].customdata[:, 3]) == [4096, 4096]  # bytes, for the hover
    with pytest.raises(ValueError, match="'nope'.*r0"):
        waterfall(frame, "nope")


def _path_bars(fig, row):
    """The bars of the critical-path row as (trace name, start ms, duration ms), in time order."""
    return sorted((t.name, b, x) for t in _bars(fig) for y, b, x in zip(t.y, t.base, t.x) if y == row)


def test_critical_path_waterfall_draws_the_path_and_its_gaps():
    ms = 1_000_000
    spans = [Span("r", -1, "ttft", "proxy:1", 0, 100 * ms), Span("r", -1, "e2e", "proxy:1", 0, 130 * ms),
             Span("r", 0, "http_encode", "prefill", 5 * ms, 30 * ms),
             Span("r_local_part_0", 0, "load", "encoder:2", 10 * ms, 15 * ms),
             Span("r_local_part_0", 0, "vit", "encoder:2", 16 * ms, 60 * ms),
             Span("r", -1, "register", "prefill", 31 * ms, 32 * ms),  # while the ViT ran: off the path
             Span("r", -1, "prefill", "prefill", 62 * ms, 95 * ms),
             Span("r", 1, "decode_step", "decode:3", 110 * ms, 120 * ms)]
    frame = spans_frame(spans)
    fig = critical_path_waterfall(frame, "r")
    row = "critical path · ttft"
    assert list(fig.layout.yaxis.categoryarray) == [row, *request_spans(frame, "r")["label"]]
    assert _path_bars(fig, row) == [("gap", 0, 10), ("gap", 15, 1), ("gap", 60, 2), ("gap", 95, 5),
                                    ("load", 10, 5), ("prefill", 62, 33), ("vit", 16, 44)]
    gap = next(t for t in _bars(fig) if t.name == "gap")
    assert gap.marker.pattern.shape == "/" and gap.marker.color == "#E5E5E5"
    assert list(gap.customdata[:, 3]) == ["start→load", "load→vit", "vit→prefill", "prefill→end"]  # for the hover
    assert all(t.marker.color == stage_color(t.name) for t in _bars(fig) if t.name != "gap")
    # below the path row, the spans on it at full colour, the others (containers included) faded
    opacity = {y: o for t in _bars(fig) if row not in t.y for y, o in zip(t.y, t.marker.opacity)}
    assert {y for y, o in opacity.items() if o == 1.0} == {"load · part 0 · encoder:2", "vit · part 0 · encoder:2",
                                                           "prefill · prefill"}
    assert set(opacity.values()) == {1.0, 0.3} and len(opacity) == len(spans)
    shown = [t.name for t in _bars(fig) if t.showlegend is not False]
    assert sorted(shown) == sorted(set(shown)) and {"gap", "vit", "ttft"} <= set(shown)  # each stage once
    assert fig.layout.title.text == ("request r: ttft 100.0 ms, critical path of 3 spans, 18.0 ms (18%) "
                                     "covered by no span")
    with pytest.raises(ValueError, match="no 'ttft' span"):
        critical_path_waterfall(spans_frame(spans[2:]), "r")
    assert critical_path_waterfall(spans_frame(spans[2:]), "r", until=None).data[0].y[0] == "critical path · all spans"


def test_critical_path_of_a_real_request(epd_frame):
    # no proxy here, so no ttft: the window is the envelope of the request's spans
    path = critical_path(epd_frame, "viz0", until=None)
    envelope = epd_frame.t_end_ns.max() - epd_frame.t_start_ns.min()
    assert (path.t_end_ns - path.t_start_ns).sum() == envelope and path.attrs["anchor"]["t_end_ns"] == \
        epd_frame.t_end_ns.max()
    assert (path.t_start_ns.iloc[1:].to_numpy() == path.t_end_ns.iloc[:-1].to_numpy()).all()
    on_path = path[path.kind == "span"]
    assert {"vit", "prefill"} <= set(on_path.stage) and on_path.stage.iloc[-1] == "prefill"
    assert "http_encode" not in set(on_path.stage)  # it holds its encoder's load: a container
    for r in on_path.itertuples():  # each piece of the path lies within its span
        span = epd_frame.loc[r.span]
        assert (span.stage, span.node) == (r.stage, r.node)
        assert span.t_start_ns <= r.t_start_ns < r.t_end_ns <= span.t_end_ns
    fig = critical_path_waterfall(epd_frame, until=None)
    assert fig.layout.yaxis.categoryarray[0] == "critical path · all spans"
    assert sum(len(t.x) for t in _bars(fig)) == len(epd_frame) + len(path)


def test_waterfalls_small_multiples_from_a_recorder():
    rec = Recorder("rx", enabled=True)
    for rid in ("a", "b", "c"):
        with rec.span("http_encode", rid, 0):
            with rec.span("vit", part_req_id(rid, 0), 0, nbytes=1024):
                pass
        with rec.span("prefill", rid):
            pass
    frame = spans_frame(rec.spans())
    fig = waterfalls(frame, cols=2)
    assert [a.text for a in fig.layout.annotations] == ["a", "b", "c"]
    assert sum(len(t.x) for t in _bars(fig)) == 9
    legend = [t.name for t in _bars(fig) if t.showlegend]
    assert sorted(legend) == ["http_encode", "prefill", "vit"]  # each stage once across the panels
    # 2 columns (a, b above c), one time axis: every panel's x follows the bottom-left one
    assert fig.layout.xaxis.matches == fig.layout.xaxis2.matches == "x3" and fig.layout.xaxis3.domain[0] == 0
    with pytest.raises(ValueError, match="2 titles for 3 requests"):
        waterfalls(frame, titles=["x", "y"])


def test_stage_distributions(epd_frame):
    fig = stage_distributions(epd_frame)
    assert sorted(fig.layout.xaxis.categoryarray, key=STAGE_ORDER.index) == list(fig.layout.xaxis.categoryarray)
    assert {t.name for t in fig.data} == set(epd_frame.stage) and sum(len(t.y) for t in fig.data) == len(epd_frame)
    assert all(t.marker.color == stage_color(t.name) for t in fig.data)
    two = pd.concat([epd_frame.assign(backend="mooncake"), epd_frame.assign(backend="zmq")], ignore_index=True)
    fig = stage_distributions(two, color="backend", kind="violin")
    assert [(t.type, t.name, len(t.y)) for t in fig.data] == [("violin", "mooncake", len(epd_frame)),
                                                              ("violin", "zmq", len(epd_frame))]
    with pytest.raises(ValueError, match="no column 'nope'"):
        stage_distributions(epd_frame, color="nope")


def test_bandwidth_curves_one_line_per_path_and_the_memcpy_limit():
    bench = load_bench()
    contiguous = [r for r in bench["rows"] if r["blocks"] == 1]
    assert len(contiguous) < len(bench["rows"])  # the file also has scattered (256-block) rows
    fig = bandwidth_curves(bench)
    paths = list(dict.fromkeys(r["path"] for r in contiguous))
    assert [t.name for t in fig.data] == [f"{p} (limit)" if p == "memcpy" else p for p in paths]
    for trace, path in zip(fig.data, paths):
        rows = sorted((r for r in contiguous if r["path"] == path), key=lambda r: r["size"])
        assert list(trace.x) == [r["size"] for r in rows] and list(trace.y) == [r["gbps"] for r in rows]
        assert list(trace.error_y.array) == pytest.approx([r["gbps_max"] - r["gbps"] for r in rows])
        assert list(trace.error_y.arrayminus) == pytest.approx([r["gbps"] - r["gbps_min"] for r in rows])
        assert (trace.line.dash == "dash") == (path == "memcpy")
    assert fig.layout.xaxis.type == "log" and "1 MiB" in fig.layout.xaxis.ticktext
    with pytest.raises(ValueError, match="no contiguous rows"):
        bandwidth_curves({"rows": [r for r in bench["rows"] if r["blocks"] > 1]})


def test_bandwidth_curves_of_the_gpu_run_draw_d2d_as_the_limit():
    bench = load_bench(RESULTS / "transfer-cuda-h200.json")
    fig = bandwidth_curves(bench, limit="d2d")
    assert fig.data[0].name == "d2d (limit)" and fig.data[0].line.dash == "dash"
    assert {"cuda", "pinned_staging"} <= {t.name for t in fig.data}
    assert "H200" in fig.layout.title.text  # the GPU names the machine, not the host's CPU


def test_split_pays_and_its_figure_from_the_committed_gpu_grids():
    runs = load_e2e()
    assert runs and all(run["complete"] and run["device"].startswith("cuda") for run in runs)
    frame = e2e_frame(runs)
    assert len(frame) == sum(len(run["rows"]) for run in runs)
    pays = split_pays(frame)
    key = ["run", "model", "image_size", "images", "backend"]
    assert len(pays) == frame[frame["path"] != "monolithic"].groupby(key).ngroups
    for _, p in pays.iterrows():  # each figure recomputed from the run's own rows, against the run's own floor
        at = frame[(frame["run"] == p["run"]) & (frame["image_size"] == p["image_size"])
                   & (frame["images"] == p["images"])]
        floor = at[at["path"] == "monolithic"].iloc[0]
        lone = at[(at["backend"] == p["backend"]) & (at["concurrency"] == 1)].iloc[0]
        top = at[(at["backend"] == p["backend"]) & (at["concurrency"] == at["concurrency"].max())].iloc[0]
        assert p["ttft_over_floor_ms"] == pytest.approx(lone["ttft_p50_ms"] - floor["ttft_p50_ms"])
        assert p["throughput_ratio"] == pytest.approx(top["requests_per_s"] / floor["requests_per_s"])
        # the proxy's ttft span, from the run's critical path at concurrency 1, lies inside the client's TTFT
        assert 0 < p["server_ttft_ms"] < p["ttft_ms"]
        assert p["client_ms"] == pytest.approx(p["ttft_ms"] - p["server_ttft_ms"])
    by_url = {run["source"]: run.get("media") == "url" for run in runs}
    assert {m for m in frame["model"] if "by URL" in m} == set(frame.loc[frame["run"].map(by_url), "model"])
    for model in frame["model"].unique():
        fig = split_figure(frame, model)
        at = frame[frame["model"] == model]
        # per side: a TTFT line per path (the floor's too), then a ratio line per backend measured at that side
        backends = at[at["path"] != "monolithic"].groupby("image_size")["backend"].nunique()
        assert len(fig.data) == sum((n + 1) + n for n in backends), model
        assert model in fig.layout.title.text
        for trace in fig.data:  # several runs of one point: one value drawn, the newest run's
            assert len(set(trace.x)) == len(trace.x), (model, trace.name)
    with pytest.raises(ValueError, match="not a grid run"):
        load_e2e([RESULTS / "e2e.json"])  # the CPU run on a 2-vCPU AMD EPYC (b0c56ae), before the GPU grid


def test_runtime_frame_and_figure_from_the_committed_h200_run():
    result = load_runtime()
    frame = runtime_frame(result)
    calls = sum(len(c) for model in result["results"] for c in model["runtimes"].values())
    assert len(frame) == calls
    fast = frame[(frame["runtime"] == "fast") & (frame["model"] == "qwen2-vl-2b")].set_index("call")
    assert fast.loc["decode_c1", "wall_ms"] == result["summary"]["tpot_ms_c1"]["qwen2-vl-2b"]
    on_gpu = frame.dropna(subset=["gpu_busy_ms"])
    assert (on_gpu["host_ms"] == on_gpu["wall_ms"] - on_gpu["gpu_busy_ms"]).all() and len(on_gpu) == len(frame)
    fig = runtime_figure(frame)
    models = frame["model"].nunique()
    assert len(fig.data) == models * 2 * 2  # per model: hf and fast, wall and busy
    with pytest.raises(ValueError, match="not a result of `epd-lab bench runtime`"):
        load_runtime(RESULTS / "e2e.json")


def test_sweep_heatmap_and_lines_aggregate_the_rows():
    table = pd.DataFrame({"encoders": [1, 1, 1, 2, 2, 2, 1, 2], "images": [1, 1, 1, 1, 1, 1, 2, 2],
                          "ttft_ms": [10.0, 30.0, 20.0, 5.0, 7.0, 6.0, 40.0, 12.0]})
    heat = sweep_heatmap(table, x="encoders", y="images", value="ttft_ms")
    assert heat.data[0].z.tolist() == [[20.0, 6.0], [40.0, 12.0]] and heat.data[0].text.tolist() == [[3, 3], [1, 1]]
    assert list(heat.data[0].x) == ["1", "2"] and list(heat.data[0].y) == ["1", "2"]
    assert sweep_heatmap(table, "encoders", "images", "ttft_ms", agg="max").data[0].z.tolist()[0] == [30.0, 7.0]
    assert [list(row) for row in heat.data[0].customdata] == [["10–30", "5–7"], ["", ""]]  # spread of several rows
    assert heat.layout.xaxis.type == "category" and heat.layout.yaxis.type == "category"
    lines = sweep_lines(table, x="encoders", value="ttft_ms", color="images")
    one = lines.data[0]
    assert [t.name for t in lines.data] == ["1", "2"] and list(one.x) == [1, 2] and list(one.y) == [20.0, 6.0]
    assert list(one.error_y.array) == [10.0, 1.0] and list(one.error_y.arrayminus) == [10.0, 1.0]
    assert list(lines.layout.xaxis.tickvals) == [1, 2]  # the swept values, not a linear scale's ticks
    with pytest.raises(ValueError, match="unknown agg"):
        sweep_lines(table, "encoders", "ttft_ms", agg="mode")


def test_png_export_writes_real_pngs(epd_frame, tmp_path, monkeypatch):
    _chromium()
    figs = {"waterfall": waterfall(epd_frame), "bandwidth": bandwidth_curves(load_bench())}
    paths = save_pngs(figs, tmp_path, width=1100)  # one kaleido call, one browser start
    for name, fig in figs.items():
        data = paths[name].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        assert struct.unpack(">II", data[16:24]) == (1100, fig.layout.height)
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-chromium"))
    with pytest.raises(RuntimeError, match="BROWSER_PATH=.*not an executable"):
        save_png(figs["bandwidth"], tmp_path / "x.png")


def test_html_report_is_self_contained_and_renders_offline(epd_frame, tmp_path):
    table = epd_frame[["stage", "node", "duration_ms"]].head(3)
    path = html_report([("waterfall", waterfall(epd_frame)), ("bandwidth", bandwidth_curves(load_bench())),
                        ("spans", table), ("note", "bars <b>are</b> spans\n\nsecond paragraph")],
                       tmp_path / "r" / "report.html", title="viz test")
    text = path.read_text()
    assert text.count(get_plotlyjs()) == 1
    assert not re.search(r"<script[^>]*\ssrc=", text) and not re.search(r"<link[^>]*\shref=", text)
    assert text.count('class="plotly-graph-div"') == 2 and text.count("<table") == 1
    assert "bars &lt;b&gt;are&lt;/b&gt; spans" in text and text.count("<p>") == 2
    assert all(node in text for node in table.node)
    # open it in Chromium with every non-file request refused: each figure draws, the waterfall one bar per span
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright (python package) is not installed")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            external, errors = [], []
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                       else (external.append(route.request.url), route.abort()))
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(path.as_uri())
            page.wait_for_function("document.querySelectorAll('.plotly-graph-div .main-svg').length >= 2")
            drawn = page.evaluate("[...document.querySelectorAll('.plotly-graph-div')].map("
                                  "d => [d.id, d.querySelectorAll('.barlayer .point').length,"
                                  " d.querySelectorAll('.scatterlayer .trace').length])")
            rows = page.evaluate("document.querySelectorAll('table tbody tr').length")
        finally:
            browser.close()
    assert external == [] and errors == []
    assert drawn == [["figure-0", len(epd_frame), 0], ["figure-1", 0, len(bandwidth_curves(load_bench()).data)]]
    assert rows == 3
