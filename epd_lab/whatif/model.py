"""The discrete-event model of an EPD cluster (SimPy): roles as servers with queues, batching as the real ones do it.

- **Proxy**: each request pays the calibrated hops (parse, HTTP hops, intake, notify), then goes to a prefill
  (round-robin, as the proxy's default policy).
- **Encoders**: a request's images are split into one part per encoder (as the prefill's receiver spreads
  them); each encoder reads its queue and runs the parts waiting, up to ``vision_budget`` patches, through one
  batched tower call; each part then crosses the E→P link.
- **Prefill**: waits for every part (failing past the E→P deadline, as the prefill's timeout), runs the prompt,
  streams the first token (TTFT), then the KV crosses the P→D link.
- **Decode**: the scheduler admits waiting requests up to ``max_batch`` and steps them together; each step emits
  one token per request in the batch.
- **Monolithic floor**: one thread reads the images, runs the tower and the prefill one request at a time; its
  decode scheduler batches as the decode role's.
- **Devices**: each role is placed on a named device, shared by processor sharing: with more stages running on it
  than its ``slots``, each progresses at ``slots / n`` of its own speed (a GPU time-slices the kernels of the
  processes on it; a CPU's cores are shared by their threads), so a decode step beside a tower call is slowed, not
  queued behind it.

Times are in seconds inside the simulation; the calibration's costs are in ms.
"""
from __future__ import annotations

import itertools
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field

import simpy

from epd_lab.bench.serve.metrics import RequestOutput
from epd_lab.whatif.calibration import PATCH_PIXELS, TOKEN_PIXELS, Calibration, Link

MS = 1e-3


@dataclass(frozen=True)
class SimRequest:
    """One request of the workload: when it arrives (s), its images' pixels, its text's length as the dataset drew
    it (``--random-input-len``'s unit: tokens of the bench's tokenizer) and its output tokens."""

    arrival: float
    pixels: tuple[float, ...]
    text_len: int
    output_len: int

    def prompt_tokens(self, cal: Calibration) -> int:
        """The prompt as the server counts it: the text by the calibration's ratio (its chat template included),
        then the images' tokens."""
        return round(self.text_len * cal.text_tokens_per_char + sum(p / TOKEN_PIXELS for p in self.pixels))


@dataclass
class Cluster:
    """What is simulated: ``encoders``/``prefills``/``decodes`` of a split (``monolithic`` replicas instead when
    set), each role's device (``placement``: role kind or process name such as ``encoder1`` → device name; the rest
    on ``default_device``), and links (None: the calibration's)."""

    encoders: int = 1
    prefills: int = 1
    decodes: int = 1
    monolithic: int = 0
    placement: Mapping[str, str] = field(default_factory=dict)
    default_device: str = "dev0"
    ep_link: Link | None = None
    pd_link: Link | None = None
    vision_budget: int = 4 * 1024  # patches per batched tower call
    encoder_tp: int = 1  # an encoder's TP group: its tower cost divided by tp × tp_efficiency
    tp_efficiency: float = 0.8

    @classmethod
    def parse(cls, name: str, **kw: object) -> Cluster:
        """``monolithic``, ``2xmonolithic``, or ``NeMpKd`` (as `bench serve --launch`)."""
        if name.endswith("monolithic"):
            head = name.removesuffix("monolithic").removesuffix("x")
            return cls(monolithic=int(head) if head else 1, **kw)  # type: ignore[arg-type]
        try:
            e, rest = name.split("e")
            p, d = rest.removesuffix("d").split("p")
            return cls(int(e), int(p), int(d), **kw)  # type: ignore[arg-type]
        except ValueError:
            raise ValueError(f"topology {name!r}: monolithic, Nxmonolithic or NeMpKd (1e1p1d)") from None

    def device_of(self, kind: str, index: int) -> str:
        return self.placement.get(f"{kind}{index}", self.placement.get(kind, self.default_device))


class SharedDevice:
    """A device under processor sharing: `work(ms)` finishes once `ms` of its time was served, every running job
    served at ``min(1, slots / running)``."""

    def __init__(self, env: simpy.Environment, slots: float) -> None:
        self.env, self.slots = env, slots
        self.jobs: dict[simpy.Event, float] = {}  # job → seconds of work left
        self.last = env.now
        self.epoch = 0  # a wake-up scheduled before the last change is stale

    def _rate(self) -> float:
        return min(1.0, self.slots / len(self.jobs)) if self.jobs else 0.0

    def _advance(self) -> None:
        served = (self.env.now - self.last) * self._rate()
        for job in self.jobs:
            self.jobs[job] -= served
        self.last = self.env.now

    def _schedule(self) -> None:
        self.epoch += 1
        if self.jobs:
            self.env.process(self._wake(min(self.jobs.values()) / self._rate(), self.epoch))

    def _wake(self, delay: float, epoch: int) -> Generator:
        yield self.env.timeout(max(0.0, delay))
        if epoch != self.epoch:
            return
        self._advance()
        for job in [j for j, left in self.jobs.items() if left <= 1e-12]:
            del self.jobs[job]
            job.succeed()
        self._schedule()

    def work(self, ms: float) -> simpy.Event:
        """An event that fires when `ms` of this device's time has been served to it."""
        job = self.env.event()
        if ms <= 0:
            return job.succeed()
        self._advance()
        self.jobs[job] = ms * MS
        self._schedule()
        return job


class _Decoder:
    """A decode scheduler: admits up to max_batch, steps the batch on its device."""

    def __init__(self, sim: _Sim, device: SharedDevice) -> None:
        self.sim, self.device, self.waiting, self.running = sim, device, [], []
        self.wake = sim.env.event()
        sim.env.process(self.loop())

    def admit(self, out: RequestOutput, remaining: int, since: float) -> None:
        """`out` joins the batch for its `remaining` tokens; `since`: when its last token left (for the ITL)."""
        self.waiting.append([out, remaining, since])
        if not self.wake.triggered:
            self.wake.succeed()

    def loop(self) -> Generator:
        env, cal = self.sim.env, self.sim.cal
        while True:
            if not self.running and not self.waiting:
                self.wake = env.event()
                yield self.wake
            room = cal.decode_max_batch - len(self.running)
            self.running += self.waiting[:room]
            del self.waiting[:room]
            yield self.device.work(cal.decode_step(len(self.running)))
            for item in self.running:
                out, _, last = item
                out.itl.append(env.now - last)
                item[1] -= 1
                item[2] = env.now
                if item[1] == 0:
                    self.sim.finish(out)
            self.running = [item for item in self.running if item[1] > 0]


class _Sim:
    def __init__(self, cal: Calibration, cluster: Cluster, requests: Sequence[SimRequest]) -> None:
        self.cal, self.cluster, self.requests = cal, cluster, requests
        self.env = simpy.Environment()
        names = {cluster.default_device, *cluster.placement.values()}
        self.devices = {n: SharedDevice(self.env, cal.device_slots) for n in names}
        self.outputs = [RequestOutput(prompt_len=r.prompt_tokens(cal), output_tokens=r.output_len,
                                      start_time=r.arrival, scheduled=r.arrival) for r in requests]
        self.ep = cluster.ep_link or cal.ep_link
        self.pd = cluster.pd_link or cal.pd_link
        if cluster.monolithic:
            self.decoders = [_Decoder(self, self.devices[cluster.device_of("monolithic", i)])
                             for i in range(cluster.monolithic)]
        else:
            self.encoder_queues = [simpy.Store(self.env) for _ in range(cluster.encoders)]
            for i in range(cluster.encoders):
                self.env.process(self.encoder(i))
            self.decoders = [_Decoder(self, self.devices[cluster.device_of("decode", i)])
                             for i in range(cluster.decodes)]
        self.turn = itertools.count()
        self.threads: dict[str, simpy.Resource] = {}

    def thread(self, name: str) -> simpy.Resource:
        """A process's thread: its stages run one at a time, in arrival order."""
        if name not in self.threads:
            self.threads[name] = simpy.Resource(self.env, capacity=1)
        return self.threads[name]

    def host(self, device: SharedDevice, ms: float, thread: str) -> Generator:
        """Host work on `thread`: it shares the device only where the device is the host's cores."""
        with self.thread(thread).request() as turn:
            yield turn
            yield device.work(ms) if self.cal.host_on_device else self.env.timeout(ms * MS)

    def compute(self, device: SharedDevice, ms: float, thread: str) -> Generator:
        """Device work on `thread`: the device is shared between threads, not between a thread's queued stages."""
        with self.thread(thread).request() as turn:
            yield turn
            yield device.work(ms)

    def vit_ms(self, pixels: Sequence[float]) -> float:
        kpatches = sum(pixels) / PATCH_PIXELS / 1e3
        tp = self.cluster.encoder_tp
        return self.cal.vit(kpatches) / (1 if tp == 1 else tp * self.cluster.tp_efficiency)

    def finish(self, out: RequestOutput) -> None:
        out.success = True
        out.latency = self.env.now - out.start_time

    def first_token(self, out: RequestOutput) -> None:
        out.ttft = self.env.now - out.start_time + self.cal.client_ms * MS

    def encoder(self, i: int) -> Generator:
        """Encoder `i`: batches the parts waiting, up to the vision budget, into one tower call."""
        env, queue = self.env, self.encoder_queues[i]
        device = self.devices[self.cluster.device_of("encoder", i)]
        while True:
            batch = [(yield queue.get())]
            patches = sum(batch[0][0]) / PATCH_PIXELS
            while queue.items and patches + sum(queue.items[0][0]) / PATCH_PIXELS <= self.cluster.vision_budget:
                batch.append((yield queue.get()))
                patches += sum(batch[-1][0]) / PATCH_PIXELS
            yield device.work(self.vit_ms([p for part in batch for p in part[0]]))  # this loop is the thread
            for pixels, done in batch:
                env.process(self.send(pixels, done))

    def send(self, pixels: Sequence[float], done: simpy.Event) -> Generator:
        tokens = sum(pixels) / TOKEN_PIXELS
        yield self.env.timeout(self.ep.ms(tokens * self.cal.embed_bytes_per_token) * MS)
        done.succeed()

    def load(self, device: SharedDevice, pixels: Sequence[float], thread: str) -> Generator:
        yield from self.host(device, self.cal.load_ms_per_mpix(sum(pixels) / 1e6), thread)

    def split_request(self, k: int) -> Generator:
        env, cal, cl, req, out = self.env, self.cal, self.cluster, self.requests[k], self.outputs[k]
        yield env.timeout(req.arrival)
        n = next(self.turn)
        p = n % cl.prefills
        p_dev = self.devices[cl.device_of("prefill", p)]
        yield from self.host(p_dev, cal.hops_ms, "proxy")  # the proxy's event loop, one thread
        parts = [req.pixels[i::cl.encoders] for i in range(cl.encoders)] if req.pixels else []
        waits = []
        for j, part in enumerate(parts):
            if not part:
                continue
            e = (n + j) % cl.encoders
            done = env.event()
            waits.append(done)
            env.process(self.part(e, part, done))
        if waits:
            got = yield simpy.AllOf(env, waits) | env.timeout(cal.ep_timeout_s)
            if not all(w in got for w in waits):
                out.error = "E→P deadline"
                return
        yield from self.compute(p_dev, cal.prefill(out.prompt_len / 1e3), f"prefill{p}")
        self.first_token(out)
        if req.output_len <= 1:
            self.finish(out)
            return
        first = env.now
        yield env.timeout(self.pd.ms(out.prompt_len * cal.kv_bytes_per_token) * MS)
        self.decoders[n % cl.decodes].admit(out, req.output_len - 1, first)

    def part(self, e: int, pixels: Sequence[float], done: simpy.Event) -> Generator:
        yield from self.load(self.devices[self.cluster.device_of("encoder", e)], pixels, f"encoder{e}-io")
        yield self.encoder_queues[e].put((pixels, done))

    def floor_request(self, k: int) -> Generator:
        env, cal, cl, req, out = self.env, self.cal, self.cluster, self.requests[k], self.outputs[k]
        yield env.timeout(req.arrival)
        r = next(self.turn) % cl.monolithic
        device = self.devices[cl.device_of("monolithic", r)]
        yield from self.host(device, cal.hops_ms, f"front{r}")  # the server's event loop
        with self.thread(f"monolithic{r}").request() as turn:  # one thread: images, tower, prefill, one at a time
            yield turn
            if req.pixels:
                yield device.work(self.cal.load_ms_per_mpix(sum(req.pixels) / 1e6)) if cal.host_on_device \
                    else env.timeout(self.cal.load_ms_per_mpix(sum(req.pixels) / 1e6) * MS)
                yield device.work(self.vit_ms(req.pixels))
            yield device.work(cal.prefill(out.prompt_len / 1e3))
        self.first_token(out)
        if req.output_len <= 1:
            self.finish(out)
            return
        self.decoders[r].admit(out, req.output_len - 1, env.now)

    def run(self) -> list[RequestOutput]:
        body = self.floor_request if self.cluster.monolithic else self.split_request
        for k in range(len(self.requests)):
            self.env.process(body(k))
        self.env.run()
        for out in self.outputs:
            if out.success:  # the client sees the last token one client hop later, as the first
                out.latency += self.cal.client_ms * MS
        return self.outputs


def simulate(cal: Calibration, cluster: Cluster, requests: Sequence[SimRequest]) -> list[RequestOutput]:
    """Every request through the model; outputs as `bench serve`'s client records them (seconds)."""
    if not requests:
        return []
    return _Sim(cal, cluster, requests).run()
