"""`epd-lab bench ab`: the summary of a before/after of `bench e2e --pairs` runs (`scripts/gpu_e2e.sh ab`).

    epd-lab bench ab data/bench/fast-lane-ab-h200 --base d38ad3e --head c2c6432 --json data/bench/fast-lane-ab-h200/summary.json

Each run is one `bench e2e` JSON named ``...-ab-<side>-r<round>[-<call>].json`` (side ``base`` or ``head``). The two
runs of one round (the same name but for the side) are paired, and which ran second is read from their ``created``
times. On the H200 the side that ran second in a round did worse, by 0.17-0.48 ms in three A/Bs of 2026-12-03, and
moved by -0.44 to +0.92 ms in later ones (docs/gpu-results.md), so the difference per round is fitted as
``head - base = head_effect + second_effect * s``, with ``s`` +1 where head ran second and -1 where base did (least squares
over the rounds; with both orders equally often this is the mean difference and half the order's contrast). Per
side: the medians of each run's paired split - floor - transfer spans, split - floor, the two TTFTs, the harness at
concurrency 1 (`proxy_parse`, `intake`, `reassemble` and the gaps on the critical path), its `prefill` span and the
largest gaps. Runs with levels above concurrency 1 (``CONCURRENCY=1,4,16``, or load-only runs without pairs) also
give ``load``: per level, each side's requests/s and TTFT p50/p90 over its runs, and head over base of their
medians. A flag's A/B on one tree (``AB_BASE=. AB_HEAD_ARGS=--gated-prefill``) is summarised the same way.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

NAME = re.compile(r"(?P<stem>.*)-ab-(?P<side>base|head)-r(?P<round>\d+)(?P<call>.*)\.json")
HARNESS_STAGES = ("proxy_parse", "intake", "reassemble", "gap")
# notify→prefill: a gated prefill's span starts as the last notify lands (no reassemble span with --gated-prefill)
GAPS = ("kv_write→end", "intake→intake", "proxy_parse→intake", "notify→reassemble", "notify→prefill")


def run_row(path: Path, commits: dict[str, str]) -> dict[str, Any]:
    """One run's row: its side, round, call, the paired and critical-path medians (ms) of its mooncake split at
    concurrency 1 (where the run has pairs) and its mooncake split's requests/s and TTFT under load (``load``, by
    concurrency above 1)."""
    match = NAME.fullmatch(path.name)
    if match is None:
        raise ValueError(f"{path.name}: not an ab run (...-ab-base-r1.json or ...-ab-head-r2-call1.json)")
    data = json.loads(path.read_text())
    row = {"file": path.name, "side": match["side"], "round": int(match["round"]), "call": match["call"].lstrip("-"),
           "key": f"{match['stem']}-r{match['round']}{match['call']}", "created": data["created"],
           "commit": commits.get(match["side"]), "gated_prefill": data.get("gated_prefill", False),
           "cpus_awake": bool(data.get("cpus_awake")),
           "answers_equal_monolithic": data["answers_equal_monolithic"],
           "load": {str(r["concurrency"]): {"requests_per_s": round(r["requests_per_s"], 3),
                                            "ttft_p50_ms": round(r["ttft_ms"]["p50"], 3),
                                            "ttft_p90_ms": round(r["ttft_ms"]["p90"], 3)}
                    for r in data["rows"] if r["path"] == "epd/mooncake" and r["concurrency"] > 1}}
    if not data.get("paired"):  # a load-only run (no --pairs)
        return row
    paired = data["paired"][0]
    c1 = next(r for r in data["rows"] if r["path"] == "epd/mooncake" and r["concurrency"] == 1)
    path_ms = {c["stage"]: c["median_ms"] for c in c1["critical_path"]}
    return {**row, "pairs": paired["pairs"],
            **{f"{k}_ms": round(paired[f"{k}_ms"]["p50"], 3) for k in (
                "split_minus_floor_less_spans", "split_minus_floor", "transfer_spans")},
            "paired_split_ttft_ms": round(paired["split_ttft_ms"]["p50"], 3),
            "paired_floor_ttft_ms": round(paired["floor_ttft_ms"]["p50"], 3),
            "harness_c1_ms": round(sum(path_ms.get(stage, 0.0) for stage in HARNESS_STAGES), 3),
            "prefill_c1_ms": round(path_ms["prefill"], 3),
            "gaps_c1_ms": {g["between"]: round(g["median_ms"], 3) for g in c1["gaps"]}}


def crossover(rows: list[dict[str, Any]], measure: str = "split_minus_floor_less_spans_ms") -> dict[str, Any]:
    """The head and second-in-round effects on `measure` (see the module docstring); each round's position filled
    into its rows (``position_in_round``). A round without both sides is left out; with every round in one order
    the two effects cannot be told apart and ``second_in_round_effect_ms`` is None."""
    rounds: dict[str, dict[str, dict]] = {}
    for row in rows:
        rounds.setdefault(row["key"], {})[row["side"]] = row
    diffs, signs = [], []
    for pair in rounds.values():
        if set(pair) != {"base", "head"}:
            continue
        first, second = sorted(pair.values(), key=lambda r: r["created"])
        first["position_in_round"], second["position_in_round"] = 1, 2
        diffs.append(pair["head"][measure] - pair["base"][measure])
        signs.append(1 if second["side"] == "head" else -1)
    if not diffs:
        raise ValueError("no round has both a base and a head run")
    n, sum_s, sum_d = len(diffs), sum(signs), sum(diffs)
    sum_ss, sum_sd = sum(s * s for s in signs), sum(s * d for s, d in zip(signs, diffs))
    det = n * sum_ss - sum_s * sum_s
    if det == 0:  # one order only
        head, second = sum_d / n, None
    else:
        head = (sum_ss * sum_d - sum_s * sum_sd) / det
        second = round((n * sum_sd - sum_s * sum_d) / det, 3)
    return {"measure": measure, "rounds": n, "head_first_rounds": signs.count(-1),
            "head_effect_ms": round(head, 3), "second_in_round_effect_ms": second}


def _stats(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values), "n": len(values)}


def load_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per concurrency above 1: each side's requests/s and TTFT p50/p90 over its runs (`_stats`), and head over
    base of their medians."""
    out: dict[str, Any] = {}
    for conc in sorted({c for r in rows for c in r["load"]}, key=int):
        sides: dict[str, Any] = {}
        for side in ("base", "head"):
            levels = [r["load"][conc] for r in rows if r["side"] == side and conc in r["load"]]
            if levels:
                sides[side] = {k: _stats([level[k] for level in levels])
                               for k in ("requests_per_s", "ttft_p50_ms", "ttft_p90_ms")}
        if len(sides) == 2:
            sides["head_over_base"] = {k: round(sides["head"][k]["median"] / sides["base"][k]["median"], 3)
                                       for k in sides["head"]}
        out[conc] = sides
    return out


def summarize(files: list[Path], commits: dict[str, str]) -> dict[str, Any]:
    """The summary of the ab runs in `files` (see the module docstring); `commits` names each side's commit.
    ``crossover`` and ``by_side`` come from the runs with pairs at concurrency 1 (None when none has), ``load``
    from every run's levels above 1."""
    rows = [run_row(path, commits) for path in sorted(files)]
    paired = [r for r in rows if "pairs" in r]
    if not paired and not any(r["load"] for r in rows):
        raise ValueError("no run has pairs at concurrency 1 or levels above it")
    cross = crossover(paired) if paired else None
    by_side = {}
    for side in ("base", "head"):
        mine = [r for r in paired if r["side"] == side]
        if not mine:
            continue
        by_side[side] = {k: _stats([r[k] for r in mine]) for k in (
            "split_minus_floor_less_spans_ms", "split_minus_floor_ms", "paired_split_ttft_ms",
            "paired_floor_ttft_ms", "harness_c1_ms", "prefill_c1_ms")}
        by_side[side].update({f"gap {g} ms": _stats([r["gaps_c1_ms"][g] for r in mine if g in r["gaps_c1_ms"]])
                              for g in GAPS if any(g in r["gaps_c1_ms"] for r in mine)})
    return {"commits": commits, "by_side": by_side, "crossover": cross, "load": load_summary(rows),
            "answers_equal_monolithic": all(r["answers_equal_monolithic"] for r in rows),
            "runs": [{k: v for k, v in r.items() if k != "key"} for r in rows]}


def main(argv: list[str] | None = None) -> int:
    """``epd-lab bench ab DIR ...``: see the module docstring."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="epd-lab bench ab", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="a folder of ...-ab-{base,head}-r<round>[-<call>].json runs")
    ap.add_argument("--base", default=None, help="the base side's commit")
    ap.add_argument("--head", default=None, help="the head side's commit")
    ap.add_argument("--json", default=None, help="write the summary here (else print it)")
    args = ap.parse_args(argv)
    files = sorted(p for p in Path(args.dir).glob("*.json") if NAME.fullmatch(p.name))
    if not files:
        ap.error(f"no ab run in {args.dir}")
    try:
        summary = summarize(files, {"base": args.base, "head": args.head})
    except ValueError as exc:
        ap.error(str(exc))
    text = json.dumps(summary, indent=1, ensure_ascii=False) + "\n"
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text, end="")
    c = summary["crossover"]
    if c is not None:
        print(f"{c['rounds']} rounds ({c['head_first_rounds']} with head first): head {c['head_effect_ms']:+.3f} ms, "
              f"second in a round {c['second_in_round_effect_ms']} ms", file=sys.stderr)
    for conc, sides in summary["load"].items():
        if "head_over_base" in sides:
            ratio = sides["head_over_base"]
            print(f"{conc} in flight: head/base requests/s {ratio['requests_per_s']:.3f}, TTFT p50 "
                  f"{ratio['ttft_p50_ms']:.3f}, p90 {ratio['ttft_p90_ms']:.3f} (medians of "
                  f"{sides['base']['requests_per_s']['n']} and {sides['head']['requests_per_s']['n']} runs)",
                  file=sys.stderr)
    return 0
