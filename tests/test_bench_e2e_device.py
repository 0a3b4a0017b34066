"""`epd-lab bench e2e` with `--device`, `--model`, `--dtype`, `--image-size`, `--images`, `--kv-tokens`: a tiny run
through the real servers on the CPU, over a grid of two image counts, checks what the JSON holds (not a speed
test); `--device cuda` without a GPU fails at once with the reason; on a GPU (marked `cuda`, run on the device
machine) the same small run on CUDA."""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from epd_lab.bench.e2e import Capacity, Setup, capacity
from epd_lab.transfer.cuda_runtime import unavailable_reason

NO_GPU = unavailable_reason()
# one backend, one level, few tokens: two clusters start, so this is the bulk of the test's time
SMALL = ["--backends", "mooncake", "--requests", "2", "--concurrency", "1", "--max-tokens", "4", "--kv-tokens", "40"]


def _bench(tmp_path, *args: str, timeout: float = 110) -> tuple[dict, str]:
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "-m", "epd_lab.cli", "bench", "e2e", *SMALL, *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _check(data: dict, device: str, dtype: str, image_size: int, image_tokens: int, images: tuple[int, ...]) -> None:
    """`image_tokens`: one image's."""
    assert data["device"] == device and data["model"] == "tiny" and data["dtype"] == dtype
    assert data["machine"]["cores"] >= 1 and data["max_tokens"] == 4 and data["concurrency"] == [1]
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).itemsize
    assert [(p["image_size"], p["images"]) for p in data["grid"]] == [(image_size, n) for n in images]
    for point in data["grid"]:
        n = point["images"]
        assert point["image_tokens"] == n * image_tokens
        assert point["embedding_bytes"] == n * image_tokens * 256 * itemsize
        # the rendered chat's text, plus each image's tokens and its vision_start/vision_end
        assert point["prompt_tokens"] > n * (image_tokens + 2)
        assert point["answers_equal_monolithic"] is True and set(point["ttft_overhead_ms"]) == {"epd/mooncake"}
    assert [(r["path"], r["images"], r["concurrency"]) for r in data["rows"]] == \
        [("monolithic", n, 1) for n in images] + [("epd/mooncake", n, 1) for n in images]
    for row in data["rows"]:
        assert row["image_size"] == image_size
        assert 0 < row["ttft_ms"]["min"] <= row["ttft_ms"]["p50"] <= row["ttft_ms"]["max"]
        assert row["tpot_ms"]["p50"] > 0 and row["requests_per_s"] > 0 and row["ttft_ms"]["n"] == 2
    for epd in data["rows"][len(images):]:
        assert epd["answer_ok"] is True
        assert {"vit", "prefill", "ttft"} <= {p["stage"] for p in epd["critical_path"]}
    assert data["answers_equal_monolithic"] is True and data["complete"] is True
    # the caches and the encoders hold the largest point at the highest level, never less than the defaults
    assert data["kv_blocks"] >= 512 and data["max_held_bytes"] >= 512 << 20
    kv = data["kv_transfer"]
    assert kv["prompt_tokens"] == 40 and kv["blocks"] == 3  # 16-token blocks
    assert kv["bytes"] > 0 and kv["ms"]["p50"] > 0 and kv["gbps"]["p50"] > 0


def test_a_small_cpu_run_writes_device_model_and_timings(tmp_path):
    data, stdout = _bench(tmp_path, "--device", "cpu", "--model", "tiny", "--image-size", "112", "--images", "1,2",
                          "--keep-cpus-awake")
    _check(data, "cpu", "float32", 112, 16, (1, 2))  # 112² → 8×8 patches → 16 tokens after the 2×2 merge
    assert data["gpu"] is None and data["recv_buffer"] == "host" and data["gated_prefill"] is False  # auto, CPU
    assert data["cpus_awake"] == sorted(os.sched_getaffinity(0))  # a spinner on each, for the whole run
    assert "tiny on cpu (no GPU), float32" in stdout


def test_images_by_url_are_fetched_by_the_encoders_and_the_floor_and_paired(tmp_path):
    data, stdout = _bench(tmp_path, "--device", "cpu", "--image-size", "112", "--images", "1", "--media", "url",
                          "--pairs", "3")
    _check(data, "cpu", "float32", 112, 16, (1,))
    assert data["media"] == "url" and {r["media"] for r in data["rows"]} == {"url"} and "by url" in stdout
    # every image a request named was fetched once from the bench's media server: the floor's 2 timed requests
    # and its warm-up, then the cluster's 2-image warm-up, its checked request and the 2 timed ones; then the
    # paired rounds (a warm-up and 3), one request each through the floor and the cluster
    assert data["media_fetches"] == 3 + 2 + 1 + 2 + 2 * 4
    assert {"load", "vit"} <= {p["stage"] for p in data["rows"][1]["critical_path"]}
    [pair] = data["paired"]
    assert (pair["path"], pair["images"], pair["image_size"], pair["pairs"]) == ("epd/mooncake", 1, 112, 3)
    rounds = pair["rounds"]
    assert [r["first"] for r in rounds] == ["split", "floor", "split"]  # alternating, after a warm-up first
    assert all(r["floor_ttft_ms"] > 0 and r["split_ttft_ms"] > r["transfer_spans_ms"] > 0 for r in rounds)
    diff = sorted(r["split_ttft_ms"] - r["floor_ttft_ms"] for r in rounds)
    assert pair["split_minus_floor_ms"]["p50"] == pytest.approx(diff[1])
    less = sorted(r["split_ttft_ms"] - r["floor_ttft_ms"] - r["transfer_spans_ms"] for r in rounds)
    assert pair["split_minus_floor_less_spans_ms"]["p50"] == pytest.approx(less[1])
    assert "3 alternating pairs: split − floor" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cuda runs")
def test_cuda_without_a_gpu_fails_at_once_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "epd_lab.cli", "bench", "e2e", "--device", "cuda"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--device cuda: no CUDA device is visible" in proc.stderr
    assert proc.stdout == ""  # nothing measured, no process started


@pytest.mark.parametrize("args, message", [
    (["--device", "gpu"], "expected cpu, cuda or cuda:N"),
    (["--image-size", "20"], "image_size must be >= 56"),
    (["--kv-tokens", "0"], "kv_tokens must be >= 1"),
    (["--concurrency", "1,0"], "expected positive integers"),
    (["--image-size", "224,20"], "image_size must be >= 56"),  # every point is checked before anything runs
    (["--images", "1,x"], "invalid _ints value"),
    (["--dtype", "float16"], "invalid choice"),
    (["--media", "path"], "invalid choice"),
    (["--recv-buffer", "device"], "a device receive buffer needs a CUDA device"),
    (["--recv-buffer", "gpu"], "invalid choice"),
    (["--pairs", "-1"], "--pairs must be >= 0"),
])
def test_bad_options_are_refused_before_anything_runs(capsys, args, message):
    from epd_lab.bench.e2e import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_capacity_holds_the_largest_point_at_the_highest_level_twice():
    # 8 x 896² on the 2B shape: 8,338 prompt tokens and 24 MiB of embeddings per request, 16 in flight
    floors = [{"prompt_tokens": 300, "embedding_bytes": 1 << 20}, {"prompt_tokens": 8338, "embedding_bytes": 24 << 20}]
    room = capacity(floors, max_tokens=16, concurrency=16, kv_tokens=4096)
    assert room == Capacity(kv_blocks=2 * 16 * (-(-(8338 + 16) // 16) + 1), max_held_bytes=2 * 16 * (24 << 20))
    # small points keep the roles' defaults; a long kv_transfer prompt sizes the caches on its own
    assert capacity(floors[:1], 16, 1, 512) == Capacity()
    assert capacity(floors[:1], 16, 16, 4096).kv_blocks == 2 * 16 * (-(-4098 // 16) + 1)


def test_setup_resolves_the_dtype_per_device():
    assert Setup().torch_dtype == torch.float32
    assert Setup(device="cuda").torch_dtype == torch.bfloat16  # resolved by name: no GPU needed
    assert Setup(dtype="bfloat16").torch_dtype == torch.bfloat16


@pytest.mark.cuda
@pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")
def test_a_small_cuda_run_records_the_gpu(tmp_path):
    data, _ = _bench(tmp_path, "--device", "cuda", "--image-size", "224", timeout=300)
    _check(data, "cuda:0", "bfloat16", 224, 64, (1,))
    assert data["gpu"] == torch.cuda.get_device_name(0) and data["machine"]["gpu"] == data["gpu"]


class _SSEHandler(http.server.BaseHTTPRequestHandler):
    """Streams three content chunks 0.2 s apart (chunked, as the proxy does), then drops the connection when the
    path says so (as a server ending an idle kept-alive connection would)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        role = b'data: {"id": "chatcmpl-1", "choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
        events = [role + b'data: {"id": "chatcmpl-1", "choices": [{"delta": {"content": "a"}}]}\n\n',
                  b'data: {"id": "chatcmpl-1", "choices": [{"delta": {"content": "b"}}]}\n',  # a line split
                  b'\ndata: {"id": "chatcmpl-1", "choices": [{"delta": {"content": "c"}}]}\n\ndata: [DONE]\n\n']
        for i, event in enumerate(events):
            if i:
                time.sleep(0.2)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = self.path == "/drop/v1/chat/completions"

    def log_message(self, *args: object) -> None:
        pass


def test_stream_client_times_each_chunk_as_it_arrives_and_replaces_a_dropped_connection():
    from epd_lab.bench.e2e import StreamClient

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSEHandler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        for prefix in ("/drop", ""):  # the first answer ends its connection: the next request opens another
            client = StreamClient(f"http://127.0.0.1:{srv.server_address[1]}{prefix}")
            for _ in range(2):
                chat = client.chat(b"{}", max_tokens=3)
                assert (chat.text, chat.response_id) == ("abc", "chatcmpl-1")
                assert chat.ttft < 150  # the first chunk, timed on arrival: not at the stream's end
                assert 150 < chat.second < 400 and 150 < chat.tpot < 400  # 0.2 s apart
                time.sleep(0.05)  # the dropping server has closed its end by now
            client.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_mps_daemon_is_found_by_its_process_not_by_a_pipe_left_behind():
    from epd_lab.machine import MPS_COMM, mps_daemon

    assert not mps_daemon()  # none runs here (the control pipe a quit daemon leaves does not count)
    # a process named as the daemon is (its comm), for as long as it runs
    proc = subprocess.Popen([sys.executable, "-c", f"open('/proc/self/comm', 'w').write({MPS_COMM!r}); "
                             "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not mps_daemon() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mps_daemon()
    finally:
        proc.communicate(timeout=10)
    assert not mps_daemon()
