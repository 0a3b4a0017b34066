"""The serving floor every epd_lab server stands on.

- `stack`: how a server starts (port 0, TCP_NODELAY, uvloop + httptools, the announced URL).
- `admission`: queued while the predicted wait fits the request's deadline, else a 503 at once.
- `liveness`: a backend's circuit as its caller sees it (refused, stalled, up), fed by /health probes; `Circuits`,
  a caller's backends' circuits: which are up, and the probe schedule (the proxy's, the front's, the receiver's).
- `app`: one lifespan, one error answer, one request counter, ``/health``, ``/metrics``, the trace routes.
- `errors`: typed errors that carry their HTTP status.
- `body`: one body reader under one limit, one JSON decoder.
- `metrics`: the request counter and the role's Prometheus families (prometheus-client), vLLM's where they mean
  the same.
- `settings`: a role's settings dataclass as its command line (`parser`, `from_argv`) and back (`to_argv`);
  `ServerSettings`, every role's base.
- `stream`: `ClosingStreamingResponse`, a streamed answer that cleans up however it ends; needs Starlette, so it
  is not re-exported here either.
"""
from epd_lab.serving.admission import DEADLINE_HEADER, KV_DEADLINE_HEADER, Admission, Ticket, deadline_budget
from epd_lab.serving.app import Role, json_response, role_app
from epd_lab.serving.body import MAX_BODY_BYTES, client_gone, decode_body, read_body, read_struct
from epd_lab.serving.errors import (BadGateway, BadRequest, ClientClosed, Conflict, Forbidden, GatewayTimeout,
                                    NotFound, PayloadTooLarge, ServingError, Unavailable, error_for_status)
from epd_lab.serving.liveness import PROBE_INTERVAL, PROBE_TIMEOUT, STALL_MISSES, STALL_SILENCE, Circuits, Liveness
from epd_lab.serving.metrics import Metric, RoleMetrics, engine_auth_failures, engine_metrics
from epd_lab.serving.settings import from_argv, option, parser, to_argv
from epd_lab.serving.stack import (CLIENT_KEEPALIVE_S, KEEPALIVE_S, LOOPS, PARSERS, bind_tcp, http_info, http_stack,
                                   run_server, serve_and_announce, serve_main, url_of)

__all__ = ["CLIENT_KEEPALIVE_S", "DEADLINE_HEADER", "KEEPALIVE_S", "KV_DEADLINE_HEADER", "LOOPS", "MAX_BODY_BYTES",
           "PARSERS", "PROBE_INTERVAL", "PROBE_TIMEOUT", "STALL_MISSES", "STALL_SILENCE", "Admission", "BadGateway",
           "BadRequest", "Circuits", "ClientClosed", "Conflict", "Forbidden", "GatewayTimeout", "Liveness", "Metric",
           "NotFound", "PayloadTooLarge", "Role", "RoleMetrics", "ServingError", "Ticket", "Unavailable", "bind_tcp",
           "client_gone", "deadline_budget", "decode_body", "engine_auth_failures", "engine_metrics",
           "error_for_status", "from_argv", "http_info", "http_stack", "json_response", "option", "parser",
           "read_body", "read_struct", "role_app", "run_server", "serve_and_announce", "serve_main", "to_argv",
           "url_of"]
