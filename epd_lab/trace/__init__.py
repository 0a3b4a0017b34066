"""Tracing: spans recorded in every process (`spans`), one table of them and its exports
(`frame`), their collection from a cluster's servers with each node's clock offset (`collect`), and a
request's critical path through them with the time no span covers (`critical`)."""
from epd_lab.trace.collect import ClockOffset, SpansPage, clock_answer, collect, estimate_clock_offset, spans_answer
from epd_lab.trace.critical import GAP, PATH_COLUMNS, critical_path, summarize_critical_paths
from epd_lab.trace.frame import (COLUMNS, frame_spans, load_frame, request_of, save_frame, spans_frame,
                                 to_chrome_trace)
from epd_lab.trace.spans import (DATA_STAGES, PD_STAGES, STAGES, TRANSFER_STAGES, Recorder, Span, bare_request_id,
                                 clock_id, of_request, request_breakdown, tracing_enabled)

__all__ = ["COLUMNS", "DATA_STAGES", "GAP", "PATH_COLUMNS", "PD_STAGES", "STAGES", "TRANSFER_STAGES", "ClockOffset",
           "Recorder", "Span", "SpansPage", "bare_request_id", "clock_answer", "clock_id", "collect", "critical_path",
           "estimate_clock_offset", "frame_spans", "load_frame", "of_request", "request_breakdown", "request_of",
           "save_frame", "spans_answer", "spans_frame", "summarize_critical_paths", "to_chrome_trace",
           "tracing_enabled"]
