"""The shm path's two copies (memcpy, streaming stores) and the per-machine choice between them.

No speed is asserted here: speed lives in the benchmarks (`python -m epd_lab.bench.shm_copy`,
`epd-lab bench transfer`).
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epd_lab import _native
from epd_lab.transfer import TransferEngine, shm_copy

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_policy(monkeypatch, tmp_path):
    """This process as before its first shm peer (policy not settled, no EPD_SHM_COPY), its cache under
    tmp_path; the policy in force before comes back afterwards."""
    before = _native.copy_policy()
    monkeypatch.setattr(shm_copy, "_settled", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(shm_copy.ENV, raising=False)
    yield tmp_path
    _native.set_copy_policy(before["large_copy"], before["large_min"])


def rows(*gbps: float) -> list[dict]:
    """Calibration rows as `shm_copy.calibrate` returns them: (memcpy, stream) GB/s at 16, 64, 192 MiB..."""
    sizes = (16 * MiB, 64 * MiB, 192 * MiB)
    return [{"size": size, "memcpy_gbps": m, "stream_gbps": st}
            for size, m, st in zip(sizes, gbps[::2], gbps[1::2])]


def no_calibration(*args, **kwargs):
    raise AssertionError("calibrate() ran, but the policy should have come from elsewhere")


@pytest.mark.parametrize("copy", ["memcpy", "stream"])
def test_both_copies_place_the_same_bytes(copy):
    """Odd sizes at every kind of misalignment; the bytes around the destination stay untouched."""
    src = np.random.default_rng(5).integers(0, 256, 2 * MiB, dtype=np.uint8)
    sizes = [1, 63, 64, 65, 127, 128, 129, 191, 4095, 4096 + 17, 65536 + 3, MiB + 7]
    for n, s_off, d_off in itertools.product(sizes, (0, 1, 13, 63), (0, 5, 32, 63)):
        dst = np.full(n + 128, 0xAA, dtype=np.uint8)
        _native.copy_bytes(dst[d_off:d_off + n], src[s_off:s_off + n], copy)
        assert np.array_equal(dst[d_off:d_off + n], src[s_off:s_off + n]), (n, s_off, d_off)
        assert (dst[:d_off] == 0xAA).all() and (dst[d_off + n:] == 0xAA).all(), (n, s_off, d_off)


def test_copy_bytes_and_the_policy_refuse_misuse():
    a, b = np.zeros(64, dtype=np.uint8), np.ones(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="must be equal"):
        _native.copy_bytes(a[:32], b, "memcpy")
    with pytest.raises(ValueError, match="memcpy, stream"):
        _native.copy_bytes(a, b, "fast")
    with pytest.raises((BufferError, ValueError)):
        _native.copy_bytes(bytes(64), b, "stream")  # read-only destination
    with pytest.raises(ValueError, match="memcpy, stream"):
        _native.set_copy_policy("fast", 0)
    with pytest.raises(OverflowError):
        _native.set_copy_policy("memcpy", -1)


def test_policy_round_trip(fresh_policy):
    shm_copy.set_policy("memcpy", 32 * MiB)
    got = shm_copy.current()
    assert (got["large_copy"], got["large_min"], got["source"]) == ("memcpy", 32 * MiB, "set")
    assert got["stream_isa"] in ("avx2", "sse2", "")
    assert got["stream_batch_min"] == 4 * MiB and got["stream_min"] == 4096
    assert shm_copy.ensure()["source"] == "set"  # a policy set by hand is kept


@pytest.mark.parametrize("mode", ["memcpy", "stream", " Stream "])
def test_env_override(fresh_policy, monkeypatch, mode):
    monkeypatch.setenv(shm_copy.ENV, mode)
    monkeypatch.setattr(shm_copy, "calibrate", no_calibration)
    got = shm_copy.ensure()
    assert (got["large_copy"], got["large_min"], got["source"]) == (mode.strip().lower(), 0, "env")
    assert not (fresh_policy / "epd_lab").exists()  # nothing measured, nothing cached


def test_env_override_rejects_unknown_values(fresh_policy, monkeypatch):
    monkeypatch.setenv(shm_copy.ENV, "fast")
    with pytest.raises(ValueError, match="EPD_SHM_COPY='fast': choose one of auto, memcpy, stream"):
        shm_copy.ensure()


@pytest.mark.parametrize("measured, policy", [
    (rows(10, 15, 10, 15), ("stream", 0)),              # AMD EPYC here
    (rows(10, 11.5, 10.5, 7.6), ("memcpy", 32 * MiB)),  # the Intel VM: stream wins 16 MiB, loses 256
    (rows(12, 10, 12, 10), ("memcpy", 4 * MiB)),        # memcpy wins everywhere
    (rows(12, 10, 10, 12), ("stream", 0)),              # a larger size won by stream ends memcpy's run
    (rows(10, 10, 10, 10), ("stream", 0)),              # a tie keeps stream
])
def test_choose(measured, policy):
    assert shm_copy.choose(measured) == policy
    assert shm_copy.choose(measured[::-1]) == policy  # row order does not matter


NT = 151 * MiB  # glibc's non-temporal threshold on the Intel Xeon host here


@pytest.mark.parametrize("measured, nt, policy", [
    # the Intel Xeon host, measured: stream wins at 16 and 64 MiB, glibc's own loop past its switch
    (rows(6.2, 11.9, 6.1, 8.5, 9.9, 7.8), NT, ("memcpy", NT)),
    (rows(6.2, 11.9, 6.1, 8.5, 9.9, 7.8), None, ("memcpy", 110 * MiB)),  # switch unknown: the mean
    (rows(9.7, 15.2, 9.4, 15.4, 12.6, 19.7), 240 * MiB, ("stream", 0)),  # the AMD EPYC here
])
def test_choose_switches_at_glibcs_threshold(measured, nt, policy):
    got = shm_copy.choose(measured, nt)
    assert got[0] == policy[0] and abs(got[1] - policy[1]) <= MiB


@pytest.mark.parametrize("nt, sizes", [
    (151 * MiB, (16 * MiB, 64 * MiB, 192 * MiB)),
    (240 * MiB, (16 * MiB, 64 * MiB, 256 * MiB)),
    (None, (16 * MiB, 64 * MiB, 256 * MiB)),
    (32 * MiB, (16 * MiB, 64 * MiB)),  # already past it at 64 MiB
    (4 << 30, (16 * MiB, 64 * MiB, shm_copy.LARGEST)),
])
def test_calibration_sizes_reach_past_glibcs_switch(nt, sizes):
    assert shm_copy.calibration_sizes(nt) == sizes


def test_calibration_picks_one_caches_it_and_the_next_process_reuses_it(fresh_policy, monkeypatch):
    got = shm_copy.ensure()  # a real calibration
    assert got["source"] == "calibrated"
    assert got["large_copy"] in _native.COPIES and got["large_min"] >= 0
    sizes = shm_copy.calibration_sizes(shm_copy.memcpy_nt_threshold())
    assert [r["size"] for r in got["measured_gbps"]] == list(sizes)
    assert all(r[f"{c}_gbps"] > 0 for r in got["measured_gbps"] for c in _native.COPIES)
    path = Path(got["cache"])
    assert path == shm_copy.cache_path() and path.parent == fresh_policy / "epd_lab"
    data = json.loads(path.read_text())
    assert data["key"] == shm_copy.cache_key()
    assert (data["large_copy"], data["large_min"]) == (got["large_copy"], got["large_min"])
    assert not list(path.parent.glob("*.tmp"))

    monkeypatch.setattr(shm_copy, "_settled", None)  # as a new process on this machine
    monkeypatch.setattr(shm_copy, "calibrate", no_calibration)
    again = shm_copy.ensure()
    assert again["source"] == "cache"
    assert (again["large_copy"], again["large_min"]) == (got["large_copy"], got["large_min"])


def _foreign() -> str:
    key = {**shm_copy.cache_key(), "cpu": "Some Other CPU"}
    return json.dumps({"version": shm_copy.CACHE_VERSION, "key": key, "large_copy": "memcpy", "large_min": 0,
                       "measured_gbps": []})


def _bad_field(field: str, value) -> str:
    return json.dumps({"version": shm_copy.CACHE_VERSION, "key": shm_copy.cache_key(), "large_copy": "memcpy",
                       "large_min": 0, "measured_gbps": [], field: value})


@pytest.mark.parametrize("content", [
    pytest.param(lambda: "{not json", id="not-json"),
    pytest.param(lambda: "\xff\xfe", id="not-utf8"),
    pytest.param(lambda: "[1, 2]", id="a-list"),
    pytest.param(lambda: '{"version": 1}', id="fields-missing"),
    pytest.param(_foreign, id="another-machine"),
    pytest.param(lambda: _bad_field("large_copy", "fast"), id="unknown-copy"),
    pytest.param(lambda: _bad_field("large_min", -1), id="negative-threshold"),
    pytest.param(lambda: _bad_field("version", 0), id="old-version"),
])
def test_a_corrupt_or_foreign_cache_is_measured_again(fresh_policy, monkeypatch, content):
    path = shm_copy.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(content(), encoding="latin-1")
    monkeypatch.setattr(shm_copy, "calibrate", lambda sizes=None: rows(10, 11.5, 10.5, 7.6))
    got = shm_copy.ensure()
    assert (got["source"], got["large_copy"], got["large_min"]) == ("calibrated", "memcpy", 32 * MiB)
    assert shm_copy.read_cache(path, shm_copy.cache_key())["large_min"] == 32 * MiB  # replaced by a good one


def test_an_unwritable_cache_still_settles_the_policy(fresh_policy, monkeypatch):
    blocker = fresh_policy / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(shm_copy, "calibrate", lambda sizes=None: rows(10, 15, 10, 15))
    got = shm_copy.ensure()
    assert (got["source"], got["large_copy"], got["cache"]) == ("calibrated", "stream", None)


def test_an_engine_that_may_use_shm_settles_the_policy_as_it_opens(fresh_policy, monkeypatch, peer):
    monkeypatch.setenv(shm_copy.ENV, "memcpy")
    with TransferEngine(protocol="tcp", timeout=2.0):
        assert shm_copy.current()["source"] == "default"  # tcp never copies through shm
    with TransferEngine(protocol="shm", timeout=2.0) as e:
        assert (shm_copy.current()["source"], shm_copy.current()["large_copy"]) == ("env", "memcpy")
        assert e.path_to(peer.session_id) == "shm"
    assert (shm_copy.current()["source"], shm_copy.current()["large_copy"]) == ("env", "memcpy")


@pytest.mark.parametrize("protocol, policy", [
    ("shm", ("stream", 0)), ("shm", ("memcpy", 0)), ("shm", ("memcpy", 2 * MiB)), ("tcp", None)],
    ids=["shm-stream", "shm-memcpy", "shm-mixed", "tcp"])
def test_large_unaligned_batch(fresh_policy, peer, protocol, policy):
    """Batches of 4 MiB and more take the policy's copies on shm (mixed: blocks from 2 MiB use memcpy,
    smaller ones stream): odd sizes and unaligned addresses must land exactly, and the bytes around
    each block stay untouched."""
    if policy:
        shm_copy.set_policy(*policy)
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 12 * MiB, dtype=np.uint8)
    dst = peer.alloc(16 * MiB, managed=True)
    sizes = [1, 15, 63, 64, 65, 4095, 65537, 1 * MiB + 7, 3 * MiB + 33, 5 * MiB - 1]
    srcs, dsts, s_off, d_off = [], [], 3, 5
    for n in sizes:
        srcs.append(src.ctypes.data + s_off)
        dsts.append(dst + d_off)
        s_off += n + 1
        d_off += n + 9  # leave gaps
    with TransferEngine(protocol=protocol) as e:
        e.register_buffer(src)
        e.batch_transfer_sync_write(peer.session_id, srcs, dsts, sizes)
    got = peer.read(dst, d_off)
    want = bytearray(d_off)
    for s, d, n in zip(srcs, dsts, sizes, strict=True):
        want[d - dst:d - dst + n] = src[s - src.ctypes.data:s - src.ctypes.data + n].tobytes()
    assert got == bytes(want)


def test_bench_transfer_records_the_machine_and_the_copy_policy(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, shm_copy.ENV: "memcpy", "XDG_CACHE_HOME": str(tmp_path)}
    subprocess.run([sys.executable, "-m", "epd_lab.cli", "bench", "transfer", "--paths", "memcpy,shm",
                    "--sizes", "4096", "--budget", "0.01", "--no-scatter", "--json", str(out)],
                   check=True, capture_output=True, timeout=120, env=env)
    data = json.loads(out.read_text())
    assert (data["copy_policy"]["source"], data["copy_policy"]["large_copy"]) == ("env", "memcpy")
    machine = data["machine"]
    assert {"cpu", "vendor", "cpu_flags", "libc", "memcpy_nt_threshold"} <= set(machine)
    assert isinstance(machine["cpu_flags"], list)


def test_quick_copy_bench_needs_only_numpy_and_the_native_module(tmp_path):
    """`python -m epd_lab.bench.shm_copy` runs where pyzmq, msgspec and torch are missing (its peer
    processes too)."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("zmq", "msgspec", "torch", "msgpack"):
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} is blocked in this test')\n")
    path = os.pathsep.join(p for p in (str(blocked), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "XDG_CACHE_HOME": str(tmp_path)}
    out = tmp_path / "copy.json"
    proc = subprocess.run([sys.executable, "-m", "epd_lab.bench.shm_copy", "--sizes", str(4 * MiB),
                           "--repeats", "1", "--budget", "0.03", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["policy"]["source"] == "calibrated"
    assert set(data["two_process"][str(4 * MiB)]) == {
        "numpy.copyto", "shm memcpy", "shm stream", "shm chosen", "shm_registered"}
    assert set(data["in_process"][str(4 * MiB)]) == {"numpy.copyto", *_native.COPIES}
