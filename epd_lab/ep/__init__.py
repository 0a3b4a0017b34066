"""Encoder disaggregation (E→P) below the servers: the wire messages, media loading, the embedding cache, the
push sockets to receivers, and the prefill-side receiver (`EPDPrefill`). The encode server itself is
`epd_lab.servers.encoder`."""
