"""Receivers for the baselines of `epd-lab bench transfer`, each in its own process.

- ``socket``: a raw TCP socket, ``recv_into`` a preallocated buffer, one byte of ack per message.
- ``zmq``: pyzmq PULL of raw frames, ack over a PUSH back.
- ``zmq_pickle``: what SGLang's zmq_to_* backends do: a pickled dict holding the array. Unpickling
  from a socket is exactly what epd_lab refuses to do; it runs here only as the measured baseline,
  between two processes of this benchmark on loopback.

Each prints ``{"port": ...}`` (and ``"ack_port"`` for zmq) on stdout, then serves until killed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import socket
import struct

import numpy as np
import zmq

HEADER = struct.Struct("<Q")


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    while view:
        n = conn.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


def serve_socket(max_bytes: int) -> None:
    buf = np.empty(max_bytes, dtype=np.uint8)
    head = bytearray(HEADER.size)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while _recv_exact(conn, memoryview(head)):
                (n,) = HEADER.unpack(head)
                if n > max_bytes or not _recv_exact(conn, memoryview(buf)[:n]):
                    return
                conn.sendall(b"k")


def bind_pull_ack(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """A receiving child's PULL (the data) and PUSH (its acks) on loopback ports, announced on stdout as
    ``{"port", "ack_port"}`` for `connect_push_ack`."""
    pull, ack = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, ack):
        s.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ack_port = ack.bind_to_random_port("tcp://127.0.0.1")
    print(json.dumps({"port": port, "ack_port": ack_port}), flush=True)
    return pull, ack


def connect_push_ack(stack: contextlib.ExitStack, info: dict) -> tuple[zmq.Socket, zmq.Socket]:
    """The sender's PUSH and ack PULL connected to a `bind_pull_ack` child's announced ports, closed by `stack`."""
    ctx = zmq.Context()
    stack.callback(ctx.term)
    push, ack = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (push, ack):
        s.setsockopt(zmq.LINGER, 0)
        stack.callback(s.close)
    push.connect(f"tcp://127.0.0.1:{info['port']}")
    ack.connect(f"tcp://127.0.0.1:{info['ack_port']}")
    return push, ack


def serve_zmq(pickled: bool) -> None:
    ctx = zmq.Context()
    pull, ack = bind_pull_ack(ctx)
    try:
        while True:
            if pickled:
                msg = pickle.loads(pull.recv())  # the baseline under test; see the module docstring
                ack.send(str(msg["embedding"].nbytes).encode())
            else:
                frame = pull.recv(copy=False)
                ack.send(str(len(frame.buffer)).encode())
    finally:
        pull.close()
        ack.close()
        ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["socket", "zmq", "zmq_pickle"])
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    if args.kind == "socket":
        serve_socket(args.max_bytes)
    else:
        serve_zmq(pickled=args.kind == "zmq_pickle")


if __name__ == "__main__":
    main()
