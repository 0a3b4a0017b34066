"""`epd-lab bench ab`: the A/B summary of `bench e2e --pairs` runs, on the H200 runs committed under data/bench/."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from epd_lab.bench.ab import crossover, run_row, summarize

BENCH = Path(__file__).resolve().parents[1] / "data" / "bench"


@pytest.mark.parametrize("folder", ["split-ab-h200", "fast-lane-ab-h200"])
def test_the_summary_of_committed_runs_equals_the_one_made_by_hand(folder):
    """Two A/Bs (two calls each, the order within a round reversed in the second) were summarised by hand;
    the command gives the same effects, positions and medians."""
    committed = json.loads((BENCH / folder / "summary.json").read_text())
    summary = summarize(sorted((BENCH / folder).glob("e2e-*.json")), {"base": "b", "head": "h"})
    for key in ("head_effect_ms", "second_in_round_effect_ms"):
        assert summary["crossover"][key] == pytest.approx(committed["crossover"][key], abs=0.002)
    positions = {r["file"]: r["position_in_round"] for r in committed["runs"]}
    assert {r["file"]: r["position_in_round"] for r in summary["runs"]} == positions
    for side in ("base", "head"):
        for key in ("split_minus_floor_less_spans_ms", "harness_c1_ms"):
            assert summary["by_side"][side][key]["median"] == pytest.approx(
                committed["by_side"][side][key]["median"], abs=0.002)
    assert summary["answers_equal_monolithic"] and summary["crossover"]["rounds"] == 4


def test_one_order_only_cannot_tell_the_order_from_the_head(tmp_path):
    """Runs whose rounds all put base first: the difference is reported, the order's effect is None."""
    rows = [run_row(p, {}) for p in sorted((BENCH / "fast-lane-ab-h200").glob("*call1-base-first.json"))]
    cross = crossover(rows)
    assert cross["second_in_round_effect_ms"] is None and cross["head_first_rounds"] == 0
    diffs = [h["split_minus_floor_less_spans_ms"] - b["split_minus_floor_less_spans_ms"]
             for b, h in zip(sorted((r for r in rows if r["side"] == "base"), key=lambda r: r["round"]),
                             sorted((r for r in rows if r["side"] == "head"), key=lambda r: r["round"]))]
    assert cross["head_effect_ms"] == pytest.approx(sum(diffs) / len(diffs), abs=0.001)
    with pytest.raises(ValueError, match="no round has both"):
        crossover([r for r in rows if r["side"] == "base"])


def test_the_command_writes_the_summary_and_refuses_a_folder_without_runs(tmp_path):
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, "-m", "epd_lab.cli", "bench", "ab", str(BENCH / "fast-lane-ab-h200"),
                           "--base", "d38ad3e", "--head", "c2c6432", "--json", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    assert summary["commits"] == {"base": "d38ad3e", "head": "c2c6432"} and len(summary["runs"]) == 8
    assert "4 rounds (2 with head first)" in done.stderr
    refused = subprocess.run([sys.executable, "-m", "epd_lab.cli", "bench", "ab", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "no ab run" in refused.stderr


def test_a_flags_ab_on_one_tree_gives_the_load_levels_too():
    """The `--gated-prefill` A/B at 5ebe8ea (AB_BASE=. AB_HEAD_ARGS=--gated-prefill): the head runs are
    the gated ones; levels above concurrency 1 come out per side with head over base of their medians, and
    load-only runs (no pairs) give no crossover."""
    folder = BENCH / "gated-prefill-policy-ab-h200"
    with_pairs = summarize(sorted((folder / "call1").glob("e2e-*.json")), {})
    assert {(r["side"], r["gated_prefill"]) for r in with_pairs["runs"]} == {("base", False), ("head", True)}
    assert with_pairs["crossover"]["rounds"] == 2 and with_pairs["crossover"]["head_first_rounds"] == 1
    load_only = summarize(sorted((folder / "call2").glob("e2e-*.json")), {})
    assert load_only["crossover"] is None and load_only["by_side"] == {}
    for summary in (with_pairs, load_only):
        assert set(summary["load"]) == {"4", "16"}
        for level in summary["load"].values():
            base, head = level["base"]["requests_per_s"], level["head"]["requests_per_s"]
            assert level["head_over_base"]["requests_per_s"] == pytest.approx(head["median"] / base["median"],
                                                                               abs=0.001)
    runs = load_only["runs"]
    four = sorted(r["load"]["4"]["ttft_p50_ms"] for r in runs if r["side"] == "head")
    assert load_only["load"]["4"]["head"]["ttft_p50_ms"] == {"median": four[1], "min": four[0], "max": four[2], "n": 3}
    committed = json.loads((folder / "call2" / "summary.json").read_text())
    assert committed["load"] == load_only["load"]


def test_the_spinners_ab_records_the_condition_per_run_and_the_committed_summaries_hold():
    """The `--keep-cpus-awake` A/Bs at 6f80aab and dc566ce (AB_HEAD_ARGS=--keep-cpus-awake): every head
    run recorded the CPUs it kept awake and no base run did; each call's committed summary is what the command gives
    from its runs, and its crossover has one round of each order."""
    calls = sorted(BENCH.glob("cpus-awake-ab-h200-*/call*"))
    assert len(calls) == 5
    for call in calls:
        summary = summarize(sorted(call.glob("e2e-*.json")), {})
        assert {(r["side"], bool(r["cpus_awake"])) for r in summary["runs"]} == {("base", False), ("head", True)}
        for run in call.glob("e2e-*.json"):  # the result names the CPUs: all 16 of the H200's host, or none
            kept = json.loads(run.read_text())["cpus_awake"]
            assert kept == (list(range(16)) if "-head-" in run.name else None)
        assert summary["crossover"]["rounds"] == 2 and summary["crossover"]["head_first_rounds"] == 1
        committed = json.loads((call / "summary.json").read_text())
        assert summary["crossover"]["head_effect_ms"] == pytest.approx(committed["crossover"]["head_effect_ms"],
                                                                       abs=0.002)
        assert summary["by_side"] == committed["by_side"] and summary["answers_equal_monolithic"]
