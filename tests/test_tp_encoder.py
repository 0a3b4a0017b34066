"""An encode server as a TP group (seed 000's encoder TP): `--tp 2` starts a second rank process, both run their
shard of the vision tower over gloo, only rank 0 writes and notifies. With each E→P backend, the embeddings that
arrive equal the same TP size's in-process encode bit for bit, and so do prefill's logits on them; rank 1's vit
span joins the part's; a dead rank 1 turns /health to 503 and fails the next part within its deadline, and closing
the cluster leaves no rank behind."""
from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest
import torch

from epd_lab.ep.messages import BACKENDS
from epd_lab.ep.prefill import EPDPrefill
from epd_lab.ep.receiver import EmbeddingReceiver, ReceiverConfig
from epd_lab.launch import Cluster, Topology
from epd_lab.models import build_input_ids, load_model
from epd_lab.kv import PagedKVCache, blocks_needed
from epd_lab.models.runtime import open_runtime
from epd_lab.models.runtime.tp import run_ranks
from epd_lab.noise import noise_images
from epd_lab.servers.encoder_tp import reference_encode
from helpers import plain_metrics

pytestmark = pytest.mark.timeout(300)

SIZES = [(224, 224), (100, 333), (160, 96)]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("tp-encoder")
    paths = []
    for i, size in enumerate(SIZES):
        paths.append(str(folder / f"noise-{i}.png"))
        noise_images([size], 40 + i)[0].save(paths[-1])
    return paths


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tp2_encoder_gives_the_tp2_embeddings_bit_for_bit(backend, images):
    want = run_ranks(reference_encode, 2, images)[0]
    model = load_model()
    topology = Topology(1, backend, timeout=20.0, settings={"encoder": {"tp": 2}})
    with Cluster(topology) as cluster, \
            EmbeddingReceiver(ReceiverConfig(cluster.encoder_urls, backend, timeout=20.0)) as rx:
        health = httpx.get(cluster.encoder_urls[0] + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["tp"] == 2
        result = EPDPrefill(rx, model).prefill("Describe these three pictures.", images)
        got = result.received.embeddings["image"]
        assert torch.equal(got, want)
        ids = build_input_ids("Describe these three pictures.", result.received.grid_thw["image"])
        grid = torch.tensor(result.received.grid_thw["image"])
        with PagedKVCache.from_config(model.config, num_blocks=blocks_needed(ids.shape[1], 16)) as cache:
            ref = open_runtime("fast", model, cache).prefill(ids, want, grid, list(range(cache.num_blocks)))
        assert torch.equal(result.prefill.logits, ref.logits)
        assert rx.engine.stats()["regions"] == 0
        spans = httpx.get(cluster.encoder_urls[0] + "/v1/spans", timeout=10).json()["spans"]
        nodes = {s[3] for s in spans if s[2] == "vit"}
        assert any(n.endswith("/rank1") for n in nodes) and any(not n.endswith("/rank1") for n in nodes)


def test_a_dead_rank_fails_health_and_the_next_part_and_closing_leaves_no_rank(images):
    with Cluster(Topology(1, "mooncake", timeout=10.0, settings={"encoder": {"tp": 2}})) as cluster:
        server = psutil.Process(cluster.procs[0].pid)
        ranks = [p for p in server.children(recursive=True) if "epd_lab.servers.encoder_tp" in " ".join(p.cmdline())]
        assert len(ranks) == 1
        os.kill(ranks[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # the server reaps its rank when /health looks
        while httpx.get(cluster.encoder_urls[0] + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still answers 200 with rank 1 dead"
            time.sleep(0.05)
        metrics = plain_metrics(httpx.get(cluster.encoder_urls[0] + "/metrics", timeout=10).text)
        assert "epd_lab:encoder_tp_ranks 2" in metrics and "epd_lab:encoder_tp_dead_ranks 1" in metrics
        with EmbeddingReceiver(ReceiverConfig(cluster.encoder_urls, "mooncake", timeout=10.0)) as rx:
            start = time.monotonic()
            with pytest.raises(Exception, match="TP rank"):
                EPDPrefill(rx, load_model()).prefill("One picture.", images[:1])
            assert time.monotonic() - start < 20
            assert rx.engine.stats()["regions"] == 0
    assert not server.is_running()
