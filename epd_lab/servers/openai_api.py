"""OpenAI's request and response shapes, as the proxy reads and writes them.

`parse_request` turns a ``/v1/chat/completions`` or ``/v1/completions`` body into a `Job` (prompt rendering is
`epd_lab.servers.text`'s); `completion`, `chunk` and `usage` build the answers, `model_list` the ``/v1/models``
one; `error_body` is an error object ``{"error": {"message", "type", "code"}}`` for any `ServingError`.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import msgspec

from epd_lab.servers.messages import MAX_TOKENS, Seed
from epd_lab.servers.text import PromptError, completion_prompt, messages_to_prompt
from epd_lab.serving import BadRequest, ServingError

__all__ = ["DEFAULT_MAX_TOKENS", "MODEL_ID", "UNSUPPORTED", "Job", "chunk", "completion", "error_body",
           "model_list", "parse_request", "usage"]

MODEL_ID = "epd-lab-tiny-qwen2-vl"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; used for chat too
# OpenAI request fields this proxy does not implement: accepted only absent, null or at their neutral value,
# so that a client asking for them gets a 400 instead of a silently different answer
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "stop": ("", []), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,),
    "suffix": ("",), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "response_format": ({"type": "text"},), "top_p": (1,), "presence_penalty": (0,),
    "frequency_penalty": (0,),
}
# OpenAI's error `type` by HTTP status (its `code` is the error's own)
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 499: "client_disconnect", 502: "backend_error",
               503: "service_unavailable", 504: "timeout"}


def error_body(exc: ServingError) -> dict[str, Any]:
    """OpenAI's error object for `exc`."""
    return {"error": {"message": exc.detail, "type": ERROR_TYPES.get(exc.status, "server_error"), "code": exc.code}}


class _StreamOptions(msgspec.Struct):
    """``stream_options``: only ``include_usage`` is acted on."""

    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """The request fields the proxy acts on. Others are ignored, as OpenAI-compatible servers do: ``model``
    among them (any name is served by the one model), except those in `UNSUPPORTED`."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # chat's newer name for max_tokens
    temperature: float | None = None
    seed: Seed | None = None  # decode's range, checked here: a streamed answer must not begin and then fail on it
    stream: bool | None = None
    stream_options: _StreamOptions | None = None


@dataclasses.dataclass(slots=True)
class Job:
    """One client request on its way through the proxy."""

    rid: str
    kind: str  # "chat" or "text"
    t0: int  # time.monotonic_ns() when the request arrived
    created: int  # unix seconds, for OpenAI's `created`
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    include_usage: bool
    prompt_len: int = 0
    deadline: float = float("inf")  # time.monotonic() by which its sender wants the whole answer

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.rid


def parse_request(body: Any, kind: str, t0: int) -> tuple[Job, str, list[str]]:
    """Validate a client request that arrived at `t0` (monotonic ns) → (job, prompt text, media items);
    `BadRequest` on anything unusable."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise BadRequest(f"{name!r} is not supported by this server")
    try:
        sampling = msgspec.convert(body, _Sampling)
        if kind == "chat":
            prompt, images = messages_to_prompt(body.get("messages"))
        else:
            prompt, images = completion_prompt(body.get("prompt")), []
    except (msgspec.ValidationError, PromptError) as exc:
        raise BadRequest(str(exc)) from None
    max_tokens = next((n for n in (sampling.max_completion_tokens, sampling.max_tokens) if n is not None),
                      DEFAULT_MAX_TOKENS)
    if not 1 <= max_tokens <= MAX_TOKENS:  # decode's own bound: refused here, not after a streamed 200
        raise BadRequest(f"max_tokens must be in [1, {MAX_TOKENS}], got {max_tokens}")
    temperature = 1.0 if sampling.temperature is None else sampling.temperature  # OpenAI's default
    if not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}")
    stream = bool(sampling.stream)
    job = Job(rid=uuid.uuid4().hex, kind=kind, t0=t0, created=int(time.time()),
               max_tokens=max_tokens, temperature=temperature, seed=sampling.seed, stream=stream,
               include_usage=stream and sampling.stream_options is not None and sampling.stream_options.include_usage)
    return job, prompt, images


def model_list(model: str, **fields: Any) -> dict[str, Any]:
    """The ``GET /v1/models`` answer: the one model a server serves, with the server's own `fields` (``created``,
    ``root``)."""
    return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "epd_lab", **fields}]}


def usage(job: Job, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` of a finished job."""
    return {"prompt_tokens": job.prompt_len, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_len + completion_tokens}


def completion(job: Job, model: str, text: str, finish_reason: str, completion_tokens: int) -> dict[str, Any]:
    """The non-streamed answer: a ``chat.completion`` or a ``text_completion``."""
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": job.response_id, "object": obj, "created": job.created, "model": model, "choices": [choice],
            "usage": usage(job, completion_tokens)}


def chunk(job: Job, model: str, text: str | None, finish_reason: str | None = None, *, role: bool = False,
          usage: dict[str, int] | None = None) -> bytes:
    """One SSE event in OpenAI's chunk format; `text` None with `usage`: the usage chunk (no choices)."""
    if job.kind == "chat":
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    event: dict[str, Any] = {"id": job.response_id, "object": obj, "created": job.created, "model": model,
                             "choices": [] if usage else [choice]}
    if usage:
        event["usage"] = usage
    return b"data: " + msgspec.json.encode(event) + b"\n\n"
