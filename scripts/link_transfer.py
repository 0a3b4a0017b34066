"""Does a shaped link cost what the model says? The E→P transfer span against ``bytes / rate + t0``.

The encoder runs on an emulated host (a network namespace, `epd_lab.campaign.netns`), the receiver (the
prefill side) in this process on the bridge; E→P goes over tcp, through the encoder host's uplink, which
`Hosts.shape` limits with tbf. Rounds alternate the rates (unshaped first), so slow drifts of this shared
machine's load spread over all of them. ``t0`` is the median span on the unshaped link: the round trip of the
write's acknowledgement and the transfer's fixed costs. Needs root (network namespaces). Prints one JSON object;
`--out` writes it.

    .venv/bin/python scripts/link_transfer.py --rates 25,50,100 --out data/bench/link-transfer.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from epd_lab.bench import write_json
from epd_lab.campaign import netns
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info
from epd_lab.noise import random_png
from epd_lab.trace import Recorder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="25,50,100", help="link rates in Mbit/s, comma-separated")
    ap.add_argument("--side", type=int, default=448, help="the image's side in pixels (sets the embedding's bytes)")
    ap.add_argument("--rounds", type=int, default=15, help="transfers per rate")
    ap.add_argument("--burst", type=int, default=4096, help="tbf burst in bytes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    ok, why = netns.available()
    if not ok:
        sys.exit(f"network namespaces unavailable: {why}")
    spans: dict[str, list[float]] = {"unshaped": [], **{str(r): [] for r in rates}}
    nbytes: set[int] = set()
    with tempfile.TemporaryDirectory() as tmp, netns.Hosts(["e"]) as hosts:
        image = str(Path(tmp) / "link.png")  # the encoders serve files under the temp folder
        Path(image).write_bytes(random_png(1, args.side))
        placed = {"encoder0": (hosts.netns("e"), hosts.address("e"))}
        recorder = Recorder("prefill")
        with Cluster(Topology(encoders=1, transport="tcp", hosts=placed, timeout=30)) as cluster, \
                cluster.receiver(recorder, host=hosts.root) as receiver:
            for _ in range(3):  # warm: the first requests pay for connections and lazy set-up
                receiver.receive([image])
            for _ in range(args.rounds):
                for rate in [None, *rates]:
                    hosts.shape("e", rate, args.burst)
                    rid = receiver.receive([image]).rid
                    (span,) = [s for s in recorder.spans(rid) if s.stage == "transfer"]
                    nbytes.add(span.nbytes)
                    spans["unshaped" if rate is None else str(rate)].append(span.duration_ms)
            hosts.shape("e", None)
    (size,) = nbytes
    t0 = statistics.median(spans["unshaped"])
    rows = []
    for rate in rates:
        got = spans[str(rate)]
        model = size * 8 / (rate * 1e6) * 1e3 + t0
        median = statistics.median(got)
        rows.append({"rate_mbit": rate, "model_ms": model, "median_ms": median, "min_ms": min(got), "max_ms": max(got),
                     "error_pct": 100 * (median - model) / model, "within_15pct": abs(median - model) <= 0.15 * model})
    result = {
        "what": "E→P transfer span (tcp, encoder in a network namespace, its uplink shaped with tbf) against "
                "bytes / rate + t0, t0 = the median span unshaped",
        "machine": machine_info(), "shared": "2 vCPUs shared with other sessions' work", "bytes": size,
        "image_side": args.side, "burst_bytes": args.burst, "rounds": args.rounds,
        "t0_ms": {"median": t0, "min": min(spans["unshaped"]), "max": max(spans["unshaped"])},
        "target": "median within 15% of the model at each rate", "rows": rows,
        "all_within_15pct": all(r["within_15pct"] for r in rows),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(str(args.out), result)


if __name__ == "__main__":
    main()
