"""The `epd-lab` command line."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of `epd-lab`."""
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="epd-lab", description="EPD disaggregation workbench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    bench = sub.add_parser("bench", help="benchmarks", add_help=False)
    bench.add_argument("what", choices=["transfer", "epd", "e2e", "trace", "vit", "http", "runtime",
                                        "overload", "serve", "ab"])
    sub.add_parser("encoder", help="an encode server (FastAPI): /encode, /send, /scheduler_receive_url", add_help=False)
    sub.add_parser("launch", help="start a topology on loopback (or on a Ray cluster: --ray ADDRESS) and keep it up "
                                  "until Ctrl-C", add_help=False)
    sub.add_parser("prefill-server", help="a prefill server: E→P, then KV for decode", add_help=False)
    sub.add_parser("decode-server", help="a decode server: pulls KV, generates, streams", add_help=False)
    sub.add_parser("proxy", help="the OpenAI-compatible proxy in front of prefills and decodes", add_help=False)
    sub.add_parser("monolithic", help="the whole model in one process behind OpenAI's chat API (the floor)",
                   add_help=False)
    sub.add_parser("front", help="round-robin over monolithic replicas: each request passed whole to one",
                   add_help=False)
    sub.add_parser("sweep", help="run a papermill notebook over a parameter grid, collect sweep.csv", add_help=False)
    sub.add_parser("demo", help="transfer engine, E→P, E→P→D on loopback; ends with an HTML report", add_help=False)
    sub.add_parser("campaign", help="reliability campaign: load, soak, faults or fuzz, with a JSON + HTML report",
                   add_help=False)
    sub.add_parser("rdma-info", help="RDMA devices, ports and GIDs (pyverbs and the own binding)")
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "bench":
        import importlib

        # overload drives the campaign's client, so it lives with the campaign (bench sits below campaign)
        package = "campaign" if args.what == "overload" else "bench"
        return importlib.import_module(f"epd_lab.{package}.{args.what}").main(rest)
    if args.cmd == "launch":
        from epd_lab import launch

        return launch.main(rest)
    if args.cmd == "sweep":
        from epd_lab import sweep

        return sweep.main(rest)
    if args.cmd in ("encoder", "prefill-server", "decode-server", "proxy", "monolithic", "front"):
        import importlib

        module = importlib.import_module(f"epd_lab.servers.{args.cmd.removesuffix('-server')}")
        return module.main(rest) or 0
    if args.cmd == "campaign":
        from epd_lab.campaign.run import main as campaign

        return campaign(rest)
    if args.cmd == "demo":
        from epd_lab import demo

        return demo.main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "rdma-info":
        from epd_lab.rdma_info import format_rdma_info, rdma_info

        print(format_rdma_info(rdma_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
