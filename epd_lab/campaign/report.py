"""A campaign leg's report: ``<out>/<leg>.json`` (everything the leg measured) and ``<out>/<leg>.html`` (one
self-contained page through `epd_lab.viz.report.html_report`: the targets with pass/fail, counts per outcome,
the latency distribution, pool levels and RSS over time).

A leg's result is a dict with ``leg``, ``targets`` (``{target, passed, measured, goal}``), ``passed``, and its
runs under ``runs`` (load, soak) or ``cells`` (faults), each with ``counts``, ``requests`` (`Outcome` records)
and ``samples`` (``{t, process, metric, value}``); a leg without runs (fuzz) gets its targets and counts.

A committed run keeps its summary readable and its rows small: `compact` moves the runs' ``requests`` and
``samples`` (most of the bytes) into ``<leg>.rows.json.gz``; `load_result` joins them again, and
``python -m epd_lab.campaign.report html <leg>.json`` rebuilds the HTML page from the two.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from epd_lab.viz.report import Section, html_report


def _label(run: dict[str, Any], i: int) -> str:
    return str(run.get("topology") or run.get("cell") or run.get("name") or i)


def runs_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The leg's runs (load, soak) or cells (faults)."""
    return list(result.get("runs") or result.get("cells") or [])


def _targets_frame(result: dict[str, Any]) -> pd.DataFrame:
    rows = [{"target": t["target"], "result": "PASS" if t["passed"] else "FAIL", "goal": t.get("goal", ""),
             "measured": json.dumps(t.get("measured"), default=str)[:300]} for t in result.get("targets", [])]
    return pd.DataFrame(rows, columns=["target", "result", "goal", "measured"])


def _counts_frame(runs: list[dict[str, Any]]) -> pd.DataFrame:
    rows = [{"run": _label(r, i), **r.get("counts", {})} for i, r in enumerate(runs)]
    return pd.DataFrame(rows).fillna(0).set_index("run") if rows else pd.DataFrame()


def _latency_figure(runs: list[dict[str, Any]]) -> go.Figure:
    fig = go.Figure()
    for i, run in enumerate(runs):
        for kind in sorted({r["kind"] for r in run.get("requests", [])}):
            lat = [r["latency_s"] for r in run["requests"] if r["kind"] == kind]
            fig.add_trace(go.Box(y=lat, name=f"{_label(run, i)} {kind} (n={len(lat)})", boxpoints="outliers"))
    fig.update_layout(yaxis_title="latency (s)", showlegend=False, height=460)
    return fig


def _series_figure(run: dict[str, Any], label: str, rss: bool) -> go.Figure | None:
    samples = [s for s in run.get("samples", []) if (s["metric"] == "rss_bytes") == rss]
    if not samples:
        return None
    frame = pd.DataFrame(samples)
    fig = go.Figure()
    for (process, metric), part in frame.groupby(["process", "metric"], sort=True):
        values = part["value"] / (1 << 20) if rss else part["value"]
        if not rss and not values.any():
            continue  # a pool that stayed at 0 throughout: one line fewer
        fig.add_trace(go.Scatter(x=part["t"], y=values, mode="lines",
                                 name=process if rss else f"{process}.{metric}"))
    fig.update_layout(title=f"{label}: {'RSS (MiB)' if rss else 'pool levels'} over time", xaxis_title="s",
                      yaxis_title="MiB" if rss else "level", height=420)
    return fig


def sections(result: dict[str, Any]) -> list[Section]:
    """The HTML report's sections for a leg's result."""
    runs = runs_of(result)
    verdict = "every target PASSED" if result.get("passed") else "some targets FAILED"
    out: list[Section] = [("Verdict", f"{result['leg']}: {verdict}. Seed {result.get('seed')}; parameters "
                                      f"{json.dumps(result.get('parameters', {}))}."),
                          ("Targets", _targets_frame(result))]
    if runs:
        out.append(("Counts per outcome", _counts_frame(runs)))
        if any(r.get("requests") for r in runs):
            out.append(("Latency by outcome", _latency_figure(runs)))
        for i, run in enumerate(runs):
            if "reproduce" in run:
                out.append((f"{_label(run, i)}: reproduce", f"seed {run.get('seed')}: {run['reproduce']}"))
            for rss in (False, True):
                fig = _series_figure(run, _label(run, i), rss)
                if fig is not None:
                    out.append((f"{_label(run, i)}: {'RSS' if rss else 'pool levels'}", fig))
    elif "counts" in result:
        out.append(("Counts", pd.DataFrame([result["counts"]])))
    if result.get("not_measured"):
        out.append(("Not measured", result["not_measured"]))
    if result.get("machine"):
        out.append(("Machine", json.dumps(result["machine"], indent=1, default=str)))
    return out


def write_report(result: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``<out_dir>/<leg>.json`` and ``<out_dir>/<leg>.html``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    leg = result["leg"]
    json_path = out / f"{leg}.json"
    json_path.write_text(json.dumps(result, indent=1, default=_plain) + "\n")
    html_path = html_report(sections(result), out / f"{leg}.html", f"epd-lab campaign {leg}")
    return json_path, html_path


def _plain(value: object) -> object:
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


ROWS = ("requests", "samples")  # ~98% of the committed legs' bytes; only the HTML page reads them


def rows_path(json_path: str | Path) -> Path:
    """Where `compact` puts the rows of ``<leg>.json``: ``<leg>.rows.json.gz`` beside it."""
    path = Path(json_path)
    return path.with_name(f"{path.stem}.rows.json.gz")


def compact(json_path: str | Path) -> Path | None:
    """Move the runs' ``requests`` and ``samples`` out of ``<leg>.json`` into ``<leg>.rows.json.gz``, leaving the
    summary (targets, counts, latency quantiles, levels) as JSON. Returns the rows file, or None where the
    result has no rows (fuzz, or already compacted)."""
    path = Path(json_path)
    result = json.loads(path.read_text())
    rows = [{key: run.pop(key) for key in ROWS if key in run} for run in runs_of(result)]
    if not any(rows):
        return None
    out = rows_path(path)
    # mtime=0: the same rows give the same bytes, so re-compacting does not churn git
    out.write_bytes(gzip.compress(json.dumps(rows).encode(), compresslevel=9, mtime=0))
    path.write_text(json.dumps(result, indent=1) + "\n")
    return out


def load_result(json_path: str | Path) -> dict[str, Any]:
    """A leg's result as `write_report` wrote it: ``<leg>.json`` with its rows put back from
    ``<leg>.rows.json.gz`` where `compact` moved them."""
    path = Path(json_path)
    result = json.loads(path.read_text())
    rows_file = rows_path(path)
    if rows_file.exists():
        for run, rows in zip(runs_of(result), json.loads(gzip.decompress(rows_file.read_bytes())), strict=True):
            run.update(rows)
    return result


def main(argv: list[str] | None = None) -> None:
    """``compact <leg>.json ...`` before committing a run; ``html <leg>.json --out DIR`` to rebuild its page."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m epd_lab.campaign.report", description=main.__doc__)
    ap.add_argument("action", choices=("compact", "html"))
    ap.add_argument("paths", nargs="+", type=Path, help="legs' JSON files")
    ap.add_argument("--out", type=Path, default=Path("out/campaign"), help="html: folder for <leg>.html")
    args = ap.parse_args(argv)
    for path in args.paths:
        if args.action == "compact":
            print(f"{path}: rows in {compact(path) or 'none'}")
        else:
            result = load_result(path)
            print(html_report(sections(result), args.out / f"{path.stem}.html", f"epd-lab campaign {result['leg']}"))


if __name__ == "__main__":
    main()
