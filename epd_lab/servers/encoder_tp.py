"""An encoder role as a tensor-parallel group (seed 000's encoder TP): the encode server is rank 0; ranks 1..tp-1
are processes it starts, which hold their shard of the vision tower and nothing else.

    group = EncoderTPGroup(model, tp=2, timeout=10.0)   # starts rank 1, meets it over gloo
    emb = group.encode(pixel_values, image_grid_thw)     # rank 0's answer; rank 1 ran its shard beside it
    group.close()

Each ViT call on rank 0 is first sent to every other rank over ZMQ (an `EncodeStep`: the preprocessed pixels as
raw bytes in a msgpack struct, never pickle; the images are read and decoded once, on rank 0), then every rank runs
its shard of the tower (`runtime.tp`), the all-reduces joining them. Only rank 0 keeps the embedding: it alone
answers /encode, writes into prefill's buffer and notifies (/send and the zmq backends alike). Each other rank
answers every step with a `RankDone` (its own start and end), which rank 0 records as that rank's ``vit`` span.
The ViT thread runs one call at a time, so every rank sees the steps in one order. With the global embedding
cache (``--mm-global-cache``) rank 0 alone looks the images up; a step carries only the images no cache level
answered (its hit/miss decision, as pixels), and a part the cache answers whole sends no step at all.

Faults: a rank that dies fails rank 0's next collective at once (the socket closes) or within `timeout` (the
gloo group's bound; a frozen rank), and its `RankDone` not arriving within `timeout` fails the step too; from then
on `dead_ranks` names it and the encode server's /health answers 503, so that prefill offers parts to the other
encoders. Ranks exit with rank 0 (they die with their parent and stop at `close`). The processes, sockets and dead
ranks are `servers.rank_group`'s, as for prefill's and decode's groups.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import msgspec
import torch

from epd_lab.models.runtime import open_runtime
from epd_lab.models.runtime.tp import check_model
from epd_lab.servers.rank_group import (RankDone, RankProcesses, Stop, encoder, open_rank, rank_arguments, rank_flags,
                                        rank_group, rank_sockets, ready, tensor_bytes, tensor_from)
from epd_lab.trace import Span


class EncodeStep(msgspec.Struct, tag="step", array_like=True):
    """Rank 0 → every other rank: run the tower on these pixels (`shape`, `dtype`) of images `grid`."""

    seq: int
    grid: list[list[int]]
    shape: list[int]
    dtype: str
    pixels: bytes


_step_decoder = msgspec.msgpack.Decoder(EncodeStep | Stop)


class EncoderTPGroup:
    """Rank 0 of an encoder's TP group; see the module docstring. A context manager.

    Args:
        model: the loaded model (every rank loads the same from the settings).
        settings: the encode server's settings (`EncoderSettings`): its ``tp``, ``timeout`` (every collective,
            every step's answers) and the other ranks' ``--model``, ``--dtype`` and ``--device``.
        node: the encode server's trace node name; rank r's spans carry ``node + "/rank{r}"``.
    """

    def __init__(self, model: Any, settings: Any, node: str) -> None:
        check_model(model.config, settings.tp)  # before any process starts
        self.tp, self.node = settings.tp, node
        self.ranks = RankProcesses("epd_lab.servers.encoder_tp", settings.tp, settings.timeout,
                                   rank_flags(settings, ("model", "dtype", "device")))
        try:
            self.tp_group = self.ranks.join()
            self.runtime = open_runtime("fast", model, None, tp=self.tp_group)
        except BaseException:
            self.close()
            raise

    @property
    def dead_ranks(self) -> list[int]:
        """Ranks known dead: exited, or failed a step."""
        return self.ranks.dead_ranks

    def encode(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, req_id: str = "",
               part_idx: int = 0) -> tuple[torch.Tensor, list[Span]]:
        """Rank 0's merged embeddings [tokens, hidden] of the images, every rank having run its shard, and the
        other ranks' ``vit`` spans of this part. Raises RuntimeError naming a dead, failed or silent rank."""
        pixels = pixel_values.detach().to("cpu").contiguous()
        seq = self.ranks.send(lambda seq: EncodeStep(seq, image_grid_thw.tolist(), list(pixels.shape),
                                                     str(pixels.dtype).removeprefix("torch."), tensor_bytes(pixels)))
        emb = self.runtime.encode(pixel_values, image_grid_thw)
        spans = []
        for done in self.ranks.answers(seq):
            if done.error:
                raise RuntimeError(f"encoder TP rank {done.rank} failed step {done.seq}: {done.error}")
            spans.append(Span(req_id, part_idx, "vit", f"{self.node}/rank{done.rank}", done.t_start_ns,
                              done.t_end_ns))
        return emb, spans

    def close(self) -> None:
        """Stop every rank and leave the group. Idempotent."""
        self.ranks.close()

    def __enter__(self) -> "EncoderTPGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reference_encode(tp: Any, paths: list[str], model: str | None = None, dtype: str = "float32") -> torch.Tensor:
    """The in-process reference of an encoder TP group: the images at `paths` encoded by this rank of a group of the
    same size (run it on every rank: ``run_ranks(reference_encode, N, paths)[0]``), as the server preprocesses
    them."""
    from PIL import Image

    from epd_lab import models
    from epd_lab.ep.messages import DTYPES

    models.configure_torch(threads=1)
    pixel_values, grid = models.preprocess([Image.open(p).convert("RGB") for p in paths])
    return open_runtime("fast", models.open_model(model, dtype=DTYPES[dtype]), None, tp=tp).encode(pixel_values, grid)


def rank_main(argv: list[str] | None = None) -> int:
    """Rank r ≥ 1 of an encoder's TP group: load the model, say so, join the group, run every step rank 0 sends."""
    args = rank_arguments("a rank of an encoder's TP group (started by it)").parse_args(argv)
    with rank_sockets(args) as (steps, done):
        opened = open_rank(args, done)
        if opened is None:
            return 1
        device, model, _ = opened
        ready(args, done)
        with rank_group(args) as tp:
            runtime = open_runtime("fast", model, None, tp=tp)
            while True:
                msg = _step_decoder.decode(steps.recv())
                if isinstance(msg, Stop):
                    return 0
                t0 = time.monotonic_ns()
                try:
                    with torch.inference_mode():
                        runtime.encode(tensor_from(msg.pixels, msg.dtype, msg.shape).to(device),
                                       torch.tensor(msg.grid))
                    error = ""
                except Exception as exc:  # rank 0 fails the request with it; the group is then broken
                    error = f"{type(exc).__name__}: {exc}"
                done.send(encoder.encode(RankDone(msg.seq, args.rank, t0, time.monotonic_ns(), error,
                                                  500 if error else 0)))
                if error:
                    return 1


if __name__ == "__main__":
    sys.exit(rank_main())
