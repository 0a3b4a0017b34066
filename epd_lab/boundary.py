"""The boundary every entry point runs behind (`guarded`): the `epd-lab` command line and each role's own
``python -m`` main.

A user's mistake is one line on stderr and exit status 2, with no traceback: a bad flag (argparse's error, without
the usage block above it), a value the code refuses (`ValueError`), a system refusal (`OSError`: a busy port, a
missing file), a role server's start-up that failed on one of those (the model it could not open), or a role
that `launch` started and that failed so (its own line, with the role's name). ``epd-lab --debug`` (or
``EPD_DEBUG=1``, which the roles `launch` starts inherit) shows the traceback instead.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence

PROG = "epd-lab"
DEBUG_ENV = "EPD_DEBUG"
EXIT_USAGE = 2  # argparse's status for a usage error; the boundary uses it for every user error
# What the boundary reports as a user's mistake. A bug raising one of these shows as one line too: --debug shows it.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)
# The line a guarded process prints for a user error; a parent finds a failed child's reason by it
_ERROR_LINE = re.compile(rf"^{re.escape(PROG)}: error: (.+)$", re.MULTILINE)
_PORT_FLAG = re.compile(r"^(--[\w-]*port)(?:=(.*))?$")


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

