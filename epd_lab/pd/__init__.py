"""P→D servers: the prefill server (E→P, then the KV producer) and the decode server (KV consumer, generation).

- `messages`: the HTTP bodies (`PrefillRequest`, `PrefillResponse`, `KVTransferParams`, `DecodeRequest`, ...).
- `prefill_server`: ``python -m epd_lab.pd.prefill_server --port 0 [--encoders URL,URL]``: ``POST /v1/prefill``.
- `decode_server`: ``python -m epd_lab.pd.decode_server --port 0``: ``POST /v1/decode`` (NDJSON streaming too).

Both start like every server here (`epd_lab.serving`).
"""
