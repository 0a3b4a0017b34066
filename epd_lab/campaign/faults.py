"""`epd-lab campaign faults`: the fault matrix through real processes. A cell is a victim role (encoder,
prefill, decode) × an action (``kill``: SIGKILL; ``freeze``: SIGSTOP for `fault_s`, then SIGCONT; ``slow``: a
100 ms SIGSTOP / 100 ms SIGCONT duty cycle for `fault_s`) × a protocol step (`STEPS`).

The step is hit exactly with a failpoint (`epd_lab.failpoints`): the cluster runs with ``EPD_FAILPOINTS=@<dir>``,
the step's point is armed in one process (the first of the role the point belongs to), in-flight requests
are sent, and that process stops itself at the step. Then the action: on that process when the victim's role
is the point's, else on the victim's replica holding the most work at that moment (its /metrics), the
stopped process resumed at once. Each cell's cluster has two of the victim's role (a replica) and one of the
others, plus the proxy.

Per cell, while the fault lasts, new requests keep coming; after it (the frozen or slowed process resumed, the
killed one left dead) the cell sends requests again. Verdict (the campaign's targets): the failpoint was reached;
every in-flight request ended, with an answer or a clear error (an OpenAI error object), within the servers'
timeout + 1 s of the fault; >= 99% of the new requests during the fault succeeded with the right answer; no
pool leaked (every gauge of the surviving servers back at idle); after recovery every answer equals the
monolithic model's. Each cell has a seed and prints the command that replays it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from epd_lab.campaign.client import Outcome, chat, client_session, counts, judge
from epd_lab.campaign.metrics import Sampler, refusals, wait_idle
from epd_lab.campaign.netns import Hosts, available
from epd_lab.campaign.prompts import Prompts
from epd_lab.campaign.verdict import Progress, percentiles, target
from epd_lab.failpoints import POINTS, arm, disarm, is_stopped, wait_stopped
from epd_lab.launch import Cluster, Topology
from epd_lab.machine import machine_info

ROLES = ("encoder", "prefill", "decode")
ACTIONS = ("kill", "freeze", "slow", "cut")
# protocol step → the failpoint that marks it
STEPS = {
    "before_encode_reply": "encoder.before_encode_reply",
    "between_encode_and_send": "prefill.between_encode_and_send",
    "mid_write": "encoder.write",
    "before_notify": "encoder.before_notify",
    "kv_handshake": "prefill.kv_handshake",
    "mid_kv_write": "prefill.kv_write",
    "mid_stream": "decode.mid_stream",
}
# link cuts: the victim's emulated host loses its link at a step where bytes cross it
CUT_CELLS = (("encoder", "mid_write"), ("prefill", "mid_write"), ("prefill", "mid_kv_write"),
             ("decode", "mid_kv_write"), ("decode", "mid_stream"))
# the gauges that say how much of a request a server holds right now (to pick the replica the request is on)
WORK_GAUGES = ("embeddings_held", "inflight", "admitted", "kv_requests_held")
SLOW_PERIOD_S = 0.1


@dataclass(frozen=True, slots=True)
class Cell:
    role: str
    action: str
    step: str

    @property
    def name(self) -> str:
        return f"{self.role}:{self.action}:{self.step}"

    @classmethod
    def parse(cls, text: str) -> "Cell":
        try:
            role, action, step = text.split(":")
        except ValueError:
            raise ValueError(f"a cell is role:action:step, got {text!r}") from None
        if role not in ROLES or action not in ACTIONS or step not in STEPS:
            raise ValueError(f"unknown cell {text!r}: roles {ROLES}, actions {ACTIONS}, steps {tuple(STEPS)}")
        return cls(role, action, step)


def matrix() -> list[Cell]:
    """Every cell: each role × process action (kill, freeze, slow) × step, then the link cuts (`CUT_CELLS`)."""
    return ([Cell(r, a, s) for r in ROLES for a in ACTIONS if a != "cut" for s in STEPS]
            + [Cell(r, "cut", s) for r, s in CUT_CELLS])


def cell_seed(seed: int, cell: Cell) -> int:
    """A cell's own seed: the campaign's, and the cell's place in the whole matrix."""
    return seed * 1000 + matrix().index(cell)


def reproduce(cell: Cell, seed: int, timeout: float, inflight: int, concurrency: int,
              fault_s: float | None) -> str:
    """The command that replays `cell`."""
    extra = f" --fault-s {fault_s}" if fault_s is not None else ""
    return (f"epd-lab campaign faults --cells {cell.name} --seed {seed} --timeout {timeout} --count {inflight} "
            f"--concurrency {concurrency}{extra}")


class _Loop:
    """An asyncio loop in a thread, with one client session: the cell submits requests to it from outside."""

    def __init__(self, concurrency: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="campaign-loop", daemon=True)
        self.thread.start()
        self.session = self.run(self._session(concurrency))

    @staticmethod
    async def _session(concurrency: int):
        return client_session(concurrency)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None):
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.run(self.session.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@contextlib.contextmanager
def _failpoint_env(directory: str) -> Iterator[None]:
    """The cluster's processes inherit ``EPD_FAILPOINTS=@directory`` (armed per pid later)."""
    old = os.environ.get("EPD_FAILPOINTS")
    os.environ["EPD_FAILPOINTS"] = "@" + directory
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("EPD_FAILPOINTS", None)
        else:
            os.environ["EPD_FAILPOINTS"] = old


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _work(sampler: Sampler, name: str) -> float:
    levels = sampler.levels([name]).get(name, {})
    return sum(levels.get(g, 0.0) for g in WORK_GAUGES)


class _Cycle(threading.Thread):
    """The slow action: SIGSTOP / SIGCONT of `pid` every `SLOW_PERIOD_S` until stopped; leaves it running."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="campaign-slow", daemon=True)
        self.pid, self.done = pid, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            _signal(self.pid, signal.SIGSTOP)
            self.done.wait(SLOW_PERIOD_S)
            _signal(self.pid, signal.SIGCONT)
            self.done.wait(SLOW_PERIOD_S)
        _signal(self.pid, signal.SIGCONT)


def run_cell(cell: Cell, *, seed: int, prompts: Prompts, multi: Prompts, inflight: int, concurrency: int,
             timeout: float, fault_s: float, progress: Progress) -> dict[str, Any]:
    """One cell: its cluster, fault, requests and verdict."""
    rng = random.Random(seed)
    point = STEPS[cell.step]
    trigger_role = point.split(".")[0]
    shape = {r: (2 if r == cell.role else 1) for r in ROLES}
    fp_dir = tempfile.mkdtemp(prefix="epd-failpoints-")
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    events: dict[str, float | str | None] = {"reached_s": None, "victim": None, "fault_end_s": None}
    client_timeout = 6 * timeout
    names = [f"{r}{i}" for r in ROLES for i in range(shape[r])]
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, fp_dir, True)
        topology = Topology(encoders=shape["encoder"], prefills=shape["prefill"], decodes=shape["decode"],
                            proxy=True, timeout=timeout)
        hosts = None
        if cell.action == "cut":  # every server on its own emulated host, over tcp; the proxy on the bridge
            hosts = stack.enter_context(Hosts(names))
            placement = {n: (hosts.netns(n), hosts.address(n)) for n in names} | {"proxy": ("", hosts.root)}
            topology = dataclasses.replace(topology, transport="tcp", hosts=placement)
        with _failpoint_env(fp_dir):
            cluster = stack.enter_context(Cluster(topology))
        names = cluster.process_names()
        pids = {n: p.pid for n, p in zip(names, cluster.procs)}
        loop = _Loop(inflight + 2 * concurrency)
        url = cluster.proxy_url

        def send(p: Prompts, i: int, index: int, tag: str):
            # prompt ids: single-image prompts 0.., the multi-image ones after them
            offset = prompts.count if p is multi else 0
            return loop.submit(chat(loop.session, url, p.body(i), client_timeout, index=index,
                                    prompt=offset + i, t0=t0, tag=tag))
        try:
            for p in (prompts, multi):  # warm-up: connections, both prompt shapes
                outcomes.append(send(p, 0, len(outcomes), "warmup").result())
            with Sampler(cluster, t0) as sampler:
                idle = sampler.levels()
                trigger = f"{trigger_role}0"
                arm(fp_dir, pids[trigger], point)
                # in-flight: each spans every encoder (one part each), so an encoder's fault hits them all
                flying = [send(multi, rng.randrange(multi.count), len(outcomes) + k, "inflight")
                          for k in range(inflight)]
                reached = wait_stopped(pids[trigger], 3 * timeout)
                t_fault = time.monotonic()
                if not reached:
                    disarm(fp_dir, pids[trigger])
                    progress(f"    {point} not reached in {trigger} within {3 * timeout:.0f} s")
                else:
                    events["reached_s"] = t_fault - t0
                    victim = _victim(cell, trigger, names, sampler)
                    events["victim"] = victim
                    progress(f"    {point} reached in {trigger}; {cell.action} {victim} for {fault_s:.1f} s")
                    cycle = _act(cell.action, pids[victim], pids[trigger], victim == trigger, hosts, victim)
                    # new requests while the fault lasts
                    during, index = [], 10_000
                    while time.monotonic() < t_fault + fault_s:
                        while sum(not f.done() for f in during) < concurrency:
                            during.append(send(prompts, rng.randrange(prompts.count), index, "during"))
                            index += 1
                        time.sleep(0.02)
                    if cycle is not None:
                        cycle.done.set()
                        cycle.join()
                    if cell.action == "freeze":
                        _signal(pids[victim], signal.SIGCONT)
                    if hosts is not None:
                        hosts.restore(victim)
                    events["fault_end_s"] = time.monotonic() - t0
                    outcomes += [f.result() for f in during]
                outcomes += [f.result() for f in flying]
                events["t_fault_s"] = t_fault - t0
                for k in range(4):  # after recovery
                    p = (prompts, multi)[k % 2]
                    outcomes.append(send(p, rng.randrange(p.count), 20_000 + k, "after").result())
                alive = [n for n, proc in zip(names, cluster.procs) if proc.poll() is None]
                idle_s, left = wait_idle(sampler, {n: idle.get(n, {}) for n in alive},
                                         bound_s=max(10.0, 3 * timeout), names=alive)
                refused_by = refusals(cluster)  # the survivors' 503s by reason, beside the verdict
        finally:
            for pid in pids.values():  # nothing stays stopped for the teardown
                if is_stopped(pid):
                    _signal(pid, signal.SIGCONT)
            loop.close()
    judge(outcomes, prompts.reference + multi.reference)
    result = _verdict(cell, outcomes, events, idle_s if events["reached_s"] is not None else None,
                      left if events["reached_s"] is not None else {}, sampler.rows, timeout)
    result["refusals"] = refused_by
    return result


def _victim(cell: Cell, trigger: str, names: list[str], sampler: Sampler) -> str:
    """The process the action hits: the stopped one when it is of the victim's role, else the victim role's
    replica holding the most work now (the first on a tie)."""
    if trigger.startswith(cell.role):
        return trigger
    replicas = [n for n in names if n.startswith(cell.role)]
    return max(replicas, key=lambda n: (_work(sampler, n), -replicas.index(n)))


def _act(action: str, victim: int, trigger: int, same: bool, hosts: Hosts | None, victim_name: str) -> _Cycle | None:
    """Start `action` on `victim`; the stopped `trigger` resumes unless it is the victim (then it stays
    stopped for a freeze, is killed, or starts its slow cycle; a cut resumes it with its link down)."""
    cycle = None
    if action == "cut":
        hosts.cut(victim_name)
        _signal(trigger, signal.SIGCONT)
        return None
    if action == "kill":
        _signal(victim, signal.SIGKILL)
    elif action == "freeze" and not same:
        _signal(victim, signal.SIGSTOP)
        wait_stopped(victim, 5.0)
    elif action == "slow":
        cycle = _Cycle(victim)
        cycle.start()
    if not same:
        _signal(trigger, signal.SIGCONT)
    return cycle


def _verdict(cell: Cell, outcomes: list[Outcome], events: dict, idle_s: float | None, left: dict,
             samples: list[dict], timeout: float) -> dict[str, Any]:
    bound = timeout + 1.0
    t_fault = events.get("t_fault_s") or 0.0
    inflight = [o for o in outcomes if o.tag == "inflight"]
    late = [o for o in inflight if o.t_start + o.latency_s - t_fault > bound]
    unclear = [o for o in inflight if o.kind not in ("ok", "refused") and not o.clear]
    wrong = [o for o in inflight if o.matches is False]
    during = [o for o in outcomes if o.tag == "during"]
    good = [o for o in during if o.kind == "ok" and o.matches]
    after = [o for o in outcomes if o.tag == "after"]
    reached = events["reached_s"] is not None
    targets = [
        target("failpoint reached", reached, events, f"the cell's step ({STEPS[cell.step]}) was hit"),
        target("in-flight end within the bound with an answer or a clear error",
               reached and not late and not unclear and not wrong,
               {"inflight": len(inflight), "late": len(late), "unclear": len(unclear), "wrong": len(wrong),
                "worst_after_fault_s": max((o.t_start + o.latency_s - t_fault for o in inflight), default=None),
                "errors": sorted({o.error[:160] for o in inflight if o.error})},
               f"every in-flight request ends within the timeout + 1 s ({bound:.1f} s) of the fault"),
        target(">= 99% of new requests served during the fault",
               reached and bool(during) and len(good) >= 0.99 * len(during),
               {"during": len(during), "served_right": len(good), "counts": counts(during),
                "errors": sorted({o.error[:160] for o in during if o.error})[:5]},
               ">= 99% of requests sent during the fault succeed with the right answer (a replica is up)"),
        target("no pool leaked", reached and idle_s is not None, {"idle_after_s": idle_s, "left": left},
               "every pool gauge of the surviving servers back at its idle level"),
        target("answers equal the reference after recovery", bool(after) and all(o.matches for o in after),
               {"after": len(after), "counts": counts(after), "wrong": sum(o.matches is False for o in after)},
               "after the fault, every answer equals the monolithic model's"),
    ]
    return {"cell": cell.name, "role": cell.role, "action": cell.action, "step": cell.step,
            "point": STEPS[cell.step], "events": events, "counts": counts(outcomes),
            "latency_s": percentiles([o.latency_s for o in outcomes if o.kind == "ok"]),
            "targets": targets, "passed": all(t["passed"] for t in targets),
            "requests": [o.record() for o in outcomes], "samples": samples}


def faults(*, cells: tuple[str, ...] = (), inflight: int = 4, concurrency: int = 2, seed: int = 0,
           time_budget_s: float = 7200.0, timeout: float = 5.0, fault_s: float | None = None, max_tokens: int = 8,
           image_size: int = 224, progress: Progress = print) -> dict[str, Any]:
    """The fault leg over `cells` (``role:action:step``; default the whole `matrix`); no cell starts after
    `time_budget_s`. Returns its report (``cells``, ``targets`` prefixed with each cell, ``passed``)."""
    started = time.monotonic()
    chosen = [Cell.parse(c) for c in cells] if cells else matrix()
    window = fault_s if fault_s is not None else timeout + 2.0
    prompts = Prompts(seed, count=4, image_size=image_size, max_tokens=max_tokens)
    multi = Prompts(seed + 1, count=4, image_size=image_size, images=2, max_tokens=max_tokens)
    progress(f"  faults: {len(chosen)} cell(s); the monolithic model's answers first")
    prompts.compute_reference()
    multi.compute_reference()
    results, skipped = [], {}
    netns_ok, netns_reason = available()
    for cell in chosen:
        if time.monotonic() - started > time_budget_s:
            skipped[cell.name] = "time budget spent"
            continue
        if cell.action == "cut" and not netns_ok:
            skipped[cell.name] = f"no network namespaces here: {netns_reason}"
            progress(f"  cell {cell.name}: skipped, {skipped[cell.name]}")
            continue
        s = cell_seed(seed, cell)
        command = reproduce(cell, seed, timeout, inflight, concurrency, fault_s)
        progress(f"  cell {cell.name} (seed {s}): {command}")
        try:
            result = run_cell(cell, seed=s, prompts=prompts, multi=multi, inflight=inflight,
                              concurrency=concurrency, timeout=timeout, fault_s=window, progress=progress)
        except Exception as exc:  # a cell whose cluster did not come up is a failed cell, not a lost campaign
            result = {"cell": cell.name, "role": cell.role, "action": cell.action, "step": cell.step,
                      "counts": {}, "requests": [], "samples": [], "passed": False,
                      "targets": [target("cell ran", False, f"{type(exc).__name__}: {exc}", "the cell ran")]}
        result.update(seed=s, reproduce=command)
        results.append(result)
        failed = [t["target"] for t in result["targets"] if not t["passed"]]
        refused = {name: by for name, by in result.get("refusals", {}).items() if by}
        progress(f"    {'PASS' if not failed else 'FAIL: ' + '; '.join(failed)}  {result['counts']}"
                 + (f"  refusals {refused}" if refused else ""))
    targets = [{**t, "target": f"{r['cell']}: {t['target']}"} for r in results for t in r["targets"]]
    return {"leg": "faults", "seed": seed, "machine": machine_info(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "parameters": {"cells": [c.name for c in chosen], "inflight": inflight, "concurrency": concurrency,
                           "timeout": timeout, "fault_s": window, "time_budget_s": time_budget_s,
                           "max_tokens": max_tokens, "image_size": image_size},
            "points": POINTS, "skipped": skipped,
            "cells": results, "targets": targets, "passed": bool(results) and all(r["passed"] for r in results),
            "wall_s": time.monotonic() - started}
