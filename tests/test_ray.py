"""The topology on a real multi-node Ray cluster: a head and two worker nodes on this machine's address
(`ray.cluster_utils.Cluster`, as Ray's own tests do), each node with a custom resource that names its host.
E, P and D land on different nodes; answers equal the monolithic model's, bytes cross between nodes over tcp;
a killed role's actor, then a lost node, leave their replicas serving; `close()` leaves no actor, process or
placement group.

Kept small for a 2-vCPU CI machine: one CPU per node, no dashboard, one cluster for the module.
"""
from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
from ray.cluster_utils import Cluster as RayCluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from epd_lab.launch import Cluster, Topology  # noqa: E402
from epd_lab.noise import data_uri, random_png  # noqa: E402
from epd_lab.servers.reference import monolithic_chat  # noqa: E402
from helpers import metric_samples, metrics, wait_for  # noqa: E402

MAX_TOKENS = 8
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}  # Ray's floor is 75 MiB; the default is 30% of RAM
# process name -> the host it is pinned to: E, P and D on three nodes; a second prefill on D's node, a second
# decode on P's (host_b: its actor is killed, then the node is lost)
PINS = {"encoder0": "host_a", "prefill0": "host_b", "prefill1": "host_c", "decode0": "host_c", "decode1": "host_b",
        "proxy": "host_a"}
SECRET = secrets.token_hex(16)


@pytest.fixture(scope="module")
def ray_cluster():
    head = {**NODE, "resources": {"host_a": 8}, "include_dashboard": False}
    nodes = RayCluster(initialize_head=True, head_node_args=head)
    try:
        nodes.hosts = {host: nodes.add_node(**NODE, resources={host: 8}) for host in ("host_b", "host_c")}
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, logging_level="WARNING", log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    # num_cpus 0: five roles on three 1-CPU nodes; the custom resource alone places each
    options = {name: {"num_cpus": 0, "resources": {host: 1}} for name, host in PINS.items()}
    topology = Topology(encoders=1, prefills=2, decodes=2, proxy=True, timeout=20, placement="ray",
                        ray_strategy="SPREAD", ray_options=options, secret=SECRET)
    with Cluster(topology) as c:
        yield c


def _client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key=SECRET, max_retries=0, timeout=60)


IMAGE = data_uri(random_png(0, (96, 128)))  # 128x96 noise
MESSAGES = [[{"role": "user", "content": "the first question"}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                          {"type": "text", "text": "what is it?"}]}]]


def _answers(cluster: Cluster) -> list[str]:
    client = _client(cluster)
    return [client.chat.completions.create(model="x", messages=m, max_tokens=MAX_TOKENS, temperature=0)
            .choices[0].message.content for m in MESSAGES]


def _node_of(cluster: Cluster, name: str) -> str:
    return cluster.procs[cluster.process_names().index(name)].node_id


AUTH = {"Authorization": f"Bearer {SECRET}"}


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    """Wait until every pid is gone (reaped), for at most `timeout` s: Ray reports an actor dead before its
    process has exited, and the role's death signal follows that exit."""
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), timeout, f"pids {pids} gone")


def test_roles_land_on_the_nodes_they_are_pinned_to(cluster, ray_cluster):
    nodes = {name: _node_of(cluster, name) for name in PINS}
    assert len({nodes["encoder0"], nodes["prefill0"], nodes["decode0"]}) == 3
    assert nodes["prefill1"] == nodes["decode0"] and nodes["decode1"] == nodes["prefill0"]
    assert nodes["proxy"] == nodes["encoder0"]
    assert all(cluster.alive())


def test_answers_equal_the_monolithic_model_and_cross_nodes_over_tcp(cluster, model):
    assert _answers(cluster) == [monolithic_chat(model, m, MAX_TOKENS) for m in MESSAGES]
    # two requests in a row, each prefill and each decode taking one (ties go round-robin): prefill0 (host_b)
    # to decode0 (host_c), prefill1 (host_c) to decode1 (host_b). E→P and P→D all crossed nodes: tcp only
    assert set(metric_samples(metrics(cluster.encoder_urls[0], headers=AUTH), "epd_lab:encoder_engine_bytes_out_total")) == {'path="tcp"'}
    kv = [set(metric_samples(metrics(url, headers=AUTH), "epd_lab:prefill_engine_bytes_out_total")) for url in cluster.prefill_urls]
    assert kv == [{'path="tcp"'}, {'path="tcp"'}]


def test_the_secret_is_in_the_roles_environment_only(cluster):
    for p in cluster.procs:  # the emulated nodes share this machine, so their processes are visible here
        assert SECRET.encode() not in Path(f"/proc/{p.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{p.pid}/environ")
        env = dict(kv.split(b"=", 1) for kv in environ.read_bytes().split(b"\0") if kv)
        assert env[b"EPD_SECRET"] == SECRET.encode() and stat.S_IMODE(environ.stat().st_mode) == 0o400
        assert SECRET.encode() not in Path(f"/proc/{p.actor_pid}/cmdline").read_bytes()
    # nor in what Ray keeps about the actors (their specs, as the state API and dashboard would show them)
    assert SECRET not in repr(ray._private.state.actors())
    assert httpx.get(cluster.proxy_url + "/v1/models", timeout=10).status_code == 401


def test_a_killed_actor_takes_its_role_down_and_the_replica_serves(cluster, model):
    name = "prefill0"
    victim, url = cluster.procs[cluster.process_names().index(name)], cluster.prefill_urls[0]
    victim.kill()
    victim.wait(10)
    _wait_gone([victim.actor_pid, victim.pid])  # PR_SET_PDEATHSIG: the role dies with its actor
    assert cluster.alive() == [True, False, True, True, True, True]
    # the proxy finds prefill0 down (a refused connection) and sends everything to prefill1
    assert _answers(cluster) == [monolithic_chat(model, m, MAX_TOKENS) for m in MESSAGES]
    assert metric_samples(metrics(cluster.proxy_url, headers=AUTH), "epd_lab:proxy_backend_up")[f'role="prefill",url="{url}"'] == 0


def test_a_lost_node_takes_its_roles_down_and_the_replicas_serve(cluster, ray_cluster, model):
    victim, url = cluster.procs[cluster.process_names().index("decode1")], cluster.decode_urls[1]
    ray_cluster.remove_node(ray_cluster.hosts["host_b"])  # its raylet, its workers, their roles
    _wait_gone([victim.actor_pid, victim.pid])
    assert cluster.alive() == [True, False, True, True, False, True]
    assert _answers(cluster) == [monolithic_chat(model, m, MAX_TOKENS) for m in MESSAGES]
    assert metric_samples(metrics(cluster.proxy_url, headers=AUTH), "epd_lab:proxy_backend_up")[f'role="decode",url="{url}"'] == 0


def test_what_ray_cannot_place_is_refused_before_a_role_starts(ray_cluster):
    with pytest.raises(ValueError, match="unknown num_cpu"):
        Topology(placement="ray", ray_options={"encoder": {"num_cpu": 1}})
    with pytest.raises(ValueError, match="reserves no GPU"):  # Ray would leave it every GPU of its node
        Cluster(Topology(placement="ray", device="cuda"))
    with pytest.raises(ValueError, match="bundle needs one"):
        Cluster(Topology(placement="ray", ray_strategy="PACK", ray_options={"encoder": {"num_cpus": 0}}))


def test_close_leaves_no_actor_process_or_placement_group(cluster, ray_cluster):
    pids = [pid for p in cluster.procs for pid in (p.pid, p.actor_pid)]
    procs = list(cluster.procs)  # close() empties it
    cluster.close()  # with one node lost: its bundle of the placement group cannot be placed again
    _wait_gone(pids)
    assert [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"] == []
    assert [g for g in placement_group_table().values() if g["state"] != "REMOVED"] == []
    # every log came back from its node before the actors went; the killed one's went with its actor
    lost = {log.stem for log in cluster.logs if "lost with its Ray actor" in log.read_text()}
    assert lost == {"prefill0", "decode1"} and all(log.exists() for log in cluster.logs)
    # a killed actor's folder stays on its node for the post-mortem; the others' went with close()
    folders = {p.name: Path(p.node_log).parent for p in procs}
    assert {name for name, folder in folders.items() if folder.exists()} == lost
    for name in lost:
        shutil.rmtree(folders[name])


def test_a_tp_group_reserves_a_cpu_per_rank_on_its_actor_node():
    """A role's TP ranks are children of its actor (one node, never across nodes): by default the actor reserves
    one CPU per rank; a role's or process's own ray_options still win."""
    from epd_lab.launch_ray import actor_options

    topology = Topology(encoders=1, prefills=2, decodes=1, tp=2, settings={"decode": {"tp": 4}},
                        ray_options={"prefill1": {"num_cpus": 3}})
    assert [actor_options(topology, n)["num_cpus"] for n in topology.process_names()] == [2, 2, 3, 4]
