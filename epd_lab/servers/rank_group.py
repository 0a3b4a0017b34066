"""Rank 0's side of a role's tensor-parallel group, whatever the role: the rank processes it starts, the ZMQ
sockets its steps go out on and the ranks' answers come back on, and which ranks are dead.

    ranks = RankProcesses("epd_lab.servers.prefill_tp", tp=2, timeout=10.0, args=["--model=..."])
    tp = ranks.join()                  # rank 0 in the gloo (or NCCL) group; each rank said it is ready
    seq = ranks.send(encoded_step)     # to every other rank, in one order
    answers = ranks.answers(seq)       # each rank's `RankDone` of that step, or RuntimeError naming the rank

A rank process (``python -m <module> --rank r --size n --init ... --steps ... --done ...``, its own flags after)
answers `RankDone` with seq 0 once its model is loaded (its `info`: what rank 0 should know of it, e.g. its KV
side channel), then meets the group (`rank_sockets`, `rank_group`) and answers one `RankDone` per step. Steps and answers are msgpack structs,
never pickle. Faults: a rank that exits, fails a step or stays silent past `timeout` is dead from then on
(`dead_ranks`); the role's /health reports it and every later step is refused at once, instead of a collective
waiting for it. Ranks die with rank 0 (`die_with_parent`) and exit at `close` (a `Stop`, then SIGKILL).
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import msgspec
import zmq

from epd_lab.models.runtime.tp import TPGroup, rendezvous, tp_group
from epd_lab.procs import die_with_parent

MAX_STEP_BYTES = 1 << 30  # a step's payload (pixels, embeddings): far above any request a role admits


class RankDone(msgspec.Struct, tag="done", array_like=True):
    """A rank → rank 0: step `seq` (0: the rank is ready) ran from `t_start_ns` to `t_end_ns` (CLOCK_MONOTONIC),
    or failed (`error`, with an HTTP-like `status`: below 500 the request's fault, the group intact)."""

    seq: int
    rank: int
    t_start_ns: int
    t_end_ns: int
    error: str = ""
    status: int = 0
    info: str = ""


class Stop(msgspec.Struct, tag="stop", array_like=True):
    """Rank 0 → a rank: leave the group and exit."""


_done_decoder = msgspec.msgpack.Decoder(RankDone)
encoder = msgspec.msgpack.Encoder()


def _socket(kind: int, timeout: float) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_STEP_BYTES)
    return sock


def _bind(sock: zmq.Socket) -> str:
    sock.bind("tcp://127.0.0.1:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class RankProcesses:
    """Ranks 1..tp-1 of a group, as processes running ``python -m module`` with `args`; see the module docstring.
    A context manager.

    Args:
        module: the rank's module (its ``__main__`` reads `rank_arguments`).
        tp: ranks in the group (>= 2).
        timeout: seconds: every collective, every step's answers.
        args: the rank's own flags.
        start_timeout: seconds for every rank to load its model and say it is ready.
    """

    def __init__(self, module: str, tp: int, timeout: float, args: list[str], start_timeout: float = 120.0) -> None:
        if tp < 2:
            raise ValueError(f"a TP group of rank processes has at least 2 ranks, got {tp}")
        self.tp, self.timeout, self.start_timeout = tp, timeout, start_timeout
        self.seq = 0
        self.dead: set[int] = set()
        self.info: dict[int, str] = {}
        self._procs: list[subprocess.Popen] = []
        self._stack = contextlib.ExitStack()
        try:
            self._done = self._stack.enter_context(_socket(zmq.PULL, timeout))
            done_url = _bind(self._done)
            self._steps = [self._stack.enter_context(_socket(zmq.PUSH, timeout)) for _ in range(tp - 1)]
            self.init = rendezvous()
            for rank, sock in enumerate(self._steps, start=1):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, f"--rank={rank}", f"--size={tp}", f"--init={self.init}",
                     f"--steps={_bind(sock)}", f"--done={done_url}", f"--timeout={timeout}", *args],
                    stdin=subprocess.DEVNULL, preexec_fn=die_with_parent))
        except BaseException:
            self.close()
            raise

    def join(self) -> TPGroup:
        """Wait until every other rank said it is ready (its `info` kept), then join the group as rank 0: the
        ranks load their models first, so that the group's own bound (`timeout`, every collective's) is not
        spent on loading."""
        for done in self._collect(0, self.start_timeout, "start"):
            if done.error:
                raise RuntimeError(f"TP rank {done.rank} of {self.tp} failed to start: {done.error}")
            self.info[done.rank] = done.info
        return self._stack.enter_context(tp_group(0, self.tp, self.init, timeout_s=self.timeout))

    @property
    def dead_ranks(self) -> list[int]:
        """Ranks known dead: exited, failed a step or stayed silent."""
        self.dead.update(r for r, p in enumerate(self._procs, start=1) if p.poll() is not None)
        return sorted(self.dead)

    def send(self, step: bytes) -> int:
        """Send an encoded step to every other rank; its seq (the step's own `seq` field must be ``self.seq + 1``,
        see `next_seq`). Raises RuntimeError when a rank is dead or takes no step within `timeout`."""
        if self.dead_ranks:
            raise RuntimeError(f"TP rank(s) {self.dead_ranks} of {self.tp} are dead")
        self.seq += 1
        for rank, sock in enumerate(self._steps, start=1):
            try:
                sock.send(step, copy=False)
            except zmq.Again:
                self.dead.add(rank)
                raise RuntimeError(f"TP rank {rank} of {self.tp} took no step within {self.timeout} s") from None
        return self.seq

    def post(self, message: bytes) -> None:
        """Send a message that has no answer (an abort) to every other live rank, never blocking."""
        for sock in self._steps:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(message, zmq.NOBLOCK)

    @property
    def next_seq(self) -> int:
        """The seq the next `send` takes."""
        return self.seq + 1

    def answers(self, seq: int) -> list[RankDone]:
        """Every other rank's `RankDone` of step `seq`, failed ones included (a failure of status >= 500 marks
        its rank dead). Raises RuntimeError naming the ranks silent past `timeout`."""
        return self._collect(seq, self.timeout, f"step {seq}")

    def _collect(self, seq: int, timeout: float, what: str) -> list[RankDone]:
        got: dict[int, RankDone] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.tp - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not self._done.poll(int(min(left, 0.5) * 1000)):
                missing = sorted(set(range(1, self.tp)) - set(got))
                gone = [r for r in missing if self._procs[r - 1].poll() is not None]
                if left <= 0 or gone:
                    self.dead.update(gone or missing)
                    why = "exited" if gone else f"did not answer within {timeout:.0f} s"
                    raise RuntimeError(f"TP rank(s) {gone or missing} of {self.tp} {why} ({what})")
                continue
            done = _done_decoder.decode(self._done.recv())
            if done.seq != seq:
                continue  # a late answer to a step that failed
            if done.error and done.status >= 500:
                self.dead.add(done.rank)
            got[done.rank] = done
        return [got[r] for r in sorted(got)]

    def close(self) -> None:
        """Stop every rank (a Stop, then SIGKILL after `timeout`), leave the group. Idempotent."""
        self.post(encoder.encode(Stop()))
        for p in self._procs:
            try:
                p.wait(self.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        self._stack.close()

    def __enter__(self) -> "RankProcesses":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rank_arguments(description: str) -> argparse.ArgumentParser:
    """A rank process's parser with the flags `RankProcesses` passes; the role adds its own."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=description)
    for flag in ("rank", "size"):
        ap.add_argument(f"--{flag}", type=int, required=True)
    for flag in ("init", "steps", "done"):
        ap.add_argument(f"--{flag}", required=True)
    ap.add_argument("--timeout", type=float, required=True)
    return ap


@contextlib.contextmanager
def rank_sockets(args: argparse.Namespace) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A rank's step socket (PULL) and answer socket (PUSH), closed on exit."""
    with _socket(zmq.PULL, args.timeout) as steps, _socket(zmq.PUSH, args.timeout) as done:
        steps.connect(args.steps)
        done.connect(args.done)
        yield steps, done


def rank_group(args: argparse.Namespace) -> contextlib.AbstractContextManager[TPGroup]:
    """This rank's place in the group (after it said it is ready: see `RankProcesses.join`)."""
    return tp_group(args.rank, args.size, args.init, timeout_s=args.timeout)
