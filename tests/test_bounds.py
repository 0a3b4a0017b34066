"""Bounds on the data-plane sockets, through real sockets and processes.

- The engine's port: a connection cap (past it, closed at once and counted) and an idle timeout (closed and
  counted), so 1,000 idle connections cost at most `max_connections` threads; a writer whose pooled connection
  was closed for idleness reconnects without a failed transfer.
- The KV side channel: an ask naming more requests than the cap is answered TRANS_ERROR at once, waiting asks
  are bounded overall and per sender, and a flood of asks naming unknown requests does not hold up the asks of
  requests that are ready.

The flood runs in a child process (this file run as a script: `python tests/test_bounds.py flood ...`), so it
competes with the producer as another client would, not for this process's GIL.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from epd_lab.kv import BlockManager, KVConsumer, KVProducer, MooncakeAgentMetadata, PagedKVCache, TransError
from epd_lab.kv.messages import decode_reply, encode
from epd_lab.transfer import TransferEngine
from epd_lab.transfer.peer import PeerProcess
from helpers import wait_for


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


# ---- the engine's port ----
def test_idle_flood_is_capped_refused_counted_and_closed_while_writers_keep_writing():
    cap, flood = 16, 200
    with (PeerProcess("tcp", max_connections=cap, idle_timeout=2.0) as peer,
          TransferEngine(protocol="tcp", timeout=2.0) as writer):
        src = np.arange(1 << 16, dtype=np.uint8)
        writer.register_buffer(src)
        dst = peer.alloc(src.nbytes)
        writer.write_buffer(peer.session_id, src, dst)  # the writer's pooled connection: 1 of the cap
        base = threads_of(peer.pid)
        host, port = peer.session_id.rsplit(":", 1)
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(flood)]
        try:
            wait_for(lambda: peer.stats()["conns_refused"] >= flood - (cap - 1), 10, "the connections past the cap "
                     "closed")
            stats = peer.stats()
            assert stats["conns_active"] == cap and stats["conns_refused"] == flood - (cap - 1)
            assert threads_of(peer.pid) <= base + cap - 1  # one thread per connection served, none for the rest
            src[:] = 7
            writer.write_buffer(peer.session_id, src, dst)  # during the flood, on the pooled connection
            assert peer.read(dst, 4) == b"\x07" * 4
            # the idle ones are closed after the idle timeout, and counted
            wait_for(lambda: peer.stats()["conns_idle_closed"] >= cap - 1, 10, "the idle flood closed")
            wait_for(lambda: threads_of(peer.pid) <= base, 5, "the closed connections' threads joined")
            # ... and the cap frees up for new writers
            with TransferEngine(protocol="tcp", timeout=2.0) as late:
                late.register_buffer(src)
                src[:] = 9
                late.write_buffer(peer.session_id, src, dst)
            assert peer.read(dst, 4) == b"\x09" * 4
        finally:
            for s in socks:
                s.close()
        assert writer.stats()["failures_out"] == 0


def test_idle_connection_is_closed_after_the_idle_timeout():
    with PeerProcess("tcp", idle_timeout=0.5) as peer:
        host, port = peer.session_id.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            start = time.monotonic()
            assert s.recv(1) == b""  # closed by the engine, not by us
            assert 0.4 < time.monotonic() - start < 5
        wait_for(lambda: (lambda st: (st["conns_idle_closed"], st["conns_active"]) == (1, 0))(peer.stats()), 5,
                 "the idle close counted and the connection's thread gone")


def test_writer_reconnects_when_the_peer_closed_its_pooled_connection_for_idleness():
    with (PeerProcess("tcp", idle_timeout=0.3) as peer,
          TransferEngine(protocol="tcp", timeout=2.0) as writer):
        src = np.full(4096, 3, dtype=np.uint8)
        writer.register_buffer(src)
        dst = peer.alloc(src.nbytes)
        for i in range(3):
            src[:] = i + 1
            writer.write_buffer(peer.session_id, src, dst)
            assert peer.read(dst, 2) == bytes([i + 1]) * 2
            time.sleep(0.6)  # past the peer's idle timeout: the pooled connection is gone
        assert peer.stats()["conns_idle_closed"] >= 2
        assert writer.stats()["failures_out"] == 0


def test_engine_limits_are_validated():
    with pytest.raises(ValueError, match="must not be negative"):
        TransferEngine(max_connections=-1)
    with TransferEngine(max_connections=3, idle_timeout=1.5) as engine:
        stats = engine.stats()
        assert (stats["max_connections"], stats["idle_timeout_ms"]) == (3, 1500)


# ---- the KV side channel ----
def flood_main(argv: list[str]) -> None:
    """Child process: send `n` asks naming `ids` unknown requests each from `sockets` DEALER sockets, then
    collect the replies; prints one JSON line when sent, one with the outcome."""
    url, n, ids, sockets, session_id = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    host, port = session_id.rsplit(":", 1)
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(sockets)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(url)
    start = time.monotonic()
    for i in range(n):
        meta = MooncakeAgentMetadata(remote_hostname=host, remote_port=int(port), session_id=session_id,
                                     request_ids=[f"flood-{i}-{j}" for j in range(ids)],
                                     kv_caches_base_addr=[1 << 20], block_ids=[[0]] * ids)
        socks[i % sockets].send_multipart([b"", encode(meta)])
    print(json.dumps({"sent": n, "s": time.monotonic() - start}), flush=True)
    errors: list[str] = []
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    deadline = time.monotonic() + 30
    while len(errors) < n and time.monotonic() < deadline:
        for s, _ in poller.poll(200):
            reply = decode_reply(s.recv_multipart()[-1])
            errors.append(reply.error if isinstance(reply, TransError) else type(reply).__name__)
    print(json.dumps({"replies": len(errors), "errors": errors, "s": time.monotonic() - start}), flush=True)
    for s in socks:
        s.close()
    ctx.term()


class Flood:
    """The flood child process: `sent()` once every ask left, `result()` once the replies came."""

    def __init__(self, url: str, n: int, ids: int, sockets: int, session_id: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "flood", url, str(n), str(ids), str(sockets),
                                      session_id], stdout=subprocess.PIPE, text=True)

    def line(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the flood process exited with {self.proc.wait()}"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> "Flood":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def pd():
    """A real producer (prefill side) and consumer (decode side), each with its engine and paged cache."""
    with (TransferEngine(timeout=2.0) as p_engine, TransferEngine(timeout=2.0) as d_engine,
          PagedKVCache(2, 2, 64, num_blocks=64, engine=p_engine) as p_cache,
          PagedKVCache(2, 2, 64, num_blocks=64, engine=d_engine) as d_cache):
        p_blocks, d_blocks = BlockManager(64), BlockManager(64)
        with (KVProducer(p_engine, p_cache, free_blocks=p_blocks.free, timeout=5.0) as producer,
              KVConsumer(d_engine, d_cache, timeout=5.0) as consumer):
            yield producer, consumer, p_blocks, d_blocks, d_engine


def legit_transfers(producer: KVProducer, consumer: KVConsumer, p_blocks: BlockManager, d_blocks: BlockManager,
                    n: int, tag: str) -> list[float]:
    """`n` requests readied on the producer and received by the consumer; each one's seconds."""
    took = []
    for i in range(n):
        rid = f"{tag}-{i}"
        producer.request_finished(rid, p_blocks.allocate(2))
        ids = d_blocks.allocate(2)
        start = time.monotonic()
        try:
            consumer.receive_kv(producer.url, rid, ids)  # raises KVTransferError (its timeout) otherwise
        finally:
            d_blocks.free(ids)
        took.append(time.monotonic() - start)
    return took


def test_asks_naming_too_many_requests_are_refused_at_once_and_ready_asks_keep_flowing(pd):
    """A flood: 200 asks naming 20,000 unknown requests each. Before, they waited out the producer's
    timeout and every ready ask behind them took 5-6 s; now each is TRANS_ERROR at once (read from the array's
    header, before the costly decode of 20,000 ids), and ready asks go through while the flood lasts."""
    producer, consumer, p_blocks, d_blocks, d_engine = pd
    with Flood(producer.url, 200, 20_000, 8, d_engine.session_id) as flood:
        assert flood.line()["sent"] == 200
        took = legit_transfers(producer, consumer, p_blocks, d_blocks, 10, "legit")
        result = flood.line()
    assert result["replies"] == 200
    assert all("this producer takes at most 64" in e for e in result["errors"]), result["errors"][:3]
    assert result["s"] < producer.timeout  # answered at once, not at the producer's deadline
    stats = producer.stats()
    assert stats["asks_refused"] == 200 and stats["asks_waiting"] == 0 and stats["transfers_done"] == 10
    print(f"ready asks during the flood: max {max(took) * 1e3:.1f} ms")
    wait_for(lambda: p_blocks.num_free_blocks == 64, 3, "prefill freed every block")
    assert d_engine.stats()["writes_in"] > 0


def test_waiting_asks_are_bounded_per_sender_and_refused_at_once_past_it(pd):
    producer, consumer, p_blocks, d_blocks, d_engine = pd
    per_peer = producer.max_waiting_per_peer
    with Flood(producer.url, per_peer + 100, 64, 16, d_engine.session_id) as flood:
        assert flood.line()["sent"] == per_peer + 100
        wait_for(lambda: producer.stats()["asks_refused"] >= 100, 3, "the asks past the bound refused")
        assert producer.stats()["asks_waiting"] == per_peer
        took = legit_transfers(producer, consumer, p_blocks, d_blocks, 5, "ready")  # served on arrival
        result = flood.line()
    busy = [e for e in result["errors"] if e.startswith("producer busy")]
    expired = [e for e in result["errors"] if "not found on the producer within" in e]
    assert (len(busy), len(expired)) == (100, per_peer), result["errors"][:3]
    print(f"ready asks with {per_peer} waiting: max {max(took) * 1e3:.1f} ms")
    assert producer.stats()["asks_waiting"] == 0


def test_oversized_frame_is_dropped_by_zmq_before_decoding(pd):
    """A frame over the side channel's MAXMSGSIZE never reaches the producer's thread: ZMQ drops the sender."""
    producer, consumer, p_blocks, d_blocks, _ = pd
    from epd_lab.kv.messages import MAX_MESSAGE_BYTES

    with zmq.Context.instance().socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(producer.url)
        s.send_multipart([b"", b"\x00" * (MAX_MESSAGE_BYTES + 64)])
        assert not s.poll(1000)  # no reply: never decoded
    stats = producer.stats()
    assert stats["malformed"] == 0 and stats["unauthenticated"] == 0
    assert legit_transfers(producer, consumer, p_blocks, d_blocks, 1, "after-big")  # still serving


if __name__ == "__main__" and sys.argv[1:2] == ["flood"]:
    flood_main(sys.argv[2:])
