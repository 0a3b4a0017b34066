"""Rank 0's side of a role's tensor-parallel group, whatever the role: the rank processes it starts, the ZMQ
sockets its steps go out on and the ranks' answers come back on, and which ranks are dead.

    ranks = RankProcesses("epd_lab.servers.prefill_tp", tp=2, timeout=10.0, args=["--model=..."])
    tp = ranks.join()                  # rank 0 in the gloo (or NCCL) group; each rank said it is ready
    seq = ranks.send(make_step)        # make_step(seq): the step, sent to every other rank, in one order
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
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import torch
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
        # answers filed by seq as they come, whichever thread waits for which step (steps may overlap: a KV
        # fetch runs beside decode steps); `_waited` are the seqs someone still waits for, the rest are dropped
        self._got: dict[int, dict[int, RankDone]] = {}
        self._waited: set[int] = {0}
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._reading = False
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

    def send(self, step_of: Callable[[int], msgspec.Struct]) -> int:
        """Send the step ``step_of(seq)`` builds for the next seq to every other rank (steps from several threads
        are numbered and sent one at a time); its seq, for `answers`. Raises RuntimeError when a rank is dead or
        takes no step within `timeout`."""
        if self.dead_ranks:
            raise RuntimeError(f"TP rank(s) {self.dead_ranks} of {self.tp} are dead")
        with self._send_lock:
            self.seq += 1
            step = encoder.encode(step_of(self.seq))
            with self._cond:
                self._waited.add(self.seq)
            for rank, sock in enumerate(self._steps, start=1):
                try:
                    sock.send(step, copy=False)
                except zmq.Again:
                    self.dead.add(rank)
                    self._forget(self.seq)
                    raise RuntimeError(f"TP rank {rank} of {self.tp} took no step within {self.timeout} s") from None
            return self.seq

    def post(self, message: bytes) -> None:
        """Send a message that has no answer (an abort) to every other live rank, never blocking."""
        with self._send_lock:
            for sock in self._steps:
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(message, zmq.NOBLOCK)

    def answers(self, seq: int, timeout: float | None = None) -> list[RankDone]:
        """Every other rank's `RankDone` of step `seq`, failed ones included (a failure of status >= 500 marks
        its rank dead), within `timeout` (default: the group's). Raises RuntimeError naming the ranks silent past
        it, or gone."""
        return self._collect(seq, self.timeout if timeout is None else timeout, f"step {seq}")

    def _collect(self, seq: int, timeout: float, what: str) -> list[RankDone]:
        deadline = time.monotonic() + timeout
        try:
            while True:
                with self._cond:
                    got = self._got.get(seq, {})
                    if len(got) == self.tp - 1:
                        return [got[r] for r in sorted(got)]
                    missing = sorted(set(range(1, self.tp)) - set(got))
                    reader = not self._reading
                    self._reading = self._reading or reader
                left = deadline - time.monotonic()
                gone = [r for r in missing if self._procs[r - 1].poll() is not None]
                if left <= 0 or gone:
                    self.dead.update(gone or missing)
                    why = "exited" if gone else f"did not answer within {timeout:.0f} s"
                    raise RuntimeError(f"TP rank(s) {gone or missing} of {self.tp} {why} ({what})")
                if reader:  # this thread reads the socket for everyone, a short while
                    try:
                        self._read(min(left, 0.05))
                    finally:
                        with self._cond:
                            self._reading = False
                            self._cond.notify_all()
                else:
                    with self._cond:
                        self._cond.wait(min(left, 0.05))
        finally:
            self._forget(seq)

    def _read(self, wait_s: float) -> None:
        """File the answers that arrive within `wait_s` by seq (those of a seq nobody waits for are dropped)."""
        while self._done.poll(int(wait_s * 1000)):
            done = _done_decoder.decode(self._done.recv())
            if done.error and done.status >= 500:
                self.dead.add(done.rank)
            with self._cond:
                if done.seq in self._waited:
                    self._got.setdefault(done.seq, {})[done.rank] = done
                    self._cond.notify_all()
            wait_s = 0

    def _forget(self, seq: int) -> None:
        with self._cond:
            self._waited.discard(seq)
            self._got.pop(seq, None)

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
    """A rank process's parser with the flags `RankProcesses` passes and the model's (``--model``, ``--dtype``,
    ``--device``: the role's own settings); the role adds its own."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=description)
    for flag in ("rank", "size"):
        ap.add_argument(f"--{flag}", type=int, required=True)
    for flag in ("init", "steps", "done"):
        ap.add_argument(f"--{flag}", required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    return ap


def kv_rank_arguments(description: str) -> argparse.ArgumentParser:
    """`rank_arguments` and a KV cache's rank's: its transfer engine (``--transport``, ``--host``) and cache size
    (``--kv-blocks``, ``--block-size``)."""
    ap = rank_arguments(description)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--kv-blocks", type=int, required=True)
    ap.add_argument("--block-size", type=int, required=True)
    return ap


def rank_flags(settings: Any, names: Sequence[str]) -> list[str]:
    """The role's `settings` named by `names` as a rank's flags (unset ones left out)."""
    return [f"--{k.replace('_', '-')}={getattr(settings, k)}" for k in names if getattr(settings, k) is not None]


def open_rank(args: argparse.Namespace, done: zmq.Socket, engine: bool = False,
              ) -> tuple[torch.device, Any, Any] | None:
    """The rank's device, model (as rank 0 opened them: one torch thread, the same kernels, the same bits) and, with
    `engine`, its transfer engine (``--transport``, ``--host``). None when any of them failed to open: rank 0 was
    told (its start fails with the reason) and the rank should exit."""
    from epd_lab import models
    from epd_lab.ep.messages import DTYPES
    from epd_lab.models.catalog import use_device
    from epd_lab.transfer import open_engine

    models.configure_torch(threads=1)
    try:
        device = use_device(args.device)
        model = models.open_model(args.model, dtype=DTYPES[args.dtype], device=device)
        return device, model, open_engine(args.transport, args.host, args.timeout) if engine else None
    except Exception as exc:  # noqa: BLE001 - any failure to start is rank 0's start failing
        done.send(encoder.encode(RankDone(0, args.rank, 0, 0, f"{type(exc).__name__}: {exc}", 500)))
        return None


def ready(args: argparse.Namespace, done: zmq.Socket, info: str = "") -> None:
    """Tell rank 0 this rank is ready (`RankDone` seq 0, with `info`)."""
    now = time.monotonic_ns()
    done.send(encoder.encode(RankDone(0, args.rank, now, now, info=info)))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A host tensor's bytes, for a step (raw in a msgpack struct, never pickle)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B") if tensor.numel() else memoryview(b"")


def tensor_from(data: bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """The tensor `tensor_bytes` sent (a copy: the message's buffer is read-only)."""
    if not data:
        return torch.empty(list(shape), dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(list(shape))


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
