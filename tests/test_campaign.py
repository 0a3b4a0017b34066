"""`epd-lab campaign load` and `soak` through the real command line on tiny runs: the JSON has the report's
structure and every target holds; the HTML report is written; a bad count is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epd_lab.campaign.metrics import LEAK_GAUGES, pool_levels, refusal_counts
from epd_lab.campaign.report import compact, load_result, rows_path, runs_of
from epd_lab.campaign.soak import rss_growth

ROLES = {"encoder0", "prefill0", "decode0", "proxy"}


def campaign(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd_lab.cli", "campaign", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def check_report(out: Path, leg: str) -> dict:
    report = json.loads((out / f"{leg}.json").read_text())
    assert report["leg"] == leg and report["seed"] == 3
    assert report["targets"] and all({"target", "passed", "measured", "goal"} <= set(t) for t in report["targets"])
    failed = [t for t in report["targets"] if not t["passed"]]
    assert not failed, json.dumps(failed, indent=1)
    assert report["passed"] is True
    for run in report["runs"]:
        assert sum(run["counts"].values()) == run["sent"] == len(run["requests"])
        assert {"kind", "status", "latency_s", "matches", "t_start"} <= set(run["requests"][0])
        processes = {s["process"] for s in run["samples"]}
        metrics = {s["metric"] for s in run["samples"]}
        assert processes == ROLES
        # RSS and each role's pools were sampled over time
        assert {"rss_bytes", "embeddings_held", "kv_blocks_used", "inflight", "active_requests",
                "backend_inflight"} <= metrics
        assert len({s["t"] for s in run["samples"]}) >= 2
        assert run["idle_after_s"] is not None and not run["leaks_left"]
    html = (out / f"{leg}.html").read_text()
    assert "Targets" in html and "Plotly" in html and "PASS" in html
    return report


def test_campaign_load_cli(tmp_path):
    r = campaign("load", "--count", "8", "--concurrency", "4", "--topologies", "1E1P1D", "--seed", "3",
                 "--image-size", "112", "--max-tokens", "4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every target passed" in r.stdout and "answered" in r.stdout  # progress was printed
    report = check_report(tmp_path, "load")
    run = report["runs"][0]
    assert run["topology"] == "1E1P1D" and run["counts"] == {"ok": 8}
    assert all(req["matches"] for req in run["requests"])  # each answer equals its prompt's solo answer
    assert all(s["kind"] == "ok" for s in run["solo"])


def test_campaign_soak_cli(tmp_path):
    # enough requests for a few seconds of run: the RSS verdict needs samples (every 0.25 s) in its second half
    r = campaign("soak", "--count", "300", "--concurrency", "6", "--seed", "3", "--abort-share", "0.3",
                 "--bad-share", "0.2", "--image-size", "112", "--max-tokens", "6", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    report = check_report(tmp_path, "soak")
    run = report["runs"][0]
    tags = {req["tag"].split(":")[0] for req in run["requests"]}
    assert {"", "abort", "bad"} <= tags  # the seeded mix happened
    assert run["counts"].get("aborted", 0) > 0 and run["counts"].get("rejected", 0) > 0
    assert set(run["rss_growth_second_half"]) == ROLES


def test_campaign_refuses_a_bad_count(tmp_path):
    r = campaign("soak", "--count", "0", "--out", str(tmp_path), timeout=60)
    assert r.returncode != 0 and "--count must be positive" in r.stderr
    assert not (tmp_path / "soak.json").exists()


def test_pool_levels_reads_only_pool_gauges():
    m = 'model_name="m"'
    text = (f"# TYPE epd_lab:prefill_kv_blocks_used gauge\nepd_lab:prefill_kv_blocks_used{{{m}}} 3.0\n"
            f"# TYPE epd_lab:prefill_capacity gauge\nepd_lab:prefill_capacity{{{m}}} 36.0\n"
            "# TYPE epd_lab:proxy_backend_inflight gauge\n"
            f'epd_lab:proxy_backend_inflight{{{m},role="prefill",url="a"}} 1.0\n'
            f'epd_lab:proxy_backend_inflight{{{m},role="decode",url="b"}} 2.0\n'
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{m}}} 5.0\n"
            f"# TYPE epd_lab:decode_requests_finished counter\nepd_lab:decode_requests_finished_total{{{m}}} 9.0\n")
    assert pool_levels(text) == {"kv_blocks_used": 3.0, "backend_inflight": 3.0}
    assert "kv_blocks_used" in LEAK_GAUGES
    reserved = f"# TYPE epd_lab:decode_kv_blocks_reserved gauge\nepd_lab:decode_kv_blocks_reserved{{{m}}} 12.0\n"
    assert pool_levels(reserved) == {"kv_blocks_reserved": 12.0} and "kv_blocks_reserved" in LEAK_GAUGES


def test_refusal_counts_by_reason_keep_decode_kv_refusals_apart():
    m = 'model_name="m"'
    text = (f'# TYPE epd_lab:decode_refused counter\nepd_lab:decode_refused_total{{{m},reason="deadline"}} 2.0\n'
            f'epd_lab:decode_refused_total{{{m},reason="expired"}} 0.0\n'
            '# TYPE epd_lab:decode_kv_admission_refused counter\n'
            f'epd_lab:decode_kv_admission_refused_total{{{m},reason="deadline"}} 3.0\n'
            f'epd_lab:decode_kv_admission_refused_total{{{m},reason="expired"}} 1.0\n'
            '# TYPE epd_lab:refusals counter\n'  # the floor's summary of every refusal: not counted twice
            f'epd_lab:refusals_total{{{m},reason="admission_deadline"}} 2.0\n')
    assert refusal_counts(text) == {"deadline": 2.0, "kv_deadline": 3.0, "kv_expired": 1.0}


@pytest.mark.parametrize("values, expected", [([100, 100, 104, 105], 0.05), ([100, 120], 0.2), ([100], None)])
def test_rss_growth_over_the_second_half(values, expected):
    samples = [{"t": 10 + i, "process": "p", "metric": "rss_bytes", "value": v} for i, v in enumerate(values)]
    samples.append({"t": 1, "process": "p", "metric": "rss_bytes", "value": 1})  # first half: ignored
    got = rss_growth(samples, 10, 10 + len(values))["p"]
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_compact_moves_the_rows_and_load_result_joins_them(tmp_path):
    result = {"leg": "load", "targets": [], "runs": [{"topology": "1E1P1D", "counts": {"ok": 1},
                                                      "requests": [{"kind": "ok"}], "samples": [{"t": 0.0}]}]}
    path = tmp_path / "load.json"
    path.write_text(json.dumps(result))
    assert compact(path) == rows_path(path) and rows_path(path).exists()
    assert "requests" not in json.loads(path.read_text())["runs"][0]  # the summary alone
    assert load_result(path) == result
    assert compact(path) is None  # nothing left to move


def test_committed_campaign_runs_read_with_their_rows():
    """Every committed leg reads; a leg whose rows file is kept gets every run's requests and samples back from it,
    and one whose rows file is not kept (the large faults and soak legs: docs/campaign.md) keeps each run's
    summary (its counts and latency quantiles)."""
    data = Path(__file__).resolve().parents[1] / "data" / "bench"
    summaries = sorted(data.glob("campaign*/**/*.json"))
    assert any(rows_path(p).exists() for p in summaries)
    for path in summaries:
        result = load_result(path)
        for run in runs_of(result):
            if rows_path(path).exists():
                assert "requests" in run and "samples" in run, path
            else:
                assert "counts" in run and "latency_s" in run, path
