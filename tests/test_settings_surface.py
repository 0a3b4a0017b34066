"""The roles' command lines are a public interface: every flag each role's settings expose, with its default, and
the messages its checks refuse a value with, written out literally (taken from the settings before they shared
their fields through `ServerSettings` and the placement bases), so that a flag dropped, renamed or given another default
fails here.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from epd_lab.launch import ROLES
from epd_lab.servers.openai_api import MODEL_ID
from epd_lab.serving import parser
from epd_lab.transfer.registry import ENGINES

REQUIRED = "required"  # a flag with no default
PLACEMENT = {"--model": None, "--device": "cpu", "--dtype": "auto", "--runtime": "fast"}
SURFACE: dict[str, dict[str, object]] = {
    "encoder": {"--host": "127.0.0.1", "--port": 0, "--backend": "mooncake", **PLACEMENT, "--transport": "auto",
                "--timeout": 10.0, "--embedding-ttl": 10.0, "--cache-bytes": 256 << 20, "--max-parts": 64,
                "--max-held-bytes": 512 << 20, "--media-roots": (), "--media-private-hosts": False, "--tp": 1,
                "--mm-global-cache": False, "--store-master": None, "--host-pool-bytes": 1 << 30,
                "--store-segment-bytes": 256 << 20, "--store-timeout": 1.0},
    "prefill": {"--host": "127.0.0.1", "--port": 0, "--encoders": (), "--backend": "mooncake", "--transport": "auto",
                **PLACEMENT, "--recv-buffer": "auto", "--gated-prefill": False, "--kv-blocks": 512, "--block-size": 16,
                "--timeout": 10.0,
                "--kv-free-timeout": 30.0, "--workers": 4, "--max-queued": 1024, "--service-prior": 0.1, "--tp": 1,
                "--dp-rank": 0, "--side-channel-base": 0},
    "decode": {"--host": "127.0.0.1", "--port": 0, "--transport": "auto", **PLACEMENT, "--kv-blocks": 512,
               "--block-size": 16, "--timeout": 10.0, "--kv-quarantine": None, "--max-batch": 16, "--max-active": 64,
               "--max-queued": 1024, "--kv-producers": (), "--tp": 1},
    "proxy": {"--prefill": REQUIRED, "--decode": REQUIRED, "--host": "127.0.0.1", "--port": 0,
              "--policy": "round_robin", "--timeout": 30.0, "--retry-after": 5.0, "--model": MODEL_ID,
              "--pipelined": False},
    "front": {"--replica": REQUIRED, "--host": "127.0.0.1", "--port": 0, "--policy": "round_robin",
              "--timeout": 30.0, "--retry-after": 5.0, "--model": MODEL_ID},
    "monolithic": {"--host": "127.0.0.1", "--port": 0, **PLACEMENT, "--timeout": 10.0, "--kv-blocks": 512,
                   "--block-size": 16, "--max-batch": 16, "--media-roots": (), "--media-private-hosts": False},
}
# --transport, one definition (`transport_option`) whose help ends with the engines each role opens
TRANSPORT_HELP = {"encoder": "the transfer engine's protocol (mooncake backend)",
                  "prefill": "the transfer engine's protocol (E→P receiver and KV producer, an engine each)",
                  "decode": "the transfer engine's protocol (KV consumer)"}
# the required settings: the proxy's and the front's URLs
REQUIRED_BY = {"proxy": {"prefills": ("http://p:1",), "decodes": ("http://d:1",)}, "front": {"replicas": ("http://m:1",)}}
# (role, a value its checks refuse, the message): one per check, word for word
REFUSED = [
    *[(role, {"device": "gpu"}, "device must be cpu, cuda or cuda:N, got 'gpu'")
      for role in ("encoder", "prefill", "decode", "monolithic")],
    *[(role, {"timeout": 0}, "timeout must be positive, got 0") for role in ROLES],
    *[(role, {"port": 65536}, "port must be in 0..65535, got 65536") for role in ROLES],
    *[(role, {"kv_blocks": 0}, "kv_blocks must be >= 1, got 0") for role in ("prefill", "decode", "monolithic")],
    *[(role, {"block_size": 0}, "block_size must be >= 1, got 0") for role in ("prefill", "decode", "monolithic")],
    *[(role, {"max_batch": 0}, "max_batch must be >= 1, got 0") for role in ("decode", "monolithic")],
    *[(role, {"max_queued": -1}, "max_queued must be >= 0, got -1") for role in ("prefill", "decode")],
    *[(role, {"backend": "x"}, "unknown backend 'x'; choose one of mooncake, zmq_to_tokenizer, zmq_to_scheduler")
      for role in ("encoder", "prefill")],
    *[(role, {"transport": "x"}, "unknown transport 'x'; choose one of") for role in ("encoder", "prefill", "decode")],
    ("encoder", {"embedding_ttl": 0}, "embedding_ttl must be positive, got 0"),
    ("encoder", {"cache_bytes": -1}, "cache_bytes must be >= 0, got -1"),
    ("encoder", {"max_parts": 0}, "max_parts must be >= 1, got 0"),
    ("encoder", {"tp": 0}, "tp must be >= 1, got 0"),
    ("encoder", {"host_pool_bytes": -1}, "host_pool_bytes must be >= 0, got -1"),
    ("encoder", {"store_timeout": 0}, "store_timeout must be positive"),
    ("encoder", {"store_segment_bytes": 1 << 20}, "store_segment_bytes must be >= 16777216"),
    ("encoder", {"store_master": "nohost"}, "--store-master must be HOST:PORT, got 'nohost'"),
    ("encoder", {"store_master": "h:99999"}, "--store-master must be HOST:PORT"),
    ("encoder", {"tp": 2, "runtime": "hf"}, "--tp 2 needs --runtime fast"),
    ("prefill", {"tp": 0}, "tp must be >= 1, got 0"),
    ("decode", {"tp": 2, "runtime": "hf"}, "--tp 2 needs --runtime fast on --device cpu"),
    ("prefill", {"tp": 2, "gated_prefill": True}, "--tp 2 needs --runtime fast on --device cpu without --gated-prefill"),
    ("prefill", {"tp": 2, "side_channel_base": 65535}, "side channel port 65536 (base 65535) lies outside 1..65535"),
    ("encoder", {"max_held_bytes": 0}, "max_held_bytes must be >= 1, got 0"),
    ("prefill", {"workers": 0}, "workers must be >= 1, got 0"),
    ("prefill", {"kv_free_timeout": 0}, "kv_free_timeout must be positive, got 0"),
    ("prefill", {"service_prior": 0}, "service_prior must be positive, got 0"),
    ("prefill", {"encoders": ("http://e:1", "e:2")}, "encoder URL 'e:2' must start with http:// or https://"),
    ("decode", {"max_active": 0}, "max_active must be >= 1, got 0"),
    ("decode", {"kv_quarantine": -1}, "kv_quarantine must be >= 0, got -1"),
    ("proxy", {"prefills": ()}, "at least one prefill URL is needed"),
    ("proxy", {"decodes": ("d:1",)}, "decode URL 'd:1' must start with http:// or https://"),
    ("proxy", {"policy": "x"}, "unknown policy 'x'; choose one of"),
    ("proxy", {"retry_after": -1}, "retry_after must be >= 0, got -1"),
    ("front", {"replicas": ()}, "at least one replica URL is needed"),
    ("front", {"replicas": ("m:1",)}, "replica URL 'm:1' must start with http:// or https://"),
    ("front", {"policy": "x"}, "unknown policy 'x'; choose one of"),
    ("front", {"retry_after": -1}, "retry_after must be >= 0, got -1"),
]


def _flag(field: dataclasses.Field) -> str:
    return field.metadata["flag"] or "--" + field.name.replace("_", "-")


@pytest.mark.parametrize("role", SURFACE)
def test_each_role_keeps_its_flags_and_defaults(role: str) -> None:
    cls = ROLES[role][1]
    defaults = {_flag(f): REQUIRED if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}
    assert defaults == SURFACE[role]
    # and the parser offers exactly those (a bool as --x and --no-x)
    offered = set(re.findall(r"--[a-z][a-z-]*", parser(cls).format_usage()))
    negated = {"--no-" + flag[2:] for flag, default in SURFACE[role].items() if isinstance(default, bool)}
    assert offered == set(SURFACE[role]) | negated
    assert cls.__dataclass_params__.frozen and "__slots__" in vars(cls)


@pytest.mark.parametrize(("role", "bad", "message"), REFUSED, ids=lambda v: v if isinstance(v, str) else None)
def test_each_role_keeps_its_checks(role: str, bad: dict, message: str) -> None:
    cls = ROLES[role][1]
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**{**REQUIRED_BY.get(role, {}), **bad})


def test_a_prefills_encoder_urls_are_checked_as_every_backend_url() -> None:
    """None is text-only; given ones are kept without a trailing slash, as the proxy's and the front's."""
    cls = ROLES["prefill"][1]
    assert cls().encoders == ()
    assert cls(encoders=("http://e:1/", "https://e:2")).encoders == ("http://e:1", "https://e:2")


@pytest.mark.parametrize("role", TRANSPORT_HELP)
def test_each_engine_role_names_its_engines_in_its_transport_help(role: str) -> None:
    field = {f.name: f for f in dataclasses.fields(ROLES[role][1])}["transport"]
    assert field.metadata["help"] == TRANSPORT_HELP[role]
    assert field.metadata["choices"] == ENGINES


def test_launch_takes_prometheus_config_beside_its_topology_flags() -> None:
    """`epd-lab launch --prometheus-config FILE`: launch's one flag that is not its topology's, taken off the
    command line before the topology reads the rest (no abbreviation, as every parser here)."""
    from pathlib import Path

    from epd_lab.serving.prometheus_config import FLAG, pop_flag

    assert FLAG == "--prometheus-config"
    assert pop_flag(["--prefills", "1", FLAG, "p.yml", "--proxy"]) == (Path("p.yml"), ["--prefills", "1", "--proxy"])
    assert pop_flag([f"{FLAG}=p.yml"]) == (Path("p.yml"), [])
    assert pop_flag(["--prefills", "1"]) == (None, ["--prefills", "1"])
    assert pop_flag(["--prometheus", "p.yml"]) == (None, ["--prometheus", "p.yml"])  # left for launch to refuse
