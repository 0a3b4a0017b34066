"""The global embedding cache on a multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head and two worker nodes
on this machine, as in tests/test_ray.py): the master runs where the cluster is driven (the head), bound to the
node's address; the two encoders, on the two other nodes and bound to it too (``ray_bind="node"``), share it over
tcp: an image encoded on one node is served on the other from L3, bit-equal, with no ViT.

Skipped where Ray or Mooncake Store is absent.
"""
from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import httpx
import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
from ray.cluster_utils import Cluster as RayCluster  # noqa: E402

from epd_lab.ep import store  # noqa: E402
from epd_lab.ep.receiver import EmbeddingReceiver, ReceiverConfig  # noqa: E402
from epd_lab.launch import Cluster, Topology  # noqa: E402
from epd_lab.noise import random_png  # noqa: E402
from helpers import plain_metrics, wait_for  # noqa: E402

REASON = store.unavailable_reason()
if REASON:
    pytest.skip(f"Mooncake Store is unavailable: {REASON}", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
TIMEOUT = 20.0


def _l3(url: str, name: str) -> float:
    text = plain_metrics(httpx.get(url + "/metrics", timeout=10).text)
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(f"epd_lab:encoder_mm_cache_l3_{name}_total"))


def test_encoders_on_two_nodes_share_the_head_s_master_over_tcp() -> None:
    head = {**NODE, "resources": {"host_a": 8}, "include_dashboard": False}
    nodes = RayCluster(initialize_head=True, head_node_args=head)
    try:
        for host in ("host_b", "host_c"):
            nodes.add_node(**NODE, resources={host: 8})
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, logging_level="WARNING", log_to_driver=False)
        options = {"encoder0": {"num_cpus": 0, "resources": {"host_b": 1}},
                   "encoder1": {"num_cpus": 0, "resources": {"host_c": 1}}}
        with tempfile.TemporaryDirectory(prefix="epd-gc-") as tmp, \
                Cluster(Topology(encoders=2, placement="ray", ray_bind="node", ray_options=options,
                                 mm_global_cache=True, timeout=TIMEOUT,
                                 settings={"encoder": {"cache_bytes": 0, "host_pool_bytes": 0}})) as c:
            node_ip = ray.util.get_node_ip_address()
            assert c.store_master.host == node_ip and node_ip != "127.0.0.1"
            a, b = c.encoder_urls
            path = Path(tmp) / "photo.png"
            path.write_bytes(random_png(1, 112))

            def receive(url: str) -> torch.Tensor:
                config = ReceiverConfig([url], "mooncake", TIMEOUT, host=node_ip)
                with EmbeddingReceiver(config) as receiver:
                    return receiver.receive([str(path)], uuid.uuid4().hex).embeddings["image"]

            from_a = receive(a)
            wait_for(lambda: _l3(a, "puts") == 1, 10, "encoder A's put")
            from_b = receive(b)
            assert torch.equal(from_a, from_b) and _l3(b, "hits") == 1
    finally:
        ray.shutdown()
        nodes.shutdown()
