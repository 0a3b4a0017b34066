"""`epd_lab.transfer.rdma_info`: the report's shape on this host (no RDMA device), and its device path with stubs."""
from __future__ import annotations

import sys
import types
from typing import Any

import pytest

import epd_lab
from epd_lab.transfer import rdma_info as ri


def test_rdma_info_shape() -> None:
    info = ri.rdma_info()
    assert set(info) == {"pyverbs", "own_binding", "agree"}
    for source in (info["pyverbs"], info["own_binding"]):
        assert isinstance(source["available"], bool)
        assert isinstance(source["devices"], list)
        if not source["available"]:
            assert source["reason"]
    assert info["agree"] in (True, False, None)
    assert isinstance(ri.format_rdma_info(info), str)


def test_sources_agree_where_both_available() -> None:
    info = ri.rdma_info()
    if not (info["pyverbs"]["available"] and info["own_binding"]["available"]):
        pytest.skip(f"a source is unavailable: pyverbs: {info['pyverbs'].get('reason')}; "
                    f"own binding: {info['own_binding'].get('reason')}")
    assert ri._names(info["pyverbs"]) == ri._names(info["own_binding"])
    assert info["agree"] is True


def test_debian_path_is_not_left_on_sys_path() -> None:
    before = list(sys.path)
    ri.rdma_info()
    assert sys.path == before


def test_missing_own_binding_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(epd_lab, "_verbs", raising=False)
    monkeypatch.setitem(sys.modules, "epd_lab._verbs", None)  # makes the import raise ImportError
    info = ri.rdma_info()
    assert info["own_binding"]["available"] is False
    assert info["own_binding"]["reason"].startswith("not built")
    assert info["agree"] is None
    assert "unavailable: not built" in ri.format_rdma_info(info)


class _Error(Exception):
    pass


def _fake_pyverbs(names: list[str]) -> types.SimpleNamespace:
    """A stand-in for pyverbs.device with one active RoCE port per device and two populated GIDs."""
    class Context:
        def __init__(self, name: str) -> None:
            self.name = name

        def query_device(self) -> Any:
            return types.SimpleNamespace(phys_port_cnt=1)

        def query_port(self, port_num: int) -> Any:
            return types.SimpleNamespace(state=4, link_layer=2, active_mtu=5, lid=0, gid_tbl_len=3)

        def query_gid(self, port_num: int, index: int) -> str:
            if index == 2:
                raise _Error("empty slot")
            return "fe80:0000:0000:0000:0000:0000:0000:000%d" % (index + 1)

        def close(self) -> None:
            pass

    return types.SimpleNamespace(
        PyverbsError=_Error,
        Context=Context,
        get_device_list=lambda: [types.SimpleNamespace(name=n.encode(), guid=0x1234) for n in names],
        guid_to_hex=lambda g: f"{g:016x}",
        port_state_to_str=lambda s: {4: "PORT_ACTIVE"}[s],
        translate_link_layer=lambda layer: {2: "Ethernet"}[layer],
        translate_mtu=lambda m: {5: "4096"}[m],
    )


def _fake_own(names: list[str]) -> types.ModuleType:
    mod = types.ModuleType("epd_lab._verbs")
    port = {"port": 1, "state": "active", "gid": "fe80::1"}
    mod.get_device_list = lambda: [  # type: ignore[attr-defined]
        {"name": n, "guid": "0000:0000:0000:1234", "ports": [port]} for n in names]
    return mod


@pytest.mark.parametrize("own_names, agree", [(["rxe0"], True), (["mlx5_0"], False)])
def test_device_path_with_stubs(monkeypatch: pytest.MonkeyPatch, own_names: list[str], agree: bool) -> None:
    monkeypatch.setattr(ri, "_import_pyverbs", lambda: (_fake_pyverbs(["rxe0"]), "stub", None))
    monkeypatch.setattr(epd_lab, "_verbs", _fake_own(own_names), raising=False)
    info = ri.rdma_info()
    dev = info["pyverbs"]["devices"][0]
    assert dev["name"] == "rxe0" and dev["guid"] == "0000000000001234"
    port = dev["ports"][0]
    assert port["state"] == "PORT_ACTIVE" and port["link_layer"] == "Ethernet"
    assert [g["index"] for g in port["gids"]] == [0, 1]  # the failing slot 2 is skipped
    assert info["agree"] is agree
    text = ri.format_rdma_info(info)
    assert "gid[1] fe80:0000:0000:0000:0000:0000:0000:0002" in text
    assert text.endswith("yes" if agree else "NO")
