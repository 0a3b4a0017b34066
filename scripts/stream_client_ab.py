"""Side by side, one cluster: `bench e2e`'s streaming client against the `http.client` one it replaced,
alternating per request at concurrency 1, and where each one's client-side time goes: from its send to the
proxy's ``proxy_parse`` span, and from the proxy's ``ttft`` span's end to its first content chunk parsed (one
host, one clock). Writes JSON.

    python scripts/stream_client_ab.py --requests 100 --json data/bench/stream-client-ab-cpu-amd-epyc.json
"""
from __future__ import annotations

import argparse
import http.client
import statistics
import threading
import time
import urllib.parse

import msgspec

from epd_lab.bench import write_json
from epd_lab.bench.e2e import Capacity, Media, Setup, StreamClient, _Chat, _images, _SSEChunk, _timed, cluster_for, \
    render
from epd_lab.machine import machine_info
from epd_lab.trace import bare_request_id


class HTTPClientStream:
    """The client `bench e2e` used before: kept-alive `http.client`, the SSE read line by line."""

    def __init__(self, base_url: str) -> None:
        url = urllib.parse.urlsplit(base_url)
        self.host, self.port, self._local = url.hostname, url.port, threading.local()

    def chat(self, body: bytes, max_tokens: int) -> _Chat:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        times, rid, text = [], "", []
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = msgspec.json.decode(line[6:], type=_SSEChunk)
            rid = chunk.id or rid
            content = chunk.choices[0].get("delta", {}).get("content") if chunk.choices else None
            if content:
                times.append(time.perf_counter())
                text.append(content)
        return _timed(t0, times, time.perf_counter(), rid, text, max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100, help="per client, after 2 warm-up rounds")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    setup = Setup(device="cpu", model="tiny", image_size=224, images=1, media="url")
    with Media("url") as media, cluster_for(setup, "mooncake", False, Capacity()) as cluster:
        clients = {"http.client": HTTPClientStream(cluster.proxy_url), "httptools": StreamClient(cluster.proxy_url)}
        timed: dict[str, list[tuple[str, float, float, float]]] = {name: [] for name in clients}
        for i in range(args.requests + 2):
            for j, name in enumerate(list(clients)[::1 if i % 2 else -1]):
                body = render(media.messages(_images((7000, i, j), setup)), 4)
                t0 = time.perf_counter()
                chat = clients[name].chat(body, 4)
                if i >= 2:
                    timed[name].append((chat.response_id, t0 * 1e9, (t0 + chat.ttft / 1e3) * 1e9, chat.ttft))
        frame = cluster.spans()
    rows = {}
    for name, runs in timed.items():
        legs_in, legs_out = [], []
        for rid, t0, t1, _ in runs:
            spans = frame[frame["request"] == bare_request_id(rid)]
            legs_in.append((spans[spans["stage"] == "proxy_parse"]["t_start_ns"].iloc[0] - t0) / 1e6)
            legs_out.append((t1 - spans[spans["stage"] == "ttft"]["t_end_ns"].iloc[0]) / 1e6)
        rows[name] = {"ttft_ms_p50": statistics.median(r[3] for r in runs),
                      "send_to_proxy_parse_ms_p50": float(statistics.median(legs_in)),
                      "ttft_span_end_to_first_chunk_ms_p50": float(statistics.median(legs_out)), "n": len(runs)}
        print(name, rows[name])
    write_json(args.json, {"what": __doc__.splitlines()[0], "machine": machine_info(), "model": "tiny",
                           "image": "1 x 224² by URL", "backend": "mooncake", "clients": rows})


if __name__ == "__main__":
    main()
