"""The servers, one module per role, each on the serving floor (`epd_lab.serving`).

- `encoder`: ``python -m epd_lab.servers.encoder --port 0``: ``POST /encode``, ``/send`` (E of EPD, seed 000).
- `prefill`: ``python -m epd_lab.servers.prefill --port 0 [--encoders URL,URL]``: ``POST /v1/prefill``,
  ``/v1/abort`` (E→P through `epd_lab.ep`, then the KV producer of `epd_lab.kv`).
- `decode`: ``python -m epd_lab.servers.decode --port 0``: ``POST /v1/decode`` (the KV consumer; its generation
  loop is `scheduler`'s `DecodeScheduler`).
- `proxy`: ``python -m epd_lab.servers.proxy --prefill URL --decode URL``: the OpenAI-compatible front, from
  `openai_api` (request and answer shapes), `routing` (backend pools) and `text` (chat template, detokenizer).
- `monolithic`: ``python -m epd_lab.servers.monolithic --port 0``: the whole model behind OpenAI's chat API, the
  floor the split is measured against; `front`: ``python -m epd_lab.servers.front --replica URL,URL``, a
  round-robin front over monolithic replicas.
- `messages`: the prefill and decode servers' HTTP bodies; `reference`: the monolithic answer a chat must equal.
- `model_settings`: the model roles' shared ``--model``/``--device``/``--dtype``/``--runtime`` (`ModelSettings`),
  paged-KV options (`PagedKVSettings`) and ``--transport`` (`transport_option`).
"""
