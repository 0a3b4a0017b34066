"""Old (http.client) against new (socket + httptools) StreamClient, alternating, one tiny cluster, c=1."""
import http.client, statistics, sys, threading, time, urllib.parse, json
import msgspec
from epd_lab.bench.e2e import Setup, Media, cluster_for, StreamClient, render, _images, _timed, _SSEChunk, Capacity

class Old:
    def __init__(self, base_url):
        url = urllib.parse.urlsplit(base_url)
        self.host, self.port, self._local = url.hostname, url.port, threading.local()
    def chat(self, body, max_tokens):
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
                times.append(time.perf_counter()); text.append(content)
        return _timed(t0, times, time.perf_counter(), rid, text, max_tokens)

N = int(sys.argv[1])
setup = Setup(device="cpu", model="tiny", image_size=224, images=1, media="url")
with Media("url") as media, cluster_for(setup, "mooncake", False, Capacity()) as cluster:
    clients = {"old": Old(cluster.proxy_url), "new": StreamClient(cluster.proxy_url)}
    ttft = {"old": [], "new": []}
    legs = {"old": [], "new": []}
    for i in range(N + 2):
        for name in (("old", "new") if i % 2 else ("new", "old")):
            body = render(media.messages(_images(7000 + 2 * i + (name == "new"), setup)), 4)
            t0 = time.perf_counter()
            c = clients[name].chat(body, 4)
            if i >= 2:
                ttft[name].append(c.ttft)
                legs[name].append((c.response_id, t0 * 1e9, (t0 + c.ttft / 1e3) * 1e9))
    for name, v in ttft.items():
        print(name, "ttft p50 %.3f  p25 %.3f  p75 %.3f" % (statistics.median(v), *statistics.quantiles(v, n=4)[::2]))
    frame = cluster.spans()
    from epd_lab.trace import bare_request_id
    for name, rows in legs.items():
        ins, outs = [], []
        for rid, t0, t1 in rows:
            sp = frame[frame["request"] == bare_request_id(rid)]
            parse = sp[sp["stage"] == "proxy_parse"].iloc[0]
            tt = sp[sp["stage"] == "ttft"].iloc[0]
            ins.append((parse["t_start_ns"] - t0) / 1e6)
            outs.append((t1 - tt["t_end_ns"]) / 1e6)
        print(name, "client->proxy_parse %.3f  ttft_end->client %.3f" % (statistics.median(ins), statistics.median(outs)))
    d = [n - o for n, o in zip(ttft["new"], ttft["old"])]
    print("new - old paired median %.3f ms" % statistics.median(d))
