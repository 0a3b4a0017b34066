"""What RDMA hardware this host has, seen through two independent bindings of libibverbs.

`rdma_info()` asks pyverbs (rdma-core's own Cython binding) and epd_lab's binding
(`epd_lab._verbs.get_device_list`) for the devices, their ports and GIDs, and says whether the two agree
on the device names. Neither a missing binding nor a host without RDMA is an error: both are reported.

pyverbs is rarely pip-installable; Debian ships it as ``python3-pyverbs`` for the system CPython
(3.11 on bookworm) under ``/usr/lib/python3/dist-packages``. When ``import pyverbs`` fails, that
directory is appended to ``sys.path`` for the import alone (appended, so the venv's own packages still
win) and removed again; the extension modules only load into the same CPython minor version.
"""
from __future__ import annotations

import os
import sys
from typing import Any

DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"


def _import_pyverbs() -> tuple[Any, str, str | None]:
    """``(pyverbs.device module or None, where it came from, why not)``."""
    try:
        import pyverbs.device as device
        return device, "sys.path", None
    except ImportError as exc:
        first = exc
    if not os.path.isdir(os.path.join(DEBIAN_DIST_PACKAGES, "pyverbs")):
        return None, "", f"pyverbs is not installed ({first}; apt-get install python3-pyverbs)"
    sys.path.append(DEBIAN_DIST_PACKAGES)
    try:
        import pyverbs.device as device
        return device, DEBIAN_DIST_PACKAGES, None
    except ImportError as exc:
        # typically Debian's build is for another CPython minor version than this interpreter
        return None, "", (f"Debian's pyverbs in {DEBIAN_DIST_PACKAGES} does not import into Python "
                          f"{sys.version_info.major}.{sys.version_info.minor}: {exc}")
    finally:
        sys.path.remove(DEBIAN_DIST_PACKAGES)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pyverbs_port(device: Any, ctx: Any, port_num: int) -> dict[str, Any]:
    attr = ctx.query_port(port_num)
    gids = []
    for index in range(attr.gid_tbl_len):
        try:
            gid = str(ctx.query_gid(port_num, index))
        except device.PyverbsError:
            continue  # unpopulated entries fail on some providers
        if gid.strip(":0") == "":
            continue  # an all-zero GID is an empty table slot
        gids.append({"index": index, "gid": gid})
    return {
        "port": port_num,
        "state": device.port_state_to_str(attr.state),
        "link_layer": device.translate_link_layer(attr.link_layer),
        "active_mtu": device.translate_mtu(attr.active_mtu),
        "lid": attr.lid,
        "gids": gids,
    }


def _pyverbs_device(device: Any, dev: Any) -> dict[str, Any]:
    name = _text(dev.name)
    info: dict[str, Any] = {"name": name, "guid": device.guid_to_hex(dev.guid), "ports": []}
    try:
        ctx = device.Context(name=name)
    except device.PyverbsError as exc:
        info["error"] = f"cannot open: {exc}"  # listed but not openable (permissions, a dead device)
        return info
    try:
        for port_num in range(1, ctx.query_device().phys_port_cnt + 1):
            try:
                info["ports"].append(_pyverbs_port(device, ctx, port_num))
            except device.PyverbsError as exc:
                info["ports"].append({"port": port_num, "error": str(exc)})
    finally:
        ctx.close()
    return info


def _no_device_hint() -> str:
    if not os.path.isdir("/sys/class/infiniband"):
        return "this kernel exposes no RDMA support (/sys/class/infiniband is missing)"
    return "no RDMA device is present"


def _pyverbs_info() -> dict[str, Any]:
    device, source, reason = _import_pyverbs()
    if device is None:
        return {"available": False, "reason": reason, "devices": []}
    out: dict[str, Any] = {"available": True, "source": source, "devices": []}
    try:
        devs = device.get_device_list()
    except device.PyverbsError as exc:
        # ibv_get_device_list returns NULL (ENOSYS) when the kernel has no RDMA at all; pyverbs raises
        out["note"] = f"get_device_list failed ({exc}): {_no_device_hint()}"
        return out
    for dev in devs:
        try:
            out["devices"].append(_pyverbs_device(device, dev))
        except device.PyverbsError as exc:
            out["devices"].append({"name": _text(dev.name), "error": str(exc), "ports": []})
    if not devs:
        out["note"] = _no_device_hint()
    return out


def _own_binding_info() -> dict[str, Any]:
    try:
        from epd_lab import _verbs
    except ImportError as exc:
        # built only where libibverbs headers exist (setup.py); its absence is a fact, not a failure
        return {"available": False, "reason": f"not built ({exc})", "devices": []}
    try:
        devices = list(_verbs.get_device_list())
    except Exception as exc:  # report whatever the binding raises; this is a diagnostic, never a crash
        return {"available": True, "devices": [], "error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"available": True, "devices": devices}
    if not devices:
        out["note"] = _no_device_hint()
    return out


def _names(source: dict[str, Any]) -> list[str]:
    return sorted(d["name"] for d in source["devices"])


def rdma_info() -> dict[str, Any]:
    """RDMA devices, ports and GIDs as pyverbs and as epd_lab's own binding see them. Never raises.

    Returns ``{"pyverbs": {...}, "own_binding": {...}, "agree": bool | None}``. Each source has
    ``available`` and ``devices`` (dicts with ``name``, ``guid``, ``ports``), plus ``reason`` when
    unavailable and ``note``/``error`` when the device list is empty or failed. ``agree`` compares the
    device names when both sources are available, and is None when one is not.
    """
    pv = _pyverbs_info()
    own = _own_binding_info()
    agree = _names(pv) == _names(own) if pv["available"] and own["available"] else None
    return {"pyverbs": pv, "own_binding": own, "agree": agree}


def _format_source(title: str, source: dict[str, Any]) -> list[str]:
    if not source["available"]:
        return [f"{title}: unavailable: {source['reason']}"]
    head = f"{title}: {len(source['devices'])} device(s)"
    if "source" in source:
        head += f" (pyverbs from {source['source']})"
    lines = [head]
    for key in ("note", "error"):
        if key in source:
            lines.append(f"  {key}: {source[key]}")
    for dev in source["devices"]:
        error = f"  error: {dev['error']}" if "error" in dev else ""
        lines.append(f"  {dev['name']}  guid {dev.get('guid', '?')}{error}")
        for port in dev.get("ports", []):
            if "error" in port:
                lines.append(f"    port {port['port']}: error: {port['error']}")
                continue
            keys = ("state", "link_layer", "active_mtu", "lid")
            fields = ", ".join(f"{k} {port[k]}" for k in keys if k in port)
            lines.append(f"    port {port.get('port', '?')}: {fields}")
            gids = port.get("gids") or ([{"index": 0, "gid": port["gid"]}] if port.get("gid") else [])
            lines.extend(f"      gid[{g['index']}] {g['gid']}" for g in gids)
    return lines


def format_rdma_info(info: dict[str, Any]) -> str:
    """`rdma_info()` as text for a terminal."""
    lines = _format_source("pyverbs", info["pyverbs"]) + _format_source("epd_lab._verbs", info["own_binding"])
    agree = info["agree"]
    lines.append("device names agree: " + ("n/a (one source is unavailable)" if agree is None else
                                           "yes" if agree else "NO"))
    return "\n".join(lines)
