"""Encoder disaggregation (E→P): the encode server, its wire messages and the prefill-side receiver."""
