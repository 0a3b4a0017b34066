"""The `epd-lab` command line. Every command runs behind the user-error boundary (`epd_lab.boundary.guarded`): a
user's mistake is one line and exit status 2; ``epd-lab --debug`` shows the traceback."""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

from epd_lab.boundary import DEBUG_ENV, PROG, _debug, _one_line_usage_errors, guarded


# bench name → the module whose main() runs it (overload drives the campaign's client, so it lives there)
BENCHES: dict[str, str] = {
    **{name: f"epd_lab.bench.{name}" for name in ("transfer", "epd", "e2e", "trace", "vit", "http", "runtime")},
    "overload": "epd_lab.campaign.overload",
    "serve": "epd_lab.bench.serve",
    "ab": "epd_lab.bench.ab",
    "tp-kv": "epd_lab.bench.tp_kv",
}


def bench_summary(module: str) -> str:
    """The first sentence of `module`'s docstring, without its leading ```epd-lab bench X`:``, read from the
    source: importing the benches to list them would load torch (seconds)."""
    rel = Path(*module.split(".")[1:])
    root = Path(__file__).resolve().parent
    path = root / rel / "__init__.py" if (root / rel).is_dir() else root / rel.with_suffix(".py")
    try:
        with tokenize.open(path) as f:
            first = next(t for t in tokenize.generate_tokens(f.readline)
                         if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING))
    except (OSError, StopIteration, SyntaxError, tokenize.TokenError):
        return ""
    if first.type != tokenize.STRING:
        return ""
    text = " ".join(str(ast.literal_eval(first.string)).split("\n\n")[0].split())
    text = re.sub(r"^`[^`]*`:\s*", "", text)
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0].rstrip(".").replace("%", "%%")  # argparse %-formats help strings


def parser() -> argparse.ArgumentParser:
    """The top-level parser. Each command's own options are its module's (``add_help=False`` here passes
    ``--help`` on to it); `bench` is a group whose ``--help`` lists the benches."""
    ap = argparse.ArgumentParser(prog=PROG, description="EPD disaggregation workbench", allow_abbrev=False)
    ap.add_argument("--debug", action="store_true",
                    help=f"show an error's traceback, not its one line (roles started by launch inherit it: "
                         f"{DEBUG_ENV}=1)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name: str, help_: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, allow_abbrev=False, **kw)

    bench = add("bench", "benchmarks (epd-lab bench --help lists them)", description="Benchmarks; "
                "`epd-lab bench BENCH --help` gives a bench's options.")
    benches = bench.add_subparsers(dest="what", required=True, metavar="BENCH", title="benches")
    for name, module in BENCHES.items():
        benches.add_parser(name, help=bench_summary(module), add_help=False, allow_abbrev=False)
    add("encoder", "an encode server (FastAPI): /encode, /send, /scheduler_receive_url", add_help=False)
    add("launch", "start a topology on loopback (or on a Ray cluster: --ray ADDRESS) and keep it up until Ctrl-C",
        add_help=False)
    add("prefill-server", "a prefill server: E→P, then KV for decode", add_help=False)
    add("decode-server", "a decode server: pulls KV, generates, streams", add_help=False)
    add("proxy", "the OpenAI-compatible proxy in front of prefills and decodes", add_help=False)
    add("monolithic", "the whole model in one process behind OpenAI's chat API (the floor)", add_help=False)
    add("front", "round-robin over monolithic replicas: each request passed whole to one", add_help=False)
    add("status", "the processes of a running `epd-lab launch`: state, node, restarts", add_help=False)
    add("sweep", "run a papermill notebook over a parameter grid, collect sweep.csv", add_help=False)
    add("whatif", "the calibrated model of serving: calibrate, predict a rate sweep, compare", add_help=False)
    add("demo", "transfer engine, E→P, E→P→D on loopback; ends with an HTML report", add_help=False)
    add("campaign", "reliability campaign: load, soak, faults or fuzz, with a JSON + HTML report", add_help=False)
    add("rdma-info", "RDMA devices, ports and GIDs (pyverbs and the own binding)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of `epd-lab`."""
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    with _one_line_usage_errors(debug=_debug() or "--debug" in argv):
        args, rest = ap.parse_known_args(argv)
    if not args.debug:
        return guarded(lambda rest: _dispatch(ap, args, rest), rest)
    saved = os.environ.get(DEBUG_ENV)
    os.environ[DEBUG_ENV] = "1"  # for this process's guard, and for the roles `launch` starts
    try:
        return guarded(lambda rest: _dispatch(ap, args, rest), rest)
    finally:  # a caller in this process (a notebook, a test) keeps its environment
        if saved is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = saved


def _dispatch(ap: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    """Run the command `args` names with its own arguments `rest`."""
    import importlib

    if args.cmd == "bench":
        return importlib.import_module(BENCHES[args.what]).main(rest)
    if args.cmd == "launch":
        from epd_lab import supervisor

        return supervisor.main(rest)
    if args.cmd == "status":
        from epd_lab import supervisor

        return supervisor.status_main(rest)
    if args.cmd == "sweep":
        from epd_lab import sweep

        return sweep.main(rest)
    if args.cmd == "whatif":
        from epd_lab.whatif.cli import main as whatif

        return whatif(rest)
    if args.cmd in ("encoder", "prefill-server", "decode-server", "proxy", "monolithic", "front"):
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
        from epd_lab.transfer.rdma_info import format_rdma_info, rdma_info

        print(format_rdma_info(rdma_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
