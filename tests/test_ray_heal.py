"""`epd-lab launch --ray` heals itself on a Ray cluster of emulated hosts (`epd_lab.campaign.netns`: a network
namespace and a Ray node each) that runs with Ray's token authentication on, as docs/ray.md starts it.

Host a is the head and runs the driver (`epd-lab launch`); b holds the proxy and one replica of each role, c the
other. Host c is killed whole (every process in its namespace, Ray's included) while requests flow: b's replicas
serve them, c's roles wait for a node at their address, and come back on their old URLs once c joins again. Then
b, the proxy's host, is killed: launch says why nothing can serve and exits non-zero. Skips with the reason where
network namespaces cannot be made (no CAP_NET_ADMIN).
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import httpx
import psutil
import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
from epd_lab.campaign import netns  # noqa: E402
from helpers import closed_loop, launch_event, short_chat, stop_launch  # noqa: E402

NODES = ("a", "b", "c")
PINS = {"encoder0": "b", "prefill0": "b", "decode0": "b", "proxy": "b", "encoder1": "c", "prefill1": "c",
        "decode1": "c"}
TIMEOUT_S = 5.0  # the topology's --timeout: a request's deadline at the proxy is 6x it at most
BACK_WITHIN_S = 90.0  # the stated bound: from host c's `ray start` to its three roles answering, on 2 busy vCPUs
EXIT_WITHIN_S = 60.0  # from host b's loss to launch's exit: each lost actor found within 5 s, then one look


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(hosts, the head's address, the environment a Ray client needs: the token's mode and file)."""
    ok, why = netns.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    token = tmp_path_factory.mktemp("ray-token") / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**netns.ray_token_environment(token), **netns.RAY_FAST_HEALTH_CHECKS}
    with netns.Hosts(list(NODES)) as hosts, netns.ray_nodes(hosts, env=env) as head:
        yield hosts, head, env


def _in(hosts: netns.Hosts, node: str, *cmd: str, env: dict[str, str], **kw) -> list[str]:
    return ["ip", "netns", "exec", hosts.netns(node), *cmd], {"env": env, **kw}


def test_a_client_without_the_token_is_refused_by_ray(cluster, tmp_path):
    hosts, head, _ = cluster
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    code = f"import ray; ray.init(address={head!r}, logging_level='ERROR'); print('connected')"
    cmd, kw = _in(hosts, "a", sys.executable, "-c", code, env=env)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    assert run.returncode != 0 and "connected" not in run.stdout
    assert "Authentication token is missing or incorrect" in run.stderr, run.stderr[-2000:]


def _events_until(proc: subprocess.Popen, done, timeout: float) -> list[dict]:
    """The events `proc` prints until `done(events)` holds, or `timeout` s."""
    until, out = time.monotonic() + timeout, []
    while not done(out) and time.monotonic() < until:
        try:
            out.append(launch_event(proc, until - time.monotonic()))
        except AssertionError:
            break
    return out


def _status(hosts: netns.Hosts, url: str, env: dict[str, str]) -> list[dict]:
    """`epd-lab status URL --json`, run on host a (the status URL is on its loopback)."""
    cmd, kw = _in(hosts, "a", sys.executable, "-m", "epd_lab.cli", "status", url, "--json", env=env)
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw).stdout)


@pytest.mark.timeout(600)
def test_a_lost_host_s_roles_come_back_and_the_proxy_s_loss_ends_launch(cluster):
    hosts, head, ray_env = cluster
    env = {**os.environ, **ray_env}
    options = [arg for name, host in PINS.items() for arg in
               ("--ray-options", f'{name}={{"num_cpus": 0, "resources": {{"host_{host}": 1}}}}')]
    cmd, kw = _in(hosts, "a", sys.executable, "-m", "epd_lab.cli", "launch", "--ray", head, "--ray-bind", "node",
                  "--encoders", "2", "--prefills", "2", "--decodes", "2", "--proxy", "--timeout", str(TIMEOUT_S),
                  *options, env=env)
    launch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True, **kw)
    try:
        topology = launch_event(launch, 300)
        # each role runs on, and binds, its pinned host's address
        assert topology["nodes"] == {name: hosts.address(host) for name, host in PINS.items()}
        proxy, status = topology["proxy"], topology["status"]
        # the roles never see Ray's token settings (they do not call Ray)
        for p in psutil.process_iter(["cmdline"]):
            if any("epd_lab.servers." in a for a in p.info["cmdline"] or ()):
                assert not {"RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"} & set(p.environ()), p.info["cmdline"]
        with httpx.Client(timeout=60) as http:
            expected = {i: short_chat(http, proxy, i)[3] for i in range(3)}
            with closed_loop(http, proxy) as results:
                time.sleep(1.0)
                killed_at = time.monotonic()
                hosts.kill_processes("c")
                lost = {"encoder1", "prefill1", "decode1"}
                events = _events_until(launch, lambda ev: {e["process"] for e in ev if e["event"] == "waiting"}
                                       >= lost, 60)
                assert {e["process"] for e in events if e["event"] == "exited"} == lost, events
                waiting = {e["process"]: e["reason"] for e in events if e["event"] == "waiting"}
                assert set(waiting) == lost and all(hosts.address("c") in r for r in waiting.values()), events
                states = {r["process"]: r["state"] for r in _status(hosts, status, env)}
                assert states == {**{n: "up" for n in PINS}, **{n: "waiting" for n in lost}}
                time.sleep(2.0)  # requests while c is gone: b's replicas serve them

                returned_at = time.monotonic()
                netns.ray_start(hosts, "c", head, env=ray_env)
                events = _events_until(launch, lambda ev: {e["process"] for e in ev if e["event"] == "restarted"}
                                       >= lost, BACK_WITHIN_S)
                back_after = time.monotonic() - returned_at
                restarted = {e["process"]: e for e in events if e["event"] == "restarted"}
                assert set(restarted) == lost and back_after < BACK_WITHIN_S, events
                assert all(e["url"] == topology[role + "s"][1] and e["node"] == hosts.address("c")
                           for role, e in ((e["process"][:-1], e) for e in restarted.values())), restarted
                time.sleep(3.0)  # requests after the return too
            after = [r for r in results if r[0] >= killed_at]
            right = [r for r in after if r[2] == 200 and r[3] == expected[r[4] % 3]]
            assert len(after) >= 20 and len(right) >= 0.99 * len(after), [r for r in after if r not in right]
            assert all(took < 6 * TIMEOUT_S for _, took, *_ in results)
            rows = {r["process"]: r for r in _status(hosts, status, env)}
            assert all(r["state"] == "up" for r in rows.values()) and rows["prefill1"]["restarts"] == 1
            served = [short_chat(http, proxy, i) for i in range(8)]  # round robin: c's replicas take some of these
            assert [s[3] for s in served] == [expected[i % 3] for i in range(8)]
            code = f"import httpx; print(httpx.get({status + '/metrics'!r}).text)"
            cmd, kw = _in(hosts, "a", sys.executable, "-c", code, env=env)
            metrics = subprocess.run(cmd, capture_output=True, text=True, timeout=30, **kw).stdout
            assert 'epd_lab:process_restarts_total{process="decode1",role="decode"} 1.0' in metrics, metrics
        assert launch.poll() is None

        lost_at = time.monotonic()
        hosts.kill_processes("b")
        assert launch.wait(EXIT_WITHIN_S) == 1
        assert time.monotonic() - lost_at < EXIT_WITHIN_S
        err = launch.stderr.read()
        assert "entry point is down" in err and hosts.address("b") in err, err[-3000:]
    finally:
        stop_launch(launch)
