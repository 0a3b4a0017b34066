"""Start a topology of real processes on this host and tear it down without leaving any behind.

    with Cluster(Topology(encoders=2, backend="mooncake")) as cluster:
        with cluster.receiver() as receiver:
            got = receiver.receive(["photo.png"])

Each role is a plain process with a CLI (`python -m epd_lab.epd.encoder ...`), started with port 0:
it prints one JSON line with its URL once it serves, and the cluster then waits for its /health.
Every process's output goes to a log file kept by the cluster (`cluster.logs`).
"""
from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import httpx

from epd_lab.epd.messages import BACKENDS
from epd_lab.epd.receiver import EmbeddingReceiver, ReceiverConfig
from epd_lab.trace import Recorder, Span, collect
from epd_lab.transfer.engine import ENGINES

if TYPE_CHECKING:
    import pandas as pd

_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


@dataclass(slots=True)
class Topology:
    """What to start.

    Args:
        encoders: number of encode servers.
        backend: ``mooncake``, ``zmq_to_tokenizer`` or ``zmq_to_scheduler``.
        transport: the transfer engines' protocol (``auto``, ``shm``, ``tcp``).
        model: a local model directory; None for the built-in tiny Qwen2-VL.
        dtype: ``float32`` or ``bfloat16``.
        timeout: seconds for a request (and for each process to come up, times 6).
        pool_bytes: the receiver's persistent pool (0: a buffer per request, as the seed).
        prefills: prefill servers (`epd_lab.pd.prefill_server`), each fanning images out to all
            encoders; 0 keeps the prefill role in the driver (`Cluster.receiver`).
        decodes: decode servers (`epd_lab.pd.decode_server`).
        proxy: start the OpenAI-compatible proxy in front of the prefills and decodes.
        pipelined: the proxy asks decode while prefill runs (streamed requests); False (default): after prefill
            answered, which gave the lower TTFT on 2 vCPUs (README, "bench e2e").
        kv_blocks: KV-cache blocks per prefill and decode server.
        trace: record spans in every process (``EPD_TRACE=0`` in their environment when False).
    """

    encoders: int = 1
    backend: str = "mooncake"
    transport: str = "auto"
    model: str | None = None
    dtype: str = "float32"
    timeout: float = 10.0
    pool_bytes: int = 0
    prefills: int = 0
    decodes: int = 0
    proxy: bool = False
    pipelined: bool = False
    kv_blocks: int = 512
    trace: bool = True

    def __post_init__(self) -> None:
        if self.encoders < 1:
            raise ValueError(f"encoders must be >= 1, got {self.encoders}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.timeout <= 0:
            raise ValueError("timeout must be positive")
        if self.prefills < 0 or self.decodes < 0:
            raise ValueError("prefills and decodes must be >= 0")
        if self.proxy and not (self.prefills and self.decodes):
            raise ValueError("the proxy needs at least one prefill and one decode server")


class Cluster:
    """The running processes of a `Topology`; a context manager. `close()` kills them all."""

    def __init__(self, topology: Topology, log_dir: str | None = None) -> None:
        self.topology = topology
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="epd-lab-"))
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.encoder_urls: list[str] = []
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        self.proxy_url: str | None = None
        _LIVE.add(self)
        try:
            for i in range(topology.encoders):
                self.encoder_urls.append(self._start(f"encoder{i}", self._encoder_cmd()))
            for i in range(topology.prefills):
                self.prefill_urls.append(self._start(f"prefill{i}", self._server_cmd("prefill_server")))
            for i in range(topology.decodes):
                self.decode_urls.append(self._start(f"decode{i}", self._server_cmd("decode_server")))
            if topology.proxy:
                self.proxy_url = self._start("proxy", self._proxy_cmd())
            for url in self.urls():
                self._wait_healthy(url)
        except BaseException:
            self.close()
            raise

    def _encoder_cmd(self) -> list[str]:
        t = self.topology
        cmd = [sys.executable, "-m", "epd_lab.epd.encoder", "--host", "127.0.0.1", "--port", "0",
               "--backend", t.backend, "--transport", t.transport, "--dtype", t.dtype, "--timeout", str(t.timeout)]
        return cmd + (["--model", t.model] if t.model else [])

    def urls(self) -> list[str]:
        """Every server's base URL: encoders, prefills, decodes, proxy."""
        return [*self.encoder_urls, *self.prefill_urls, *self.decode_urls, *([self.proxy_url] if self.proxy_url else [])]

    def _server_cmd(self, module: str) -> list[str]:
        t = self.topology
        cmd = [sys.executable, "-m", f"epd_lab.pd.{module}", "--host", "127.0.0.1", "--port", "0",
               "--dtype", t.dtype, "--timeout", str(t.timeout), "--kv-blocks", str(t.kv_blocks)]
        if module == "prefill_server" and self.encoder_urls:
            cmd += ["--encoders", ",".join(self.encoder_urls), "--backend", t.backend]
        return cmd + (["--model", t.model] if t.model else [])

    def _proxy_cmd(self) -> list[str]:
        return [sys.executable, "-m", "epd_lab.pd.proxy", "--host", "127.0.0.1", "--port", "0",
                "--prefill", ",".join(self.prefill_urls), "--decode", ",".join(self.decode_urls),
                "--timeout", str(self.topology.timeout)] + (["--pipelined"] if self.topology.pipelined else [])

    def _start(self, name: str, cmd: list[str]) -> str:
        log = self.log_dir / f"{name}.log"
        self.logs.append(log)
        with open(log, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                    preexec_fn=_die_with_parent,
                                    env={**os.environ, "EPD_TRACE": "1" if self.topology.trace else "0"})
        self.procs.append(proc)
        deadline = time.monotonic() + 6 * self.topology.timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} while starting; log:\n{_tail(log)}")
            if select.select([proc.stdout], [], [], 0.1)[0]:
                line = proc.stdout.readline()
                if line:
                    return json.loads(line)["url"]
        raise TimeoutError(f"{name} did not come up within {6 * self.topology.timeout} s; log:\n{_tail(log)}")

    def _wait_healthy(self, url: str) -> None:
        deadline = time.monotonic() + 6 * self.topology.timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{url}/health did not answer 200")

    def spans(self, request_id: str | None = None, extra: Iterable[Span] = (), since_ns: int = 0) -> pd.DataFrame:
        """Every server's spans (optionally of one request, and `extra` ones such as an in-process
        receiver's) as one frame on this host's clock (`epd_lab.trace.collect`)."""
        return collect(self.urls(), request_id, since_ns, extra, timeout=self.topology.timeout)

    def receiver(self, recorder: Recorder | None = None, **overrides) -> EmbeddingReceiver:
        """A receiver (the prefill side) wired to this cluster's encoders."""
        t = self.topology
        if recorder is None and not t.trace:
            recorder = Recorder("prefill", enabled=False)
        config = ReceiverConfig(self.encoder_urls, t.backend, overrides.pop("timeout", t.timeout),
                                overrides.pop("pool_bytes", t.pool_bytes), transport=t.transport, **overrides)
        return EmbeddingReceiver(config, recorder)

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def close(self) -> None:
        """SIGTERM every process (its whole session), SIGKILL what is left after 5 s. Idempotent."""
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
            if p.stdout:
                p.stdout.close()
        self.procs = []

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies, even by SIGKILL, so a
    killed notebook kernel or benchmark leaves no encoder behind (Linux's PR_SET_PDEATHSIG). The signal
    follows the *thread* that started the child: start clusters from a thread that outlives them."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, n: int = 20) -> str:
    """The log's last `n` lines, led by its first error line when that is further up (a failed start
    ends with the server's own shutdown traceback, below the error that caused it)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    first = next((ln for ln in lines if re.match(r"^\w*(Error|Exception)\b", ln)), None)
    tail = lines[-n:]
    return "\n".join(([first, "..."] if first and first not in tail else []) + tail)


@atexit.register
def _close_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    """``epd-lab launch``: start a topology, print its URLs and logs as JSON, serve until Ctrl-C."""
    import argparse

    ap = argparse.ArgumentParser(prog="epd-lab launch", description=main.__doc__)
    ap.add_argument("--encoders", type=int, default=2)
    ap.add_argument("--backend", default="mooncake", choices=BACKENDS)
    ap.add_argument("--transport", default="auto", choices=ENGINES)
    ap.add_argument("--model", default=None, help="a local model directory (default: the tiny Qwen2-VL)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--prefills", type=int, default=0, help="prefill servers (0: none)")
    ap.add_argument("--decodes", type=int, default=0, help="decode servers (0: none)")
    ap.add_argument("--proxy", action="store_true", help="the OpenAI-compatible proxy in front")
    ap.add_argument("--kv-blocks", type=int, default=512)
    args = ap.parse_args(argv)
    topo = Topology(args.encoders, args.backend, args.transport, args.model, args.dtype, args.timeout,
                    prefills=args.prefills, decodes=args.decodes, proxy=args.proxy, kv_blocks=args.kv_blocks)
    with Cluster(topo) as cluster:
        print(json.dumps({"encoders": cluster.encoder_urls, "prefills": cluster.prefill_urls,
                          "decodes": cluster.decode_urls, "proxy": cluster.proxy_url, "backend": topo.backend,
                          "logs": [str(p) for p in cluster.logs]}), flush=True)
        try:
            while all(cluster.alive()):
                time.sleep(0.5)
            print("a process exited; stopping the cluster", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
