"""Tracing across processes: real encoder processes record spans, `Cluster.spans` collects them with the
in-process receiver's into one frame, and the frame exports to Chrome/Perfetto JSON, parquet and CSV.
Also: the bounded recorder, the duplicate rule, clock offsets over loopback and from an encoder whose clock the
kernel shifts (a time namespace), and tracing switched off."""
from __future__ import annotations

import json
import re
import subprocess

import httpx
import pytest
import torch

from epd_lab import procs
from epd_lab.ep.prefill import EPDPrefill
from epd_lab.launch import Cluster, Topology
from epd_lab.noise import noise_images
from epd_lab.trace import (COLUMNS, Recorder, Span, critical_path, estimate_clock_offset, frame_spans, load_frame,
                           request_of, save_frame, spans_frame, to_chrome_trace)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    paths = [str(d / f"{i}.png") for i in range(2)]
    for path, image in zip(paths, noise_images([(224, 224), (112, 112)], 5)):
        image.save(path)
    return paths


def test_recorder_is_bounded_and_counts_what_it_drops():
    rec = Recorder("n", capacity=3)
    for i in range(5):
        rec.add(Span(f"r{i}", -1, "vit", "n", i, i + 1))
    rec.extend([Span("x", -1, "vit", "n", 9, 10), Span("y", -1, "vit", "n", 9, 10)])
    assert [s.req_id for s in rec.spans()] == ["r4", "x", "y"] and rec.dropped == 4
    assert [s.req_id for s in rec.spans(since_ns=10)] == ["x", "y"]


def test_a_request_is_its_id_and_its_parts_not_a_prefix():
    rec = Recorder("n")
    for rid in ("req1", "req1_local_part_0", "req1_local_part_1", "req10", "req10_local_part_0"):
        rec.add(Span(rid, -1, "vit", "n", 0, 1))
    assert [s.req_id for s in rec.spans("req1")] == ["req1", "req1_local_part_0", "req1_local_part_1"]
    assert [s.req_id for s in rec.spans("chatcmpl-req10")] == ["req10", "req10_local_part_0"]
    assert [s.req_id for s in rec.spans("req1_local_part_1")] == ["req1_local_part_1"]  # a part alone
    assert len(rec.spans()) == 5


def test_recorder_index_follows_evictions():
    """One request's spans are looked up, not scanned for; evicting the oldest spans keeps the index right."""
    rec = Recorder("n", capacity=4)
    for i, rid in enumerate(["a", "a_local_part_0", "b", "a", "b_local_part_1", "c"]):
        rec.add(Span(rid, -1, "vit", "n", i, i + 1))
    assert [s.t_start_ns for s in rec.spans("a")] == [3]  # its first two were evicted
    assert [s.req_id for s in rec.spans("b")] == ["b", "b_local_part_1"]
    assert rec.spans("gone") == [] and rec.dropped == 2
    for i in range(4):
        rec.add(Span("z", -1, "vit", "n", 10 + i, 11 + i))
    assert rec.spans("a") == rec.spans("b") == [] and len(rec.spans("z")) == 4
    rec.clear()
    assert rec.spans() == rec.spans("z") == []


def test_recorder_switched_off_records_nothing(monkeypatch):
    monkeypatch.setenv("EPD_TRACE", "0")
    rec = Recorder("n")
    with rec.span("vit", "r"):
        pass
    rec.add(Span("r", -1, "vit", "n", 0, 1))
    assert not rec.enabled and rec.spans() == []


def test_frame_columns_request_clock_and_duplicates():
    spans = [Span("a_local_part_0", 0, "vit", "enc:1", 1_000_000, 3_000_000, 10),
             Span("a_local_part_1", 1, "vit", "enc:2", 2_000_000, 5_000_000, 20),
             Span("a_local_part_0", 0, "notify", "enc:1", 3_000_000, 3_000_000),  # as sent
             Span("a_local_part_0", 0, "notify", "enc:1", 3_000_000, 3_500_000),  # as its receiver ended it
             Span("b", -1, "prefill", "prefill", 7_000_000, 8_000_000)]
    frame = spans_frame(spans, {"enc:2": 500_000})
    assert tuple(frame.columns) == COLUMNS
    assert len(frame) == 4 and frame.loc[frame.stage == "notify", "duration_ms"].tolist() == [0.5]
    assert set(frame.request) == {"a", "b"} and request_of("x_local_part_12") == "x"
    a = frame[frame.request == "a"].set_index("node")
    assert a.loc["enc:1", "start_ms"].min() == 0.0 and a.loc["enc:2", "start_ms"] == 0.5  # offset applied
    assert frame[frame.request == "b"].start_ms.tolist() == [0.0]
    assert frame.attrs["clock_offsets"] == {"enc:2": 500_000}
    assert len(frame_spans(frame)) == 4


def test_exports_round_trip(tmp_path):
    spans = [Span("r_local_part_0", 0, "vit", "encoder:1", 10_000, 50_000, 7),
             Span("r", -1, "prefill", "prefill", 60_000, 90_000)]
    frame = spans_frame(spans, {"encoder:1": 0}, {"encoder:1": 0})
    for name in ("s.parquet", "s.csv"):
        back = load_frame(save_frame(frame, tmp_path / name))
        assert back[list(COLUMNS)].equals(frame[list(COLUMNS)]), name
        assert back.attrs["clock_offsets"] == {"encoder:1": 0} and back.attrs["clock_errors"] == {"encoder:1": 0}
    with pytest.raises(ValueError, match="parquet or .csv"):
        save_frame(frame, tmp_path / "s.xlsx")
    trace = json.loads(json.dumps(to_chrome_trace(frame, tmp_path / "t.json")))
    assert json.loads((tmp_path / "t.json").read_text()) == trace
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"], e["args"]["nbytes"]) for e in events] == [("vit", 0, 40, 7),
                                                                                       ("prefill", 50, 30, 0)]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"encoder:1", "prefill", "r part 0", "r"} <= names


def test_cluster_spans_line_up_one_request_across_processes(model, images):
    with Cluster(Topology(encoders=2, backend="mooncake", timeout=30)) as cluster, \
            cluster.receiver() as receiver:
        result = EPDPrefill(receiver, model).prefill("trace me", images)
        rid = result.rid
        frame = cluster.spans(rid, extra=result.spans)
        with httpx.Client() as client:
            clock = estimate_clock_offset(client, cluster.encoder_urls[0], force=True)
        everything = cluster.spans(extra=result.spans)
    nodes = set(frame.node)
    assert {"prefill"} < nodes and len({n for n in nodes if n.startswith("encoder:")}) == 2
    assert set(frame.request) == {rid}
    assert set(frame.attrs["clock_offsets"].values()) == {0}  # one host: CLOCK_MONOTONIC is shared
    by_part = frame[frame.part >= 0].groupby("part")
    assert sorted(by_part.groups) == [0, 1]
    for part, rows in by_part:
        stages = rows.set_index("stage")
        # on one timeline: the encoder's ViT ends before its write, and the write before the notification ends
        assert {"http_encode", "vit", "transfer", "notify", "http_send"} <= set(stages.index), part
        assert stages.loc["vit", "t_end_ns"] <= stages.loc["transfer", "t_start_ns"]
        assert stages.loc["transfer", "t_end_ns"] <= stages.loc["notify", "t_end_ns"]
        assert (rows.nbytes[rows.stage == "transfer"] > 0).all()
    assert frame.start_ms.min() == 0 and (frame.duration_ms >= 0).all()
    prefill = frame[frame.stage == "prefill"].iloc[0]
    # prefill waits for every part's notify: for its receipt, where the receiver's copy of the span ends. Not the
    # frame's end: the encoder's own copy ends once its send returned, which may come after the receipt.
    received = [s.t_end_ns for s in result.spans if s.stage == "notify"]
    assert len(received) == 2 and prefill.t_start_ns >= max(received)
    assert len(everything) >= len(frame) and rid in set(everything.request)
    # loopback: the estimate is off by at most half the shortest round trip
    assert abs(clock.offset_ns) <= clock.error_ns and clock.same_clock


SHIFT_S = 7


def _time_namespaces() -> tuple[bool, str]:
    try:
        probe = subprocess.run(["unshare", "--time", "--monotonic", "1", "true"], capture_output=True, text=True,
                               timeout=10)
    except OSError as exc:
        return False, str(exc)
    return probe.returncode == 0, probe.stderr.strip()


def test_an_encoder_on_another_clock_is_put_back_on_the_timeline(model, images, monkeypatch):
    """The encoder runs in its own time namespace, its CLOCK_MONOTONIC SHIFT_S ahead of ours (`unshare --time`:
    the kernel's own offset, as another host's clock would be): the offset /v1/clock measures brings its spans
    back between the receiver's, within the stated error, and the trace and the critical path show that error."""
    ok, why = _time_namespaces()
    if not ok:
        pytest.skip(f"no time namespaces here (unshare --time needs root and Linux >= 5.6): {why}")
    spawn = procs.spawn

    def shifted(cmd, log, env):  # this test's only: the encoder starts on the other clock
        if "epd_lab.servers.encoder" in cmd:
            cmd = ["unshare", "--time", "--monotonic", str(SHIFT_S), *cmd]
        return spawn(cmd, log, env)

    monkeypatch.setattr(procs, "spawn", shifted)
    with Cluster(Topology(encoders=1, timeout=30)) as cluster, cluster.receiver() as receiver:
        result = EPDPrefill(receiver, model).prefill("two clocks", images)
        frame = cluster.spans(result.rid, extra=result.spans)
    (node, clock), = frame.attrs["clocks"].items()
    assert not clock["same_clock"] and clock["error_ns"] == (clock["rtt_ns"] + 1) // 2 > 0
    assert abs(clock["offset_ns"] - SHIFT_S * 10**9) <= clock["error_ns"]  # the kernel's offset, within the error
    assert frame.attrs["clock_errors"] == {node: clock["error_ns"]}
    err = clock["error_ns"]
    for part, rows in frame[frame.part >= 0].groupby("part"):
        stages = rows.set_index("stage")
        assert stages.loc["vit", "node"] == node and stages.loc["http_encode", "node"] == "prefill", part
        # on our clock now, the encoder's work follows the receiver's calls that caused it: its ViT starts after
        # /encode was sent, its write lies inside /send, and prefill starts after the write
        assert stages.loc["http_encode", "t_start_ns"] - err <= stages.loc["vit", "t_start_ns"], part
        assert stages.loc["http_send", "t_start_ns"] - err <= stages.loc["transfer", "t_start_ns"], part
        assert stages.loc["transfer", "t_end_ns"] <= stages.loc["http_send", "t_end_ns"] + err, part
        assert stages.loc["transfer", "t_end_ns"] <= frame[frame.stage == "prefill"].t_start_ns.min() + err, part
    trace = to_chrome_trace(frame)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    # the track's name carries the measured offset and its error (7 s may read +6999.983 ms ± 0.403 ms)
    label, = (re.fullmatch(rf"{re.escape(node)} · clock ([+-][0-9.]+) ms ± ([0-9.]+) ms", n) for n in names
              if n.startswith(node))
    assert label is not None, names
    assert abs(float(label[1]) - SHIFT_S * 1e3) <= float(label[2]) + 1e-3, names  # ±1 µs: the label's rounding
    assert trace["otherData"]["clock_errors_ns"] == {node: err}
    path = critical_path(frame, result.rid, until=None)
    # a gap between the encoder's spans and the receiver's may be off by the error; a span's own length is exact
    assert path.clock_err_ms.max() == pytest.approx(err / 1e6) and (path.clock_err_ms[path.kind == "span"] == 0).all()


def test_a_dead_server_loses_its_spans_only(model, images):
    with Cluster(Topology(encoders=2, timeout=30)) as cluster, cluster.receiver() as receiver:
        result = EPDPrefill(receiver, model).prefill("then one dies", images)
        dead = cluster.encoder_urls[0]
        cluster.procs[0].kill()
        cluster.procs[0].wait()
        frame = cluster.spans(result.rid)
    assert list(frame.attrs["unreachable"]) == [dead] and "ConnectError" in frame.attrs["unreachable"][dead]
    assert len(frame.attrs["clocks"]) == 1 and result.rid in set(frame.request)


def test_tracing_off_cluster_records_nothing_and_answers_the_same(model, images):
    with Cluster(Topology(encoders=1, trace=False, timeout=30)) as cluster, cluster.receiver() as receiver:
        on = Recorder("prefill", enabled=True)
        result = EPDPrefill(receiver, model).prefill("quiet", images[:1])
        assert result.spans == [] and len(cluster.spans()) == 0
        assert httpx.get(cluster.encoder_urls[0] + "/v1/spans").json()["spans"] == []
    with Cluster(Topology(encoders=1, timeout=30)) as cluster, cluster.receiver(on) as receiver:
        traced = EPDPrefill(receiver, model).prefill("quiet", images[:1])
    assert traced.spans and torch.equal(traced.prefill.logits, result.prefill.logits)
