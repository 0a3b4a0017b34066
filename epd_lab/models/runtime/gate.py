"""A prefill queued on the GPU before its embeddings land: the GPU waits, the host opens.

A split request's prefill knows everything but the embeddings' values once the encoders answered /encode: the
prompt, its blocks, where the embeddings will land. A gated prefill is queued then, behind a stream wait on a
word of page-locked host memory (``cuStreamWaitValue32``); when the last part's notify arrives, the thread that
took it opens the gate with one store to that word, and the GPU starts at once. The forward's launch and the
worker thread's wake-up leave the critical path (on the H200 the prefill span lost 0.23 ms, a split request's
TTFT 0.40 ms: `data/bench/gated-prefill-ab-h200/`); the GPU runs what it would have run, so the bits are the same.

One word per runtime, holding the last ticket opened; gate n waits until the word reaches n. So at most one
gate is pending at a time (opening a later ticket would release an earlier one): `GateWord.gate` gives None
while one is, and that prefill runs ungated, queued behind it on the runtime's prefill stream.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch


class Gate:
    """One prefill's gate: `wait` queues the GPU's wait on a stream, `open` (any thread, idempotent) lets it go.
    Whoever takes a gate must open it on every path, or the prefill stream stays blocked."""

    def __init__(self, word: "GateWord", ticket: int) -> None:
        self._word, self.ticket = word, ticket
        self.opened_ns: int | None = None  # ``monotonic_ns`` when it was opened: the gated forward's start

    def wait(self, stream: torch.cuda.Stream) -> None:
        """Queue the wait for this gate on `stream`."""
        self._word.cuda.wait_value(stream.cuda_stream, self._word.address, self.ticket)

    def open(self) -> None:
        """Let the work queued behind this gate run (a no-op once opened)."""
        self._word.open(self)

    @property
    def is_open(self) -> bool:
        """Whether it was opened (the GPU may still be on its way past the wait)."""
        return self.opened_ns is not None


class GateWord:
    """The pinned word a runtime's gates wait on, and the one gate that may be pending.

    Raises `epd_lab.transfer.TransferError` where the driver refuses the wait (checked once here, on `device`,
    with a wait that passes at once)."""

    def __init__(self, device: torch.device) -> None:
        from epd_lab.transfer import cuda_runtime  # the driver's ctypes calls; loaded only on a GPU

        self.cuda = cuda_runtime.get()
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._value = self._word.numpy().view(np.uint32)  # a plain host store opens a gate: no CUDA call
        with torch.cuda.device(device):
            self.address = self.cuda.host_device_pointer(self._word.data_ptr())
            probe = torch.cuda.Stream(device)
            self.cuda.wait_value(probe.cuda_stream, self.address, 0)  # the word holds 0 already
            probe.synchronize()
        self._lock = threading.Lock()
        self._ticket = 0
        self._pending: Gate | None = None

    def gate(self) -> Gate | None:
        """A new gate, or None while another is pending."""
        with self._lock:
            if self._pending is not None:
                return None
            self._ticket = (self._ticket + 1) & 0xFFFFFFFF  # the wait compares cyclically
            self._pending = gate = Gate(self, self._ticket)
            return gate

    def open(self, gate: Gate) -> None:
        """Open `gate` (see `Gate.open`)."""
        with self._lock:
            if gate.opened_ns is not None:
                return
            gate.opened_ns = time.monotonic_ns()
            self._value[0] = gate.ticket
            if self._pending is gate:
                self._pending = None

    def close(self) -> None:
        """Open the pending gate, if any: nothing queued may wait on a runtime that is gone."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            pending.open()
