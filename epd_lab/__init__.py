"""epd_lab: a workbench for encode/prefill/decode disaggregated multimodal serving."""

__version__ = "0.1.0"
