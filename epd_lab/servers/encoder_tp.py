"""An encoder role as a tensor-parallel group (seed 000's encoder TP): the encode server is rank 0; ranks 1..tp-1
are processes it starts, which hold their shard of the vision tower and nothing else.

    group = EncoderTPGroup(model, tp=2, timeout=10.0)   # starts rank 1, meets it over gloo
    emb = group.encode(pixel_values, image_grid_thw)     # rank 0's answer; rank 1 ran its shard beside it
    group.close()

Each ViT call on rank 0 is first sent to every other rank over ZMQ (an `EncodeStep`: the preprocessed pixels as
raw bytes in a msgpack struct, never pickle; the images are read and decoded once, on rank 0), then every rank runs
its shard of the tower (`runtime.tp`), the all-reduces joining them. Only rank 0 keeps the embedding: it alone
answers /encode, writes into prefill's buffer and notifies (/send and the zmq backends alike). Each other rank
answers every step with a `StepDone` (its own start and end), which rank 0 records as that rank's ``vit`` span.
The ViT thread runs one call at a time, so every rank sees the steps in one order. With the global embedding
cache (``--mm-global-cache``) rank 0 alone looks the images up; a step carries only the images no cache level
answered (its hit/miss decision, as pixels), and a part the cache answers whole sends no step at all.

Faults: a rank that dies fails rank 0's next collective at once (the socket closes) or within `timeout` (the
gloo group's bound; a frozen rank), and its `StepDone` not arriving within `timeout` fails the step too; from then
on `dead_ranks` names it and the encode server's /health answers 503, so that prefill offers parts to the other
encoders. Ranks exit with rank 0 (they die with their parent and stop at `close`).
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from typing import Any

import msgspec
import torch
import zmq

from epd_lab.ep.messages import DTYPES
from epd_lab.models.runtime import open_runtime
from epd_lab.models.runtime.tp import check_model, rendezvous, tp_group
from epd_lab.procs import die_with_parent
from epd_lab.trace import Span

MAX_STEP_BYTES = 1 << 30  # a step's pixels: far above any request an encoder admits


class EncodeStep(msgspec.Struct, tag="step", array_like=True):
    """Rank 0 → every other rank: run the tower on these pixels (`shape`, `dtype`) of images `grid`."""

    seq: int
    grid: list[list[int]]
    shape: list[int]
    dtype: str
    pixels: bytes


class StepDone(msgspec.Struct, tag="done", array_like=True):
    """A rank → rank 0: step `seq` ran from `t_start_ns` to `t_end_ns` (CLOCK_MONOTONIC), or failed (`error`)."""

    seq: int
    rank: int
    t_start_ns: int
    t_end_ns: int
    error: str = ""


class Stop(msgspec.Struct, tag="stop", array_like=True):
    """Rank 0 → a rank: leave the group and exit."""


_step_decoder = msgspec.msgpack.Decoder(EncodeStep | Stop)
_done_decoder = msgspec.msgpack.Decoder(StepDone)
_encoder = msgspec.msgpack.Encoder()


def _socket(kind: int, timeout: float) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_STEP_BYTES)
    return sock


class EncoderTPGroup:
    """Rank 0 of an encoder's TP group; see the module docstring. A context manager.

    Args:
        model: the loaded model (every rank loads the same: `model_args` tell the others how).
        tp: ranks in the group (>= 2).
        timeout: seconds: the group's start, every collective, every step's answers.
        model_args: the other ranks' ``--model``, ``--dtype`` and ``--device`` (the server's own settings).
        node: the encode server's trace node name; rank r's spans carry ``node + "/rank{r}"``.
    """

    def __init__(self, model: Any, tp: int, timeout: float, model_args: dict[str, str], node: str) -> None:
        if tp < 2:
            raise ValueError(f"an encoder TP group has at least 2 ranks, got {tp}")
        check_model(model.config, tp)  # before any process starts
        self.tp, self.timeout, self.node = tp, timeout, node
        self._seq = 0
        self._stack = contextlib.ExitStack()
        self._procs: list[subprocess.Popen] = []
        self.dead: set[int] = set()
        try:
            self._done = self._stack.enter_context(_socket(zmq.PULL, timeout))
            done_url = _bind(self._done)
            self._steps = [self._stack.enter_context(_socket(zmq.PUSH, timeout)) for _ in range(tp - 1)]
            init = rendezvous()
            for rank, sock in enumerate(self._steps, start=1):
                args = [f"--{k}={v}" for k, v in model_args.items() if v is not None]
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "epd_lab.servers.encoder_tp", f"--rank={rank}", f"--size={tp}",
                     f"--init={init}", f"--steps={_bind(sock)}", f"--done={done_url}", f"--timeout={timeout}", *args],
                    stdin=subprocess.DEVNULL, preexec_fn=die_with_parent))
            self.tp_group = self._stack.enter_context(tp_group(0, tp, init, timeout_s=timeout))
            self.runtime = open_runtime("fast", model, None, tp=self.tp_group)
        except BaseException:
            self.close()
            raise

    @property
    def dead_ranks(self) -> list[int]:
        """Ranks known dead: exited, or failed a step."""
        self.dead.update(r for r, p in enumerate(self._procs, start=1) if p.poll() is not None)
        return sorted(self.dead)

    def encode(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, req_id: str = "",
               part_idx: int = 0) -> tuple[torch.Tensor, list[Span]]:
        """Rank 0's merged embeddings [tokens, hidden] of the images, every rank having run its shard, and the
        other ranks' ``vit`` spans of this part. Raises RuntimeError naming a dead or silent rank."""
        if self.dead_ranks:
            raise RuntimeError(f"encoder TP rank(s) {self.dead_ranks} of {self.tp} are dead")
        self._seq += 1
        pixels = pixel_values.detach().to("cpu").contiguous()
        step = _encoder.encode(EncodeStep(self._seq, image_grid_thw.tolist(), list(pixels.shape),
                                          str(pixels.dtype).removeprefix("torch."), _raw(pixels)))
        for rank, sock in enumerate(self._steps, start=1):
            try:
                sock.send(step, copy=False)
            except zmq.Again:
                self.dead.add(rank)
                raise RuntimeError(f"encoder TP rank {rank} of {self.tp} took no step within {self.timeout} s")
        emb = self.runtime.encode(pixel_values, image_grid_thw)
        return emb, self._answers(req_id, part_idx)

    def _answers(self, req_id: str, part_idx: int) -> list[Span]:
        """Every other rank's `StepDone` for the current step, as spans."""
        spans, waiting = [], set(range(1, self.tp))
        deadline = time.monotonic() + self.timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0 or not self._done.poll(int(left * 1000)):
                self.dead.update(waiting)
                raise RuntimeError(f"encoder TP rank(s) {sorted(waiting)} of {self.tp} did not finish step "
                                   f"{self._seq} within {self.timeout} s")
            done = _done_decoder.decode(self._done.recv())
            if done.seq != self._seq:
                continue  # a late answer to a step that failed
            if done.error:
                self.dead.add(done.rank)
                raise RuntimeError(f"encoder TP rank {done.rank} failed step {done.seq}: {done.error}")
            waiting.discard(done.rank)
            spans.append(Span(req_id, part_idx, "vit", f"{self.node}/rank{done.rank}", done.t_start_ns,
                              done.t_end_ns))
        return spans

    def close(self) -> None:
        """Stop every rank (a Stop, then SIGKILL after `timeout`), leave the group. Idempotent."""
        for sock in getattr(self, "_steps", []):
            with contextlib.suppress(zmq.ZMQError):
                sock.send(_encoder.encode(Stop()), zmq.NOBLOCK)
        for p in self._procs:
            try:
                p.wait(self.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        self._stack.close()

    def __enter__(self) -> "EncoderTPGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bind(sock: zmq.Socket) -> str:
    sock.bind("tcp://127.0.0.1:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _raw(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B") if tensor.numel() else memoryview(b"")


def reference_encode(tp: Any, paths: list[str], model: str | None = None, dtype: str = "float32") -> torch.Tensor:
    """The in-process reference of an encoder TP group: the images at `paths` encoded by this rank of a group of the
    same size (run it on every rank: ``run_ranks(reference_encode, N, paths)[0]``), as the server preprocesses
    them."""
    from PIL import Image

    from epd_lab import models

    models.configure_torch(threads=1)
    pixel_values, grid = models.preprocess([Image.open(p).convert("RGB") for p in paths])
    return open_runtime("fast", models.open_model(model, dtype=DTYPES[dtype]), None, tp=tp).encode(pixel_values, grid)


def rank_main(argv: list[str] | None = None) -> int:
    """Rank r ≥ 1 of an encoder's TP group: load the model, join the group, run every step rank 0 sends."""
    from epd_lab import models
    from epd_lab.serving.placement import use_device

    ap = argparse.ArgumentParser(allow_abbrev=False, description="a rank of an encoder's TP group (started by it)")
    for flag in ("rank", "size"):
        ap.add_argument(f"--{flag}", type=int, required=True)
    for flag in ("init", "steps", "done"):
        ap.add_argument(f"--{flag}", required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    models.configure_torch(threads=1)  # the same kernels, hence the same bits, as rank 0
    device = use_device(args.device)
    model = models.open_model(args.model, dtype=DTYPES[args.dtype], device=device)
    with _socket(zmq.PULL, args.timeout) as steps, _socket(zmq.PUSH, args.timeout) as done, \
            tp_group(args.rank, args.size, args.init, timeout_s=args.timeout) as tp:
        steps.connect(args.steps)
        done.connect(args.done)
        runtime = open_runtime("fast", model, None, tp=tp)
        while True:
            msg = _step_decoder.decode(steps.recv())
            if isinstance(msg, Stop):
                return 0
            t0 = time.monotonic_ns()
            try:
                pixels = torch.frombuffer(bytearray(msg.pixels), dtype=torch.uint8).view(
                    getattr(torch, msg.dtype)).reshape(msg.shape) if msg.pixels else torch.empty(msg.shape)
                with torch.inference_mode():
                    runtime.encode(pixels.to(device), torch.tensor(msg.grid))
                error = ""
            except Exception as exc:  # rank 0 fails the request with it; the group is then broken
                error = f"{type(exc).__name__}: {exc}"
            done.send(_encoder.encode(StepDone(msg.seq, args.rank, t0, time.monotonic_ns(), error)))
            if error:
                return 1


if __name__ == "__main__":
    sys.exit(rank_main())
