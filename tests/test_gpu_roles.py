"""The roles on a device: ``--device``, ``--dtype auto``, ``--model`` shapes and prefill's ``--recv-buffer``.

The option checks and the refusal of a GPU that is not there run everywhere. The cluster tests are marked
`cuda` and skip with the reason where there is no GPU (CI has none); they run on a machine with a GPU (an
H200), where every role keeps its model, embeddings and KV cache in GPU memory and the answers through the
proxy must equal the monolithic use of the roles' runtime (the fast one, the default) on the same GPU.
"""
from __future__ import annotations

import contextlib
import re

import httpx
import pytest
import torch

from epd_lab.noise import image_uri
from epd_lab.ep.receiver import ReceiverConfig, resolve_recv_buffer
from epd_lab.kv import PagedKVCache
from epd_lab.launch import Cluster, Topology
from epd_lab.models import configure_torch, open_model
from epd_lab.models.runtime import open_runtime
from epd_lab.servers.decode import DecodeSettings
from epd_lab.servers.encoder import EncoderSettings
from epd_lab.servers.prefill import PrefillSettings
from epd_lab.servers.reference import monolithic_chat
from epd_lab.serving import from_argv, to_argv
from helpers import chat, metric, metrics, wait_for

HAS_GPU = torch.cuda.is_available()
cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


# ---- the options, everywhere ----
@pytest.mark.parametrize("cls", [EncoderSettings, PrefillSettings, DecodeSettings])
def test_dtype_auto_means_bfloat16_on_cuda_and_float32_on_the_cpu(cls):
    assert cls().dtype == "float32" and cls().device == "cpu"
    assert cls(device="cuda").dtype == cls(device="cuda:1").dtype == "bfloat16"
    assert cls(device="cuda", dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        cls(device="gpu")
    with pytest.raises(ValueError, match="dtype"):
        cls(dtype="float16")
    settings = cls(device="cuda:1", model="qwen2-vl-7b")  # the command line carries them to the process
    assert from_argv(cls, to_argv(settings)) == settings


def test_the_receive_buffer_follows_the_device():
    assert PrefillSettings().recv_buffer == "host"
    assert PrefillSettings(device="cuda").recv_buffer == "pinned"  # as the seed's receiver allocates
    assert PrefillSettings(device="cuda", recv_buffer="device").recv_buffer == "device"
    for buffer in ("pinned", "device"):  # page-locked and GPU memory need CUDA
        with pytest.raises(ValueError, match="needs a CUDA device"):
            PrefillSettings(recv_buffer=buffer)
    with pytest.raises(ValueError, match="unknown receive buffer"):
        resolve_recv_buffer("gpu", "cuda")
    with pytest.raises(ValueError, match="pool_bytes needs buffer='host'"):
        ReceiverConfig(["http://127.0.0.1:1"], pool_bytes=1 << 20, buffer="pinned", device="cuda")


def test_topology_hands_the_device_to_each_model_role():
    t = Topology(prefills=1, decodes=1, device="cuda", settings={"decode": {"device": "cuda:1"}})
    assert t.role_settings("encoder").device == t.role_settings("prefill").device == "cuda"
    assert (t.role_settings("decode").device, t.role_settings("decode").dtype) == ("cuda:1", "bfloat16")
    assert Topology().role_settings("prefill").dtype == "float32"
    one = Topology(decodes=1, settings={"decode": {"device": "cuda"}})  # auto resolves on the role's own device
    assert (one.role_settings("decode").dtype, one.role_settings("encoder").dtype) == ("bfloat16", "float32")
    with pytest.raises(ValueError, match="dtype"):
        Topology(dtype="half")


@pytest.mark.skipif(HAS_GPU, reason="a GPU is here: --device cuda starts")
def test_a_role_on_a_gpu_that_is_not_there_fails_at_start_with_the_reason(tmp_path):
    with pytest.raises(RuntimeError) as exc:
        with Cluster(Topology(device="cuda", timeout=20), log_dir=str(tmp_path)):
            pass
    assert re.search(r"no CUDA device", str(exc.value) + "".join(p.read_text() for p in tmp_path.glob("*.log")))


@cuda
@needs_gpu
def test_a_cuda_tensor_registers_as_a_whole():
    """The encoder registers its GPU embedding for /send as a tensor (`register_buffer`), as on the CPU."""
    from epd_lab.transfer import open_engine
    with open_engine("auto") as engine:
        t = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
        ptr, nbytes, key = engine.register_buffer(t)
        assert (ptr, nbytes) == (t.data_ptr(), 8192) and key
        assert engine.stats()["cuda_regions"] == 1
        engine.deregister(ptr)


# ---- the whole path on a GPU ----
@pytest.fixture(scope="module")
def gpu_model():
    configure_torch()
    return open_model(None, dtype=torch.bfloat16, device="cuda")


class _Reference:
    """The answers of the roles' runtime used monolithically, in this process, on the same GPU (greedy, or drawn
    with a seed on the GPU as the servers draw): one runtime for all of a model's calls, its graphs captured once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._stack = contextlib.ExitStack()
        cache = self._stack.enter_context(PagedKVCache.from_config(model.config, num_blocks=256, dtype=model.dtype,
                                                                   device="cuda"))
        self.runtime = self._stack.enter_context(open_runtime("fast", model, cache))

    def __enter__(self) -> "_Reference":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __call__(self, messages: list, max_tokens: int, temperature: float = 0.0, seed: int = 0) -> str:
        return monolithic_chat(self.model, messages, max_tokens, runtime=self.runtime, temperature=temperature,
                               seed=seed)


@pytest.fixture(scope="module")
def reference(gpu_model):
    with _Reference(gpu_model) as ref:
        yield ref


@cuda
@needs_gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("recv_buffer", ["pinned", "device", "host"])
def test_every_role_on_the_gpu_answers_as_the_monolithic_model(reference, recv_buffer):
    """2 encoders, a prefill and a decode on the GPU in bfloat16: embeddings and KV in GPU memory, moved by
    the engine (GPU to GPU over CUDA IPC, or into the receiver's pinned or pageable host buffer); the streamed
    answers (greedy, and drawn with a seed) equal the monolithic model's on the same GPU, and every pool is idle
    after. With --gated-prefill: a lone request's forward is queued before its pinned or GPU buffer is written."""
    topology = Topology(encoders=2, prefills=1, decodes=1, proxy=True, device="cuda", timeout=60,
                        settings={"prefill": {"recv_buffer": recv_buffer, "gated_prefill": True}})
    with Cluster(topology) as cluster:
        for url in (*cluster.encoder_urls, *cluster.prefill_urls, *cluster.decode_urls):
            health = httpx.get(url + "/health", timeout=10).json()
            assert (health["device"], health["dtype"]) == ("cuda:0", "bfloat16"), health
        assert httpx.get(cluster.prefill_urls[0] + "/health", timeout=10).json()["recv_buffer"] == recv_buffer
        for n_images, seed in ((0, 0), (1, 1), (2, 2)):
            content = [{"type": "image_url", "image_url": {"url": image_uri(seed * 10 + i, 224)}}
                       for i in range(n_images)] + [{"type": "text", "text": "what do you see?"}]
            messages = [{"role": "user", "content": content}]
            assert chat(cluster.proxy_url, messages, 12, stream=True, timeout=120)[1] == reference(messages, 12)
        # a seeded draw: token 0 on the prefill's GPU, the rest on decode's, as the monolithic use draws them
        assert chat(cluster.proxy_url, messages, 12, stream=True, timeout=120, temperature=1.0, seed=11)[1] == reference(messages, 12, 1.0, 11)
        # the KV went GPU to GPU; the embeddings too into a GPU buffer, else through pinned staging
        assert metric(metrics(cluster.prefill_urls[0]), "epd_lab:prefill_engine_cuda_writes_out_total") > 0
        encoders = {name: sum(metric(metrics(url), f"epd_lab:encoder_{name}") for url in cluster.encoder_urls)
                    for name in ("engine_cuda_writes_out_total", "engine_cuda_staged_bytes_total")}
        assert (encoders["engine_cuda_writes_out_total"] > 0) == (recv_buffer == "device"), encoders
        assert (encoders["engine_cuda_staged_bytes_total"] > 0) == (recv_buffer != "device"), encoders
        for url in (*cluster.prefill_urls, *cluster.decode_urls):
            wait_for(lambda: httpx.get(url + "/health", timeout=10).json()["used_blocks"] == 0, 10,
                     f"{url} gave its KV blocks back")


@cuda
@needs_gpu
@pytest.mark.timeout(600)
def test_a_real_size_shape_on_the_gpu_answers_as_the_monolithic_model():
    """qwen2-vl-2b at its published size (seeded random weights, built on the GPU by every process alike):
    a 448² image is 256 embeddings of 1536 wide, the KV 28 layers; the split's greedy tokens equal the
    monolithic use of the same runtime's, and so do its tokens drawn with a seed."""
    configure_torch()
    model = open_model("qwen2-vl-2b", dtype=torch.bfloat16, device="cuda")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_uri(7, 448)}},
                                             {"type": "text", "text": "describe it"}]}]
    with Cluster(Topology(encoders=1, prefills=1, decodes=1, proxy=True, device="cuda", model="qwen2-vl-2b",
                          timeout=120)) as cluster, _Reference(model) as reference:
        assert chat(cluster.proxy_url, messages, 8, stream=True, timeout=120)[1] == reference(messages, 8)
        assert chat(cluster.proxy_url, messages, 8, stream=True, timeout=120, temperature=0.7, seed=3)[1] == reference(messages, 8, 0.7, 3)
