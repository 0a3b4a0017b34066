"""Helpers shared by the tests: a free loopback port, a polling wait, a child's next line, a process's state (alive,
frozen), a circle in a graph, a /metrics text and its samples, one chat through an OpenAI-compatible endpoint,
`epd-lab launch`'s JSON lines and its stop, closed-loop clients of short greedy chats.

Random-noise test images come from `epd_lab.noise`; the `one_thread` and `model` fixtures live in ``conftest.py``.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Callable, Iterator


def free_port() -> int:
    """A loopback port nothing listens on (bound once by the OS, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], Any], timeout: float = 5.0,
             what: str | Callable[[], str] = "condition not reached", interval: float = 0.05) -> Any:
    """Poll `condition` every `interval` s until it returns something true, and return that (for state a server
    settles just after the client saw its answer); after `timeout` s, an AssertionError naming what was waited for:
    `what`, or what it returns then if it is a function (to show the state that was not reached)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what() if callable(what) else what} (waited {timeout} s)")
        time.sleep(interval)
    return value


def read_line(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """The next line `proc` prints on its stdout (a text pipe), waited for at most `timeout` s; a process that
    exits before it fails at once. `what` names the line in the failure."""
    wait_for(lambda: select.select([proc.stdout], [], [], 0.1)[0], timeout, what, interval=0)
    line = proc.stdout.readline()
    assert line, f"pid {proc.pid} exited with {proc.wait(10)} before {what}"
    return line


def launch_event(launch: subprocess.Popen, timeout: float) -> dict:
    """The next JSON line `epd-lab launch` (`launch`, its stdout a text pipe) prints within `timeout` s: its topology
    first, then one an event."""
    if not select.select([launch.stdout], [], [], timeout)[0]:
        raise AssertionError(f"launch printed nothing within {timeout} s")
    line = launch.stdout.readline()
    assert line, f"launch exited: {launch.stderr.read()[-3000:]}"
    return json.loads(line)


def stop_launch(launch: subprocess.Popen) -> None:
    """Ctrl-C to `epd-lab launch` (started with its own session), SIGKILL to its session after 60 s."""
    if launch.poll() is None:
        os.killpg(launch.pid, signal.SIGINT)
        try:
            launch.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()


def short_chat(http: Any, proxy: str, i: int) -> tuple[float, float, int, str, int]:
    """One greedy text chat of four tokens, ``request {i % 3}``, through `proxy` with the httpx client `http`:
    (sent at, took, status (0: no answer), text or error, i)."""
    import httpx

    t0 = time.monotonic()
    try:
        r = http.post(proxy + "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": f"request {i % 3}"}]})
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
        return t0, time.monotonic() - t0, r.status_code, text, i
    except httpx.HTTPError as exc:
        return t0, time.monotonic() - t0, 0, repr(exc), i


@contextlib.contextmanager
def closed_loop(http: Any, proxy: str, clients: int = 2) -> Iterator[list[tuple[float, float, int, str, int]]]:
    """`clients` threads sending `short_chat`s back to back while the block runs; yields the list their results
    go to, complete once the block has left."""
    results: list[tuple[float, float, int, str, int]] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            results.append(short_chat(http, proxy, i))
            i += 1

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        loads = [pool.submit(load) for _ in range(clients)]
        try:
            yield results
        finally:
            stop.set()
            for f in loads:
                f.result()


def proc_state(pid: int) -> str:
    """The process's state letter in ``/proc/<pid>/stat`` (``T`` stopped, ``Z`` a zombie, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def alive(pid: int, started: str | None = None) -> bool:
    """Whether process `pid` exists and is not a zombie; with `started` (field 22 of its ``/proc/<pid>/stat``, its
    start time), also that it is still the process that started then, not a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and (started is None or fields[19] == started)


def metrics(url: str, **get: Any) -> str:
    """`url`'s ``/metrics``, as `plain_metrics` writes it (`get`: httpx.get's options, e.g. headers)."""
    import httpx

    get.setdefault("timeout", 10)
    return plain_metrics(httpx.get(url + "/metrics", **get).text)


def plain_metrics(text: str) -> str:
    """A Prometheus exposition parsed by prometheus-client's parser (a malformed one raises) and written back one
    sample a line, ``name{labels} value``: labels by name (as prometheus-client writes them), less the
    ``model_name`` every sample carries, whole values without ``.0``; each family's ``# TYPE`` line first."""
    from prometheus_client.parser import text_string_to_metric_families

    lines = []
    for family in text_string_to_metric_families(text):
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            value = int(sample.value) if float(sample.value).is_integer() else sample.value
            lines.append(f"{sample.name}{{{labels}}} {value}" if labels else f"{sample.name} {value}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metric_samples(text: str, name: str) -> dict[str, float]:
    """The samples of metric `name` in a `plain_metrics` text by their labels (``'path="tcp"'``; ``''`` unlabelled)."""
    pattern = rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$"
    return {m[1] or "": float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


_ABSENT = object()


def metric(text: str, sample: str, default: Any = _ABSENT) -> Any:
    """The value of one sample of a `plain_metrics` text, named with its labels as that writes them
    (``epd_lab:proxy_requests_total{...}``); `default` when absent, else an AssertionError."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == sample:
            return float(value)
    if default is _ABSENT:
        raise AssertionError(f"no sample {sample} in the metrics")
    return default


def chat(url: str, messages: list[dict[str, Any]], max_tokens: int, stream: bool = False, timeout: float = 60,
         **options: Any) -> tuple[str, str]:
    """(response id, text) of one chat request to the OpenAI-compatible server at `url` (greedy unless `options`
    say otherwise: temperature, seed), whole or streamed."""
    import openai

    from epd_lab.servers.openai_api import MODEL_ID

    options.setdefault("temperature", 0)
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout) as client:
        kwargs = dict(model=MODEL_ID, messages=messages, max_tokens=max_tokens, **options)
        if not stream:
            reply = client.chat.completions.create(**kwargs)
            return reply.id, reply.choices[0].message.content
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        return chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def freeze(pid: int) -> None:
    """SIGSTOP and wait until the kernel reports the process stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: proc_state(pid) == "T", 5, f"pid {pid} stopped", interval=0.001)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in `graph` as a path that ends where it starts, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            if (found := visit(nxt, path + [node])) is not None:
                return found
        done.add(node)
        return None

    return next((c for n in sorted(graph) if (c := visit(n, [])) is not None), None)
