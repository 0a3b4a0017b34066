"""A prefill role as a tensor-parallel group (seed 003's prefill workers with ``--tensor-parallel-size``): the
prefill server is rank 0; ranks 1..tp-1 are processes it starts, each with its own transfer engine, its own
paged KV cache of its KV heads (`KVLayout`), its own block pool and its own side channel on seed 003's port
``base + dp_rank * tp_size + tp_rank`` (``--side-channel-base``; 0: ports from the OS).

    group = PrefillTPGroup(model, settings, node)     # starts the ranks; they load and open their side channels
    tp = group.join()                                 # rank 0's place in the group, once every rank is ready
    result, spans = group.prefill(runtime, rid, ...)  # every rank prefills its shard into its own blocks
    group.kv_urls                                     # ranks 1..tp-1's side channels (rank 0's is the server's)

Only rank 0 speaks HTTP and receives the embeddings (E→P is unchanged); each forward on rank 0 is first sent to
every other rank as a `PrefillStep` over ZMQ (the prompt's ids, grids and embeddings as raw bytes in a msgpack
struct, never pickle), one forward at a time so that every rank runs the collectives in one order. Each rank
takes its blocks from its own pool, then the group agrees (an all-reduce of "my blocks are held") before the
forward: a rank whose pool is exhausted fails the request with 503 instead of leaving its peers in a collective.
After the forward each rank hands its blocks to its own producer (`request_finished`); decode asks every rank's
side channel (`KVConsumer.receive_kv_group`, the side channels listed in ``kv_transfer_params.remote_urls``) and
each rank frees its blocks when the decode ranks that need it have asked, or after ``--kv-free-timeout``. An
abort (`/v1/abort`, or a request that failed on any rank) reaches every rank's producer (`AbortKV`).

Faults: a rank that dies or fails a forward is dead from then on (`RankProcesses`); the prefill's /health answers
503 naming it (the proxy passes over the server) and its requests fail at once, never waiting on a collective.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

import msgspec
import torch

from epd_lab.kv import BlockManager, KVProducer, OutOfBlocks, PagedKVCache, blocks_needed
from epd_lab.kv.connector import AlreadyHeld, RequestAborted
from epd_lab.kv.tp_plan import KVLayout, side_channel_port
from epd_lab.models.runtime import PrefillOutput, PrefillPlan, open_runtime
from epd_lab.models.runtime.tp import TPGroup, check_model
from epd_lab.servers.rank_group import (RankDone, RankProcesses, Stop, encoder, kv_rank_arguments, open_rank,
                                        rank_flags, rank_group, rank_sockets, ready, tensor_bytes, tensor_from)
from epd_lab.serving import error_for_status
from epd_lab.trace import Span

KV_WAIT_POLL_S = 0.01  # how often a rank whose pool is exhausted looks again


class PrefillStep(msgspec.Struct, tag="prefill", array_like=True):
    """Rank 0 → every other rank: prefill request `request_id` (its ids, image grids, embeddings of `shape` and
    `dtype` as raw bytes, none for text) into blocks of the rank's own, waiting at most `wait_s` for free ones; hand
    them to the rank's producer when `remote` (decode asks), else free them."""

    seq: int
    request_id: str
    input_ids: list[int]
    grid: list[list[int]]
    shape: list[int]
    dtype: str
    embeds: bytes
    remote: bool
    wait_s: float


class AbortKV(msgspec.Struct, tag="abort", array_like=True):
    """Rank 0 → every other rank: drop request `request_id`'s KV (decode will never ask for it)."""

    request_id: str


_step_decoder = msgspec.msgpack.Decoder(PrefillStep | AbortKV | Stop)
_RANK_FLAGS = ("model", "dtype", "device", "transport", "host", "kv_blocks", "block_size", "kv_free_timeout",
               "dp_rank", "side_channel_base")


def _agree(tp: TPGroup, ok: bool) -> bool:
    """Whether every rank of the group is ready for the forward (one all-reduce of a flag)."""
    flags = tp.all_reduce(torch.tensor([1 if ok else 0], dtype=torch.int32))
    return int(flags.item()) == tp.size


class PrefillTPGroup:
    """Rank 0's side of a prefill TP group; see the module docstring. A context manager.

    Args:
        model: the loaded model (every rank loads the same one from the settings).
        settings: the prefill server's settings (`PrefillSettings`): the ranks' model, transport, cache, side
            channel and timeouts.
        node: the prefill's trace node name; rank r's spans carry ``node + "/rank{r}"``.
    """

    def __init__(self, model: Any, settings: Any, node: str) -> None:
        check_model(model.config, settings.tp)  # before any process starts
        self.node = node
        self._lock = threading.Lock()  # one forward at a time through the group: the collectives' one order
        self.ranks = RankProcesses("epd_lab.servers.prefill_tp", settings.tp, settings.timeout,
                                   rank_flags(settings, _RANK_FLAGS))
        self.tp: TPGroup | None = None

    def join(self) -> TPGroup:
        """Rank 0's place in the group, once every rank loaded its model and opened its side channel."""
        self.tp = self.ranks.join()
        return self.tp

    @property
    def kv_urls(self) -> list[str]:
        """Ranks 1..tp-1's side channels, in rank order."""
        return [self.ranks.info[r] for r in range(1, self.ranks.tp)]

    @property
    def dead_ranks(self) -> list[int]:
        return self.ranks.dead_ranks

    def prefill(self, runtime: Any, request_id: str, input_ids: torch.Tensor, embeds: torch.Tensor | None,
                grid: torch.Tensor | None, block_table: list[int], plan: PrefillPlan | None, remote: bool,
                deadline: float) -> tuple[PrefillOutput, list[Span]]:
        """Rank 0's forward of one request, every other rank running its shard into its own blocks beside it;
        the other ranks' ``prefill`` spans. Raises the `ServingError` of the first rank that failed (503: its KV
        pool exhausted until `deadline`; 409: aborted or held; 502: a rank broke, now dead)."""
        host = None if embeds is None else embeds.detach().to("cpu").contiguous()
        wait_s = max(0.0, deadline - time.monotonic())
        with self._lock:
            try:
                seq = self.ranks.send(lambda seq: PrefillStep(
                    seq, request_id, input_ids.reshape(-1).tolist(), [] if grid is None else grid.tolist(),
                    [] if host is None else list(host.shape),
                    "" if host is None else str(host.dtype).removeprefix("torch."),
                    b"" if host is None else tensor_bytes(host), remote, wait_s))
            except RuntimeError as exc:
                raise error_for_status(502, f"prefill {exc}") from None
            result = runtime.prefill(input_ids, embeds, grid, block_table, plan=plan) \
                if _agree(self.tp, True) else None
            try:
                answers = self.ranks.answers(seq)
            except RuntimeError as exc:
                raise error_for_status(502, f"prefill {exc}") from None
        failed = [a for a in answers if a.error]
        if failed:
            self.abort(request_id)  # the ranks that did keep it free it now
            first = min(failed, key=lambda a: a.status)
            raise error_for_status(first.status if first.status < 500 else 502,
                                   f"prefill TP rank {first.rank}: {first.error}")
        assert result is not None, "the group agreed only if every rank held its blocks"
        return result, [Span(request_id, -1, "prefill", f"{self.node}/rank{a.rank}", a.t_start_ns, a.t_end_ns)
                        for a in answers]

    def abort(self, request_id: str) -> None:
        """Drop `request_id`'s KV on every other rank (no answer awaited)."""
        self.ranks.post(encoder.encode(AbortKV(request_id)))

    def close(self) -> None:
        """Stop every rank and leave the group. Idempotent."""
        self.ranks.close()

    def __enter__(self) -> "PrefillTPGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _allocate(pool: BlockManager, n: int, wait_s: float) -> list[int]:
    """`n` blocks, waiting up to `wait_s` for KV that waits for decode to be freed; OutOfBlocks after."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return pool.allocate(n)
        except OutOfBlocks:
            if time.monotonic() >= deadline:
                raise
            time.sleep(KV_WAIT_POLL_S)


def _step(msg: PrefillStep, tp: TPGroup, runtime: Any, pool: BlockManager, producer: KVProducer,
          block_size: int, device: torch.device) -> tuple[int, str]:
    """Run one step on this rank; its (status, error), (0, "") when it went through."""
    from epd_lab.models.catalog import synchronize

    table: list[int] | None = None
    status, error = 0, ""
    try:
        table = _allocate(pool, blocks_needed(len(msg.input_ids), block_size), msg.wait_s)
    except OutOfBlocks as exc:
        status, error = 503, f"KV pool exhausted: {exc}"
    try:
        if not _agree(tp, status == 0):
            return status, error  # a peer could not take it: it says why
        embeds = tensor_from(msg.embeds, msg.dtype, msg.shape).to(device) if msg.shape else None
        grid = torch.tensor(msg.grid) if msg.grid else None
        try:
            runtime.prefill(torch.tensor([msg.input_ids], device=device), embeds, grid, table)
            synchronize(device)  # the forward's writes into the blocks are done before a peer reads them
            if msg.remote:
                producer.request_finished(msg.request_id, table)
                table = None  # the producer frees them from here on
        except (RequestAborted, AlreadyHeld) as exc:
            status, error = 409, f"request_id {msg.request_id!r}: {type(exc).__name__}: {exc}"
        return status, error
    finally:
        if table is not None:
            pool.free(table)


def rank_main(argv: list[str] | None = None) -> int:
    """Rank r ≥ 1 of a prefill's TP group: load the model, open the cache and side channel, say so, join the group,
    run every step rank 0 sends."""
    ap = kv_rank_arguments("a rank of a prefill's TP group (started by it)")
    ap.add_argument("--kv-free-timeout", type=float, required=True)
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--side-channel-base", type=int, default=0)
    args = ap.parse_args(argv)
    with rank_sockets(args) as (steps, done):
        opened = open_rank(args, done, engine=True)
        if opened is None:
            return 1
        device, model, engine = opened
        pool = BlockManager(args.kv_blocks)
        layout = KVLayout(model.config.text_config.num_key_value_heads, args.size, args.rank)
        port = side_channel_port(args.dp_rank, args.size, args.rank, args.side_channel_base)
        with engine, PagedKVCache.from_config(model.config, num_blocks=args.kv_blocks, block_size=args.block_size,
                                              dtype=model.dtype, engine=engine, device=device,
                                              tp_size=args.size) as cache, \
                KVProducer(engine, cache, free_blocks=pool.free, layout=layout, host=args.host, port=port,
                           timeout=args.timeout, free_timeout=args.kv_free_timeout) as producer:
            ready(args, done, producer.url)
            with rank_group(args) as tp:
                runtime = open_runtime("fast", model, cache, tp=tp)
                while True:
                    msg = _step_decoder.decode(steps.recv())
                    if isinstance(msg, Stop):
                        return 0
                    if isinstance(msg, AbortKV):
                        producer.abort(msg.request_id)
                        continue
                    t0 = time.monotonic_ns()
                    try:
                        with torch.inference_mode():
                            status, error = _step(msg, tp, runtime, pool, producer, args.block_size, device)
                    except Exception as exc:  # rank 0 fails the request with it; the group is then broken
                        status, error = 500, f"{type(exc).__name__}: {exc}"
                    done.send(encoder.encode(RankDone(msg.seq, args.rank, t0, time.monotonic_ns(), error, status)))
                    if status >= 500:
                        return 1


if __name__ == "__main__":
    sys.exit(rank_main())
