"""The `epd-lab` command line, and the boundary every entry point runs behind (`guarded`).

A user's mistake is one line on stderr and exit status 2, with no traceback: a bad flag (argparse's error, without
the usage block above it), a value the code refuses (`ValueError`), a system refusal (`OSError`: a busy port, a
missing file), a role server's start-up that failed on one of those (the model it could not open), or a role
that `launch` started and that failed so (its own line, with the role's name). ``epd-lab --debug`` (or
``EPD_DEBUG=1``, which the roles `launch` starts inherit) shows the traceback instead.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import errno
import gc
import logging
import os
import re
import sys
import tokenize
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

PROG = "epd-lab"
DEBUG_ENV = "EPD_DEBUG"
EXIT_USAGE = 2  # argparse's status for a usage error; the boundary uses it for every user error
# What the boundary reports as a user's mistake. A bug raising one of these shows as one line too: --debug shows it.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)
# The line a guarded process prints for a user error; a parent finds a failed child's reason by it
_ERROR_LINE = re.compile(rf"^{re.escape(PROG)}: error: (.+)$", re.MULTILINE)
_PORT_FLAG = re.compile(r"^(--[\w-]*port)(?:=(.*))?$")

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
    add("sweep", "run a papermill notebook over a parameter grid, collect sweep.csv", add_help=False)
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
        from epd_lab import launch

        return launch.main(rest)
    if args.cmd == "sweep":
        from epd_lab import sweep

        return sweep.main(rest)
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
        from epd_lab.rdma_info import format_rdma_info, rdma_info

        print(format_rdma_info(rdma_info()))
    return 0


def guarded(entry: Callable[[list[str]], int | None], argv: Sequence[str]) -> int:
    """Run ``entry(argv)`` (an entry point's main) behind the user-error boundary and return its exit status: a
    user's mistake (see the module's docstring) is printed as ``epd-lab: error: <what, and the way out>`` and
    gives 2. With ``EPD_DEBUG`` set, `entry` runs bare: tracebacks as Python prints them."""
    argv = list(argv)
    if _debug():
        return entry(argv) or 0
    lifespan = _LifespanFailure()
    with _one_line_usage_errors(), lifespan.watching():
        try:
            status = entry(argv) or 0
        except USER_ERRORS + (RuntimeError,) as exc:
            message = _user_message(exc, argv)
            if message is None:
                raise
            return _fail(message)
        except SystemExit:
            if lifespan.error is None:
                raise
            return _fail(_user_message(lifespan.error, argv) or str(lifespan.error))
        if lifespan.error is not None:  # a lifespan that failed and a server that returned rather than exited
            return _fail(_user_message(lifespan.error, argv) or str(lifespan.error))
        return status


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _user_message(exc: BaseException, argv: Sequence[str]) -> str | None:
    """The one line for `exc` if it is a user's mistake, else None (a bug: its traceback stays)."""
    text = str(exc)
    child = _ERROR_LINE.findall(text)
    if child:  # a role started by `launch` said why it stopped: name the role (the message's head) and that
        head = text.split("\n", 1)[0].split("; log:", 1)[0].rstrip(":; ")
        return f"{head}: {child[-1]}"
    if not isinstance(exc, USER_ERRORS):
        return None
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return _busy_port_message(exc, argv)
    if isinstance(exc, OSError) and exc.strerror:  # "[Errno 2] No such file ..." without the number
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return text or type(exc).__name__


def _busy_port_message(exc: OSError, argv: Sequence[str]) -> str:
    """A bind that failed on a busy port, named by the flag that gave it (ports default to 0 everywhere, so a
    busy one came from the command line; the OSError itself does not say which port)."""
    given: list[tuple[str, str]] = []
    for i, arg in enumerate(argv):
        if m := _PORT_FLAG.match(arg):
            value = m.group(2) if m.group(2) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
            given.append((m.group(1), value))
    if len(given) == 1:
        flag, value = given[0]
        return (f"{flag} {value}: port {value} is already in use; pick another port, or {flag} 0 to let the "
                f"OS choose one")
    named = ", ".join(f"{flag} {value}" for flag, value in given) or "a port this command binds"
    return (f"{exc.strerror or exc} ({named}); pick other ports, or 0 to let the OS choose one")


@contextlib.contextmanager
def _one_line_usage_errors(debug: bool = False) -> Iterator[None]:
    """argparse's errors as one line that ends with where the options are, for every parser (each module builds
    its own) while the block runs: argparse prints the usage first, as long as the command's options (launch's
    is 30 lines), which buries the one line that says what is wrong."""
    if debug:
        yield
        return
    original = argparse.ArgumentParser.error

    def error(self: argparse.ArgumentParser, message: str) -> None:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]


class _LifespanFailure(logging.Filter):
    """A role server's lifespan (its start-up: the model load) that failed on a user error. uvicorn catches the
    exception, logs its traceback and exits with status 3 (and asyncio then logs that exit as a second
    traceback): this keeps the exception for `guarded` and drops both logs. Other failures, bugs, are logged
    as before."""

    def __init__(self) -> None:
        super().__init__()
        self.error: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        """False for the records this failure would print; the exception is kept."""
        if self.error is None and record.name == "uvicorn.error" and record.levelno >= logging.ERROR:
            # logged from inside the except block of Starlette's lifespan, so the exception is still current
            exc = sys.exc_info()[1]
            if isinstance(exc, USER_ERRORS) and record.getMessage().startswith("Traceback"):
                self.error = exc
                return False
        if self.error is None:
            return True
        if record.name == "uvicorn.error":
            return record.getMessage() != "Application startup failed. Exiting."
        return not (record.exc_info and isinstance(record.exc_info[1], SystemExit))  # asyncio's "never retrieved"

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Filter uvicorn's and asyncio's logs while the block runs."""
        loggers = [logging.getLogger("uvicorn.error"), logging.getLogger("asyncio")]
        for logger in loggers:
            logger.addFilter(self)
        try:
            yield
        finally:
            if self.error is not None:
                gc.collect()  # the failed server task is logged when collected: now, while filtered
            for logger in loggers:
                logger.removeFilter(self)


if __name__ == "__main__":
    sys.exit(main())
