"""A decode role as a tensor-parallel group (seed 003's decode workers with ``--tensor-parallel-size``): the decode
server is rank 0; ranks 1..tp-1 are processes it starts, each with its own transfer engine, its own paged KV cache
of its KV heads (`KVLayout`) and its own KV consumer.

    group = DecodeTPGroup(model, settings, node)    # starts the ranks
    tp = group.join()                               # rank 0's place in the group, once every rank is ready
    done = group.receive_kv(consumer, urls, rid, block_ids)   # every rank receives its heads into block_ids
    runtime = group.mirrored(runtime)               # each decode forward runs on every rank at once

Rank 0 owns the one block pool: a block id names the same block in every rank's cache, so a request's block table
is the same on every rank and only rank 0 allocates, frees and quarantines. A KV fetch (`FetchKV`) asks the prefill
group's side channels from every rank at once (`KVConsumer.receive_kv_group`, each rank for its own heads, the plan
checked on both sides) and completes when every rank's did; ranks run fetches in threads of their own, beside the
decode steps. Each decode forward of the scheduler is first sent to every rank as a `DecodeStep` (the batch's
tokens, positions, block tables and lengths), then run on rank 0, the all-reduces joining them; the LM head is
replicated, so rank 0's logits are the group's and it alone samples. Steps and answers are msgpack structs over
ZMQ, never pickle.

Faults: a rank that dies or fails a forward is dead from then on (`RankProcesses`); /health answers 503 naming it
and the next requests fail at once. A rank's failed fetch fails the request as rank 0's own would (by its reason;
a timeout quarantines the blocks on every rank, since a late write may land in any rank's cache).
"""
from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from epd_lab.kv import PagedKVCache
from epd_lab.kv.connector import REPLY_SLACK_S, KVConsumer, KVTransferError, KVTransferTimeout
from epd_lab.kv.messages import TransDone
from epd_lab.kv.tp_plan import KVLayout
from epd_lab.models.runtime import open_runtime
from epd_lab.models.runtime.tp import TPGroup, check_model
from epd_lab.servers.rank_group import (RankDone, RankProcesses, Stop, encoder, kv_rank_arguments, open_rank,
                                        rank_flags, rank_group, rank_sockets, ready)

TIMED_OUT = "timed out"  # a rank's fetch that ran past its time: rank 0 raises KVTransferTimeout


class FetchKV(msgspec.Struct, tag="fetch", array_like=True):
    """Rank 0 → every other rank: receive request `request_id`'s KV from the prefill side channels `urls` (rank
    order) into `block_ids`, within `timeout` seconds (0: the consumer's own)."""

    seq: int
    request_id: str
    urls: list[str]
    block_ids: list[int]
    timeout: float


class DecodeStep(msgspec.Struct, tag="decode", array_like=True):
    """Rank 0 → every other rank: one decode forward of a batch, as `runtime.decode` takes it."""

    seq: int
    tokens: list[int]
    positions: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]


_step_decoder = msgspec.msgpack.Decoder(FetchKV | DecodeStep | Stop)
_RANK_FLAGS = ("model", "dtype", "device", "transport", "host", "kv_blocks", "block_size", "max_batch")


class DecodeTPGroup:
    """Rank 0's side of a decode TP group; see the module docstring. A context manager.

    Args:
        model: the loaded model (every rank loads the same one from the settings).
        settings: the decode server's settings (`DecodeSettings`).
        node: the decode's trace node name.
    """

    def __init__(self, model: Any, settings: Any, node: str) -> None:
        check_model(model.config, settings.tp)  # before any process starts
        self.node = node
        self.ranks = RankProcesses("epd_lab.servers.decode_tp", settings.tp, settings.timeout,
                                   rank_flags(settings, _RANK_FLAGS))

    def join(self) -> TPGroup:
        """Rank 0's place in the group, once every rank loaded its model and registered its cache."""
        return self.ranks.join()

    @property
    def dead_ranks(self) -> list[int]:
        return self.ranks.dead_ranks

    def receive_kv(self, consumer: KVConsumer, urls: Sequence[str], request_id: str, block_ids: Sequence[int],
                   timeout: float | None = None) -> TransDone:
        """`KVConsumer.receive_kv_group` on every rank at once, each into its own cache's `block_ids`; rank 0's
        ``TRANS_DONE`` once every rank's came. Raises `KVTransferError` (`KVTransferTimeout`) as the consumer
        does, naming the rank; waits for every rank's answer first, so that no rank still writes into blocks the
        caller gives back."""
        try:
            seq = self.ranks.send(lambda seq: FetchKV(seq, request_id, list(urls), list(block_ids), timeout or 0.0))
        except RuntimeError as exc:
            raise KVTransferError(f"decode {exc}") from None
        error: KVTransferError | None = None
        try:
            done = consumer.receive_kv_group(urls, request_id, block_ids, timeout)
        except KVTransferError as exc:
            error = exc
        try:
            answers = self.ranks.answers(seq, (timeout or consumer.timeout) + 2 * REPLY_SLACK_S)
        except RuntimeError as exc:
            raise KVTransferTimeout(f"decode {exc}") from None
        if error is not None:
            raise error
        for a in answers:
            if a.error:
                kind = KVTransferTimeout if a.info == TIMED_OUT else KVTransferError
                raise kind(f"decode TP rank {a.rank}: {a.error}", a.info or "failed")
        return done

    def mirrored(self, runtime: Any) -> "MirroredDecode":
        """`runtime` (rank 0's) whose every decode forward runs on every rank at once."""
        return MirroredDecode(runtime, self.ranks)

    def close(self) -> None:
        """Stop every rank and leave the group. Idempotent."""
        self.ranks.close()

    def __enter__(self) -> "DecodeTPGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MirroredDecode:
    """Rank 0's runtime as the decode scheduler sees it: `decode` sends the batch to every rank, runs rank 0's
    shard, and returns rank 0's logits once every rank finished the step."""

    def __init__(self, runtime: Any, ranks: RankProcesses) -> None:
        self.runtime, self.ranks = runtime, ranks
        self.cache = runtime.cache

    def decode(self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
               seq_lens: Sequence[int]) -> torch.Tensor:
        seq = self.ranks.send(lambda seq: DecodeStep(seq, list(tokens), list(positions),
                                                     [list(t) for t in block_tables], list(seq_lens)))
        logits = self.runtime.decode(tokens, positions, block_tables, seq_lens)
        failed = [a for a in self.ranks.answers(seq) if a.error]
        if failed:
            raise RuntimeError(f"decode TP rank {failed[0].rank}: {failed[0].error}")
        return logits


def _fetch(msg: FetchKV, rank: int, consumer: KVConsumer, answer: Any) -> None:
    """One `FetchKV` on a rank (in a thread of its own); answers it."""
    t0 = time.monotonic_ns()
    error, reason = "", ""
    try:
        consumer.receive_kv_group(msg.urls, msg.request_id, msg.block_ids, msg.timeout or None)
    except KVTransferTimeout as exc:
        error, reason = str(exc), TIMED_OUT
    except KVTransferError as exc:
        error, reason = str(exc), exc.reason
    except Exception as exc:  # noqa: BLE001 - a bad ask (a URL that does not parse): this request fails
        error, reason = f"{type(exc).__name__}: {exc}", "failed"
    answer(RankDone(msg.seq, rank, t0, time.monotonic_ns(), error, 400 if error else 0, reason))


def rank_main(argv: list[str] | None = None) -> int:
    """Rank r ≥ 1 of a decode's TP group: load the model, register the cache, say so, join the group, run every
    fetch and forward rank 0 sends."""
    ap = kv_rank_arguments("a rank of a decode's TP group (started by it)")
    ap.add_argument("--max-batch", type=int, required=True)
    args = ap.parse_args(argv)
    with rank_sockets(args) as (steps, done):
        lock = threading.Lock()  # fetch threads and this one answer on one socket

        def answer(msg: RankDone) -> None:
            with lock:
                done.send(encoder.encode(msg))

        opened = open_rank(args, done, engine=True)
        if opened is None:
            return 1
        device, model, engine = opened
        layout = KVLayout(model.config.text_config.num_key_value_heads, args.size, args.rank)
        with engine, PagedKVCache.from_config(model.config, num_blocks=args.kv_blocks, block_size=args.block_size,
                                              dtype=model.dtype, engine=engine, device=device,
                                              tp_size=args.size) as cache, \
                KVConsumer(engine, cache, layout=layout, timeout=args.timeout) as consumer, \
                concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="decode-kv") as fetches:
            ready(args, done)  # before any fetch thread runs: no lock needed yet
            with rank_group(args) as tp:
                runtime = open_runtime("fast", model, cache, tp=tp, max_batch=args.max_batch)
                while True:
                    msg = _step_decoder.decode(steps.recv())
                    if isinstance(msg, Stop):
                        return 0
                    if isinstance(msg, FetchKV):
                        fetches.submit(_fetch, msg, args.rank, consumer, answer)
                        continue
                    t0 = time.monotonic_ns()
                    try:
                        with torch.inference_mode():
                            runtime.decode(msg.tokens, msg.positions, msg.block_tables, msg.seq_lens)
                        error = ""
                    except Exception as exc:  # rank 0 fails the batch with it; the group is then broken
                        error = f"{type(exc).__name__}: {exc}"
                    answer(RankDone(msg.seq, args.rank, t0, time.monotonic_ns(), error, 500 if error else 0))
                    if error:
                        return 1


if __name__ == "__main__":
    sys.exit(rank_main())
