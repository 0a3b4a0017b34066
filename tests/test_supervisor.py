"""`epd-lab launch` keeps a topology serving: a role killed under load is started again on its old URL (a prefill
on its old KV side channels too), the requests sent meanwhile are answered right by the replicas left, and launch
runs on; with its proxy gone for good it says why and exits non-zero."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.parse

import httpx
import psutil
import pytest

from helpers import closed_loop, launch_event, short_chat, stop_launch

RESTART_WITHIN_S = 60.0  # the stated bound: backoff 0.5 s, then a prefill's start and /health on 2 busy vCPUs
TIMEOUT_S = 5.0  # the topology's --timeout: a request's deadline at the proxy is 6x it at most


def _launch(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "epd_lab.cli", "launch", "--timeout", str(TIMEOUT_S), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _events(proc: subprocess.Popen, until: float) -> list[dict]:
    """The events `proc` prints until one says a process was restarted, or the monotonic time `until`."""
    out: list[dict] = []
    while time.monotonic() < until and (not out or out[-1]["event"] != "restarted"):
        try:
            out.append(launch_event(proc, until - time.monotonic()))
        except AssertionError:
            break
    return out


def _listener(launch: subprocess.Popen, url: str) -> psutil.Process:
    """The role process of `launch` that serves `url`."""
    port = urllib.parse.urlsplit(url).port
    for child in psutil.Process(launch.pid).children(recursive=True):
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp")):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of the topology listens on {url}")


def test_a_killed_prefill_is_started_again_and_the_topology_serves_on():
    """2E2P2D behind the proxy; prefill1 SIGKILLed while requests flow: at least 99% of the requests sent after the
    kill get the answer they got before it, none takes past its deadline, prefill1 answers on its old URL and side
    channels within `RESTART_WITHIN_S` and serves requests again, and launch still runs."""
    launch = _launch("--encoders", "2", "--prefills", "2", "--decodes", "2", "--proxy")
    try:
        topology = launch_event(launch, 180)
        proxy, prefill1 = topology["proxy"], topology["prefills"][1]
        with httpx.Client(timeout=60) as http:
            side_channels = http.get(prefill1 + "/health").json()["kv_urls"]
            expected = {i: short_chat(http, proxy, i)[3] for i in range(3)}
            with closed_loop(http, proxy) as results:
                time.sleep(1.0)
                killed_at = time.monotonic()
                _listener(launch, prefill1).send_signal(signal.SIGKILL)
                events = _events(launch, killed_at + RESTART_WITHIN_S)
                back_after = time.monotonic() - killed_at
                time.sleep(2.0)  # requests after the restart too
            assert [e["event"] for e in events] == ["exited", "restarted"], events
            assert events[1]["process"] == "prefill1" and events[1]["url"] == prefill1
            assert back_after < RESTART_WITHIN_S
            health = http.get(prefill1 + "/health").json()
            assert health["kv_urls"] == side_channels  # the decodes take its KV as before
            after = [r for r in results if r[0] >= killed_at]
            right = [r for r in after if r[2] == 200 and r[3] == expected[r[4] % 3]]
            assert len(after) >= 20 and len(right) >= 0.99 * len(after), [r for r in after if r not in right]
            assert all(took < 6 * TIMEOUT_S for _, took, *_ in results)
            served = [short_chat(http, proxy, i) for i in range(6)]  # round robin: prefill1 takes some of these
            assert all(s[2] == 200 for s in served)
            assert http.get(prefill1 + "/health").json()["counters"].get("requests_ok", 0) > 0
            # what an operator reads: launch's /status and /metrics, and `epd-lab status`
            rows = {r["process"]: r for r in http.get(topology["status"] + "/status").json()}
            assert rows["prefill1"] == {"process": "prefill1", "role": "prefill", "url": prefill1, "node": "local",
                                        "state": "up", "restarts": 1, "reason": ""}
            assert all(r["state"] == "up" and r["restarts"] == 0 for n, r in rows.items() if n != "prefill1")
            metrics = http.get(topology["status"] + "/metrics").text
            assert 'epd_lab:process_restarts_total{process="prefill1",role="prefill"} 1.0' in metrics
            assert 'epd_lab:process_up{node="local",process="prefill1",role="prefill"} 1.0' in metrics
        table = subprocess.run([sys.executable, "-m", "epd_lab.cli", "status", topology["status"]],
                               capture_output=True, text=True, timeout=60)
        assert table.returncode == 0, table.stderr
        assert [ln.split()[:5] for ln in table.stdout.splitlines() if ln.startswith("prefill1")] == [
            ["prefill1", "prefill", "up", "local", "1"]]
        assert launch.poll() is None
    finally:
        stop_launch(launch)


def test_launch_exits_when_its_proxy_is_gone_for_good():
    """With restarts off, the proxy killed: launch says why on stderr and exits 1 within a few seconds."""
    launch = _launch("--prefills", "1", "--decodes", "1", "--proxy", "--restarts", "0")
    try:
        topology = launch_event(launch, 180)
        _listener(launch, topology["proxy"]).send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert launch.wait(30) == 1
        assert time.monotonic() - killed_at < 10
        err = launch.stderr.read()
        assert "entry point is down" in err, err
    finally:
        stop_launch(launch)


@pytest.mark.parametrize("urls,dp_rank,base", [(["tcp://127.0.0.1:7001"], 3, 6998),
                                               (["tcp://h:6561", "tcp://h:6562"], 2, 6557)])
def test_side_channel_base_of_a_prefill_follows_the_seed_formula(urls, dp_rank, base):
    from epd_lab.launch import _side_channel_base

    assert _side_channel_base(urls, dp_rank) == base


def test_random_side_channels_of_a_tp_group_cannot_be_taken_again():
    from epd_lab.launch import RestartRefused, _side_channel_base

    with pytest.raises(RestartRefused, match="side-channel-base"):
        _side_channel_base(["tcp://h:40001", "tcp://h:35000"], 0)
