"""The OpenAI-compatible proxy in front of prefill and decode servers (XpYd): ``epd-lab proxy``.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming SSE and non-streaming),
``GET /v1/models`` (one model), ``GET /v1/spans?request_id=...`` (one request's E→P→D timeline, by its id or
the response's), ``GET /v1/clock``, ``GET /health``, ``GET /metrics`` (Prometheus text).

One request, as vLLM's disaggregated proxy does it:

1. Render the prompt (`epd_lab.servers.text`: chat template, ``image_url`` parts → media items).
2. Choose a prefill and ``POST /v1/prefill`` with ``kv_transfer_params = {"do_remote_decode": true}`` and the
   client's ``temperature``/``seed`` (token 0 is drawn as the others: `epd_lab.models.sampling`). The prefill
   always produces exactly one token (OpenAI's ``max_tokens=1``), so no length is sent.
3. Choose a decode and ``POST /v1/decode`` with the prefill's ``kv_transfer_params`` unchanged and the
   client's ``max_tokens``/``temperature``/``seed``/``stream``. The decode's tokens are the whole completion
   (its first is the prefill's token, which reached it in ``kv_transfer_params``); they reach the client as
   detokenized text, streamed as they come when the client streams.

This module is the orchestration; OpenAI's shapes are `epd_lab.servers.openai_api`'s, the backend pools and the
client that calls them (probes, choice, a POST passed on to the next backend) `epd_lab.servers.routing`'s, the
backends' bodies `epd_lab.servers.messages`'s. Backends are called through `epd_lab.http.aio` (kept-alive connections).

Choice (``--policy``): ``round_robin``, or ``least_loaded`` (fewest requests in flight as this proxy counts
them; ties in round-robin order). A backend that refuses connections is marked down and skipped for
``--retry-after`` seconds; the request goes on to the next one (it never reached the failed one). When every
backend of a role is down, their ``/health`` is probed once before the request fails with 503.

Frozen backends (`epd_lab.serving.liveness`): every backend's ``/health`` is probed every 0.5 s; one that misses
two probes in a row is *stalled* and skipped until it answers again. The exchanges waiting on it give up at
once: a request not yet answered goes on to the next backend (a prefill is sent an abort, retried until it
wakes, as it may take the request up then), a decode stream already begun ends with a 504 error event. One
deadline (``--timeout``) bounds a request's answer however many backends it is offered to, so a request reaches
its client within seconds of a freeze, and never later than the timeout.

Dead prefills: one that closes or resets the connection before answering (killed) is marked down, sent an abort
in the background, and the request goes on to the next prefill, each tried once. Not decode: one that died may
have taken the prefill's KV already (the producer hands it to the first ask), so its client gets 502.
``epd_proxy_retries_total{role,reason}`` counts each pass to the next backend.

Failures are OpenAI error objects ``{"error": {"message", "type", "code"}}``: 400 for bad input (including a
backend's 400/413/422, whose ``detail`` is passed on: an image that does not decode is the client's error),
503 when no backend of a role is reachable, 504 when a backend passes ``--timeout``, 502 for any other
backend failure (its ``detail`` passed on). After a stream has begun, a failure is sent as a last
``data: {"error": ...}`` event, which the ``openai`` client raises as ``APIError``.

Overload (``docs/overload.md``): a client's ``X-EPD-Deadline-Ms`` (capped at ``--timeout``, which
is the default) is the request's deadline. A request that the prefills' lowest recent rate (0.7 of one still at
its prior; or this proxy's own measure of their drain, if slower), the proxy's own pending requests and
decode's expected time predict past it is refused with 503 before its body is read (`_admit`); the prefill is
sent what is left of it, less the decode's expected time. A prompt whose text alone is longer than the prefills take (their /health's
``max_prompt_tokens``) is answered 400 ``context_length_exceeded`` before it is forwarded; bodies over 64 KiB are
parsed in a thread, so that /health keeps answering. ``epd_proxy_refused_total{reason}`` counts both.

``--timeout`` is an idle timeout, as the transfer engine's: connecting, and each read of an answer, a long
stream of tokens is not cut short while tokens keep coming.

The proxy asks decode for a stream whether or not its client streams, so that ``--timeout`` bounds each token
rather than the whole generation (a long non-streamed answer is not cut at the timeout). A client that goes
away mid-stream: the upstream decode stream is closed at once, so the decode server stops generating and frees
the request's blocks (the prefill freed its blocks when decode pulled them). A non-streaming request runs to
its end.

Abort (vLLM's proxy does the same): when no decode takes a prefilled request (every decode down, a decode's
error or timeout, the proxy's handler cancelled) or its client is gone before decode begins (answered 499), the
proxy sends ``POST /v1/abort {"request_id"}`` to the prefill that served it, which frees the request's KV
blocks at once instead of after its ``--kv-free-timeout``. Best effort: an abort that fails is counted
(``epd_proxy_prefill_aborts_total``), and the prefill's free timeout still bounds the blocks' life.

Spans (`epd_lab.trace`), per request: the proxy's own ``ttft`` (request received → first token handed out) and
``tpot`` (from the first token; its duration is the mean time per output token after the first), for streamed
requests, and ``e2e`` for all; ``/metrics`` gives them as summaries. With them the recorder keeps the spans the
backends return (prefill: the E→P stages, ``prefill``, ``kv_write``; decode: ``kv_transfer``, ``decode_step``).
All share one host's CLOCK_MONOTONIC, so ``/v1/spans`` lines them up as one timeline.

Run: ``python -m epd_lab.servers.proxy --port 0 --prefill URL[,URL] --decode URL[,URL]`` prints
``{"url": ..., "pid": ...}``.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from epd_lab.http.aio import Answer
from epd_lab.servers.messages import AbortResponse, PrefillResponse, StreamDone, StreamError, StreamLine, StreamToken
from epd_lab.servers.openai_api import (MODEL_ID, Job, chunk, completion, error_body, model_list, parse_request,
                                        usage)
from epd_lab.servers.routing import (EXCHANGE_ERRORS, POLICIES, Backend, Pool, PoolClient, Stalled, backend_health,
                                     backend_metrics, progressing)
from epd_lab.servers.text import Detokenizer, detokenize, prompt_tokens
from epd_lab.serving import (DEADLINE_HEADER, KV_DEADLINE_HEADER, PROBE_INTERVAL, STALL_MISSES, BadGateway,
                             BadRequest, ClientClosed, GatewayTimeout, Metric, PayloadTooLarge, RoleMetrics,
                             ServingError, Unavailable, client_gone, deadline_budget, decode_body, json_response,
                             option, read_body, role_app, serve_main)
from epd_lab.serving.admission import EWMA_WEIGHT, Drain, RecentLow
from epd_lab.serving.body import SMALL_BODY_BYTES
from epd_lab.serving.metrics import request_histograms
from epd_lab.serving.settings import ServerSettings, check_at_least, check_choice, check_positive, check_urls
from epd_lab.serving.stream import ClosingStreamingResponse
from epd_lab.trace import Recorder, Span

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")
COMPLETION_ROUTES = frozenset(ROUTES[:2])  # admitted before routing (`Proxy.gate`)
DEADLINE_HEADER_BYTES = DEADLINE_HEADER.lower().encode()  # ASGI gives header names lower-cased, as bytes
# the ASGI scope's key for (when, behind how many pending) `Proxy.gate` admitted the request
ADMITTED = "epd.admitted"
# decode gives up on a request's KV this long before the request's deadline (`_kv_deadline`), so that its 504
# crosses decode → proxy → client within the deadline even on a loaded host
KV_ANSWER_S = 0.2
# the prefills' rate is planned with at its lowest of this many told (each probe, 0.5 s, may tell a new one while
# they work): a 1,000-burst and a half
RATE_MEMORY = 32
# a prefill's rate until it has measured one with every worker busy is its --service-prior, a guess, and a fresh
# cluster's first burst is judged on it before anything is measured: planned at this share of it, so that the
# proxy refuses at once what the prefill would refuse seconds later if the host is slower than the guess (a
# loaded host's first 1,000-burst ran at 29 per second on a prior of 40, and the prefill refused 116 at 3.4 s)
PRIOR_RATE_SHARE = 0.7


@dataclasses.dataclass(slots=True, frozen=True)
class ProxySettings(ServerSettings):
    """What a proxy is started with; checked on construction (`ValueError`)."""

    prefills: tuple[str, ...] = option(help="prefill server URL(s)", flag="--prefill")
    decodes: tuple[str, ...] = option(help="decode server URL(s)", flag="--decode")
    policy: str = option("round_robin", "how a backend is chosen", choices=POLICIES)
    timeout: float = option(30.0, "seconds; idle timeout of every backend call (connect, each read)")
    retry_after: float = option(5.0, "seconds a backend that refused a connection is skipped")
    model: str = option(MODEL_ID, "the model id /v1/models lists")
    pipelined: bool = option(False, "streamed requests: ask decode while prefill runs (else after prefill "
                                    "answered)")

    def __post_init__(self) -> None:
        ServerSettings.__post_init__(self)
        check_urls(self, "prefills", "prefill")
        check_urls(self, "decodes", "decode")
        check_choice(self, "policy", POLICIES)
        check_positive(self, "timeout")
        check_at_least(self, 0, "retry_after")


def _detail(raw: bytes, reason: str | None) -> str:
    """A backend's error detail: its JSON ``detail``, else the start of its body."""
    with contextlib.suppress(msgspec.DecodeError):
        body = msgspec.json.decode(raw)
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])
    return raw[:500].decode(errors="replace") or reason or ""


def _backend_error(backend: Backend, response: Answer, raw: bytes) -> ServingError:
    """A backend's non-200 answer (`raw`, its body) as the client's error (its input errors stay 4xx; its 503,
    with its ``Retry-After``, stays a 503)."""
    status, retry_after = response.status, response.headers.get("Retry-After")
    message = f"{backend.role} {backend.url} answered {status}: {_detail(raw, response.reason)}"
    if status in (400, 422):
        return BadRequest(message)
    if status == 413:
        return PayloadTooLarge(message)
    if status == 504:
        return GatewayTimeout(message)
    if status == 503:
        seconds = float(retry_after) if retry_after and retry_after.isdigit() else None
        return Unavailable(message, code="backend_unavailable", retry_after=seconds)
    return BadGateway(message)


# the codes of a prefill that never answered a request, which the next prefill may take
PASSED_OVER = frozenset({"backend_stalled", "backend_disconnected"})


def _stalled_error(backend: Backend) -> GatewayTimeout:
    return GatewayTimeout(f"{backend.role} {backend.url} stopped making progress (no answer to {STALL_MISSES} "
                          f"/health probes in a row)", code="backend_stalled")


def _disconnected_error(backend: Backend, exc: BaseException) -> BadGateway:
    return BadGateway(f"{backend.role} {backend.url} closed the connection before answering "
                      f"({type(exc).__name__}: {exc})", code="backend_disconnected")


def _transport_error(backend: Backend, exc: BaseException) -> ServingError:
    """A failed exchange with a backend (after connecting) as the client's error."""
    what = f"{backend.role} {backend.url}"
    if backend.stall.is_set():  # its exchanges were cut because it stopped answering
        return _stalled_error(backend)
    if isinstance(exc, asyncio.TimeoutError):
        return GatewayTimeout(f"{what} timed out ({type(exc).__name__})")
    return BadGateway(f"{what} failed: {type(exc).__name__}: {exc}")


def _decode_json(backend: Backend, raw: bytes, typ: type[Any]) -> Any:
    try:
        return msgspec.json.decode(raw, type=typ)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        what = getattr(typ, "__name__", "stream line")
        raise BadGateway(f"{backend.role} {backend.url} answered a malformed {what}: {exc}") from None


class Proxy:
    """The proxy's state: the pools, the HTTP client to the backends, the recorder and the counters."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.prefills = Pool("prefill", settings.prefills, settings.policy, settings.retry_after)
        self.decodes = Pool("decode", settings.decodes, settings.policy, settings.retry_after)
        # a prefill that closed the connection unanswered is passed over (`_post`); a decode is not
        self.client = PoolClient((self.prefills, self.decodes), settings.timeout, failed=_transport_error,
                                 answered=_backend_error, stalled=_stalled_error, disconnected=_disconnected_error)
        self.recorder = Recorder(node=f"proxy:{settings.port}")
        self.streams_aborted: collections.Counter[str] = collections.Counter()  # by reason
        self.prefill_aborts: collections.Counter[str] = collections.Counter()  # by result
        self.retries = self.client.retries  # passed on to the next backend, by (role, reason)
        self.metrics = RoleMetrics("proxy", settings.model)
        self.latency = request_histograms(self.metrics)  # vLLM's, as the client sees them: the proxy is its door
        # answered whole, by finish reason (both from the start, as vLLM's)
        self.successes: collections.Counter[str] = collections.Counter({"stop": 0, "length": 0})
        self.started = int(time.time())
        self._background: set[asyncio.Task] = set()  # aborts sent without waiting (held here against the GC)
        self.refused: collections.Counter[str] = collections.Counter()  # answers refused: 503s by code, too long
        self.decode_token_s = 0.0  # decode's seconds per token, as this proxy sees them (exponentially weighted)
        self.decode_s = 0.0  # a decode's time after its first token (weighted mean): kept back at admission
        self.pending = 0  # requests admitted here and not yet answered by a prefill
        self.intake_s = 0.0  # seconds from a request's arrival to its parsed body (weighted mean)
        self.drain = Drain()  # seconds per request pending, arrival to prefill's answer, as measured here
        self.low_rate = RecentLow(RATE_MEMORY)  # the prefills' summed rate, lowest lately

    async def run(self) -> None:
        """For the server's life (the floor runs it): probe every backend (`PoolClient.probe_forever`)."""
        await self.client.probe_forever()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.client.close()

    # ---- backends ----
    async def _call(self, pool: Pool, path: str, body: dict[str, Any], only: Backend | None = None,
                    lost: list[Backend] | None = None,
                    headers: dict[str, str] | None = None) -> tuple[Backend, bytes]:
        """`_post`, then its answer read: (the backend, the 200 answer's body), the connection back in the pool
        and the backend's ``inflight`` counted down again."""
        backend, response = await self._post(pool, path, body, only, lost, headers)
        try:
            if response.complete:  # the whole body came with the headers: no wait to watch
                raw = await response.read()
            else:
                raw = await progressing(backend, response.read())
            backend.liveness.heard()
            return backend, raw
        except (*EXCHANGE_ERRORS, Stalled, asyncio.CancelledError) as exc:
            if lost is not None:
                lost.append(backend)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise _transport_error(backend, exc) from None
        finally:
            backend.finish(response, reuse=True)

    async def _post(self, pool: Pool, path: str, body: dict[str, Any], only: Backend | None = None,
                    lost: list[Backend] | None = None,
                    headers: dict[str, str] | None = None) -> tuple[Backend, Answer]:
        """POST `body` to a backend of `pool` (`only` that one) through `PoolClient.post`: passed on while
        connections are refused, answer 503 or the backend is found stalled before it answered; a prefill also
        when it closed the connection before answering (it died; marked down). `lost` and `headers` as there.

        Returns a 200 response, its body not read yet, with the backend's ``inflight`` counted up: the caller
        counts it down and reads the body, then releases the response (or closes it, to stop the backend).
        Raises `ServingError`.
        """
        # msgspec: the body carries the images' data: URIs (~0.2 MB each)
        return await self.client.post(pool, path, msgspec.json.encode(body), only=only, lost=lost, headers=headers,
                                      resend=pool is self.prefills)

    async def _prefill(self, job: Job, prompt: str, images: list[str], only: Backend | None = None,
                       passed: ServingError | None = None) -> tuple[Backend, PrefillResponse]:
        """Prefill `job` on a prefill of the pool (`only`: that one); `passed`: why the pipelined way's prefill did
        not take it, raised instead of 503 ``no_backend`` when no other is left."""
        lost: list[Backend] = []
        try:
            backend, raw = await self._call(self.prefills, "/v1/prefill", {
                "request_id": job.rid, "prompt": prompt, "images": images, "temperature": job.temperature,
                "seed": job.seed, "kv_transfer_params": {"do_remote_decode": True}}, only=only, lost=lost,
                headers=self._prefill_deadline(job))
        except BaseException as exc:  # cancellation too: a prefill whose answer was lost may still finish it
            await asyncio.shield(self._abort_lost(lost, job.rid))  # and hold its KV: aborted, it frees it at once
            if passed is not None and isinstance(exc, Unavailable) and exc.code == "no_backend":
                raise passed from None
            raise
        await self._abort_lost(lost, job.rid)  # those passed over while stalled
        try:
            prefill = _decode_json(backend, raw, PrefillResponse)
        except ServingError:
            await self._abort(backend, job.rid)  # it answered 200, so it may hold KV we cannot hand on
            raise
        job.prompt_len = prefill.prompt_len
        self.recorder.extend(prefill.spans)
        return backend, prefill

    async def _abort(self, backend: Backend, rid: str) -> str:
        """Have the prefill `backend` drop `rid`'s KV now (no decode will ask for it), or when it finishes the
        request later. Best effort and short: a prefill that does not answer still frees the blocks after its
        own free timeout. Returns the result, as counted in ``prefill_aborts``."""
        answer = await self.client.short("POST", backend.url + "/v1/abort", msgspec.json.encode({"request_id": rid}))
        if answer is None:
            result = "unreachable"
        elif answer[0] != 200:  # e.g. 404 from a prefill without /v1/abort
            result = f"status_{answer[0]}"
        else:
            try:
                freed = msgspec.json.decode(answer[1], type=AbortResponse).freed_blocks
                result = "freed" if freed else "nothing_held"
            except (msgspec.ValidationError, msgspec.DecodeError):
                result = "malformed"
        self.prefill_aborts[result] += 1
        return result

    async def _abort_lost(self, lost: list[Backend], rid: str) -> None:
        """Abort `rid` on every prefill in `lost` (its answer lost, passed over while stalled, or its decode
        failed): at once where it answers, else in the background: until it wakes (stalled), or once (down: it
        closed the connection unanswered, most likely dead, and the request's answer need not wait on it)."""
        now = time.monotonic()
        for backend in lost:
            if backend.stall.is_set():
                self._spawn(self._abort_when_awake(backend, rid))
            elif not backend.up(now):
                self._spawn(self._abort(backend, rid))
            else:
                await self._abort(backend, rid)

    async def _abort_when_awake(self, backend: Backend, rid: str) -> None:
        """`_abort`, retried each `PROBE_INTERVAL` while the stalled `backend` does not answer, for as long as
        its requests may wait for it (``--timeout``): it hears of the abort as soon as it wakes."""
        deadline = time.monotonic() + self.settings.timeout
        while await self._abort(backend, rid) == "unreachable" and time.monotonic() < deadline:
            await asyncio.sleep(PROBE_INTERVAL)

    def _spawn(self, aw: Awaitable[Any]) -> None:
        """Run `aw` in the background, held against the GC until it ends (`close` cancels it)."""
        task = asyncio.ensure_future(aw)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _admitting(self) -> list[Backend]:
        """The prefills up that told their admission in /health."""
        return [b for b in self.prefills.backends if b.workers and b.rate and b.service_s and b.up(time.monotonic())]

    def planned_rate(self, known: list[Backend]) -> float:
        """The prefills' summed rate this proxy plans with: the lowest of the last `RATE_MEMORY` they told, and
        at most `PRIOR_RATE_SHARE` of a rate that is still a prior (no request measured with every worker busy)."""
        rate = self.low_rate.seen(sum(b.rate for b in known))
        return min(rate, sum(b.rate * (1.0 if b.rate_measured else PRIOR_RATE_SHARE) for b in known))

    def predicted_wait(self) -> tuple[float, float] | None:
        """(the wait, the service) a request arriving now is predicted at the prefills, from what they tell in
        /health (workers, measured rate and service time) and what this proxy has on its way to them (`pending`:
        being read, parsed or prefilled): a newcomer starts once the `pending` beyond their workers are through,
        at their summed rate, the lowest of the last `RATE_MEMORY` they told (a prefill rechecks its queue by its
        rate's swings: planned at its median, a burst's tail was refused there, seconds later), a share of a prior
        (`planned_rate`); with none
        pending, at once, in the prefills' best case. None before any prefill told its admission."""
        known = self._admitting()
        if not known:
            return None
        workers = sum(b.workers for b in known)
        rate = self.planned_rate(known)
        if not self.pending:  # none on its way: judged by the prefills' best case, as an idle prefill judges it
            return 0.0, min(b.service_s if b.best_case_s is None else b.best_case_s for b in known)
        return max(0, self.pending + 1 - workers) / rate, max(b.service_s for b in known)

    def gate(self, scope: Any) -> ServingError | None:
        """The admission of a completion request, run before routing (`epd_lab.serving.app.Gate`): its error
        (503 overloaded, 400 for a malformed deadline), counted in ``refused_total``, or None to serve it. Only
        the headers are read, so a refusal costs neither the body nor the framework."""
        if scope["method"] != "POST" or scope["path"] not in COMPLETION_ROUTES:
            return None
        headers = {DEADLINE_HEADER.lower(): v.decode("latin-1") for k, v in scope["headers"]
                   if k == DEADLINE_HEADER_BYTES}
        try:
            # the client's deadline, at most --timeout: no backend answer is awaited longer than that anyway
            self._admit(min(deadline_budget(headers, self.settings.timeout), self.settings.timeout))
        except Unavailable as exc:
            self.refused[exc.code] += 1
            return exc
        except BadRequest as exc:
            return exc
        # pending from here, not from its handler: the gate lets the loop judge the rest of a burst before an
        # admitted request goes on (`Gate`), and each of those must count the ones admitted before it
        scope[ADMITTED] = (time.monotonic_ns(), self.pending)
        self.pending += 1
        return None

    def _admit(self, budget: float) -> None:
        """Refuse (503, before the body is read) a request whose predicted time to its prefill's answer and its
        decode's (`decode_s`, at most half the deadline) do not fit its deadline: the prefill would refuse it too, after the proxy read and
        sent its body (under a burst of a thousand that reading is what made refusals slow), or it would finish
        late. The time to the prefill's answer: the prefills' wait and service plus the proxy's intake
        (`intake_s`) or, behind a queue, this proxy's own measure of it if longer (`drain`: the rate the prefills
        report, a median of their last few dozen, ran up to a quarter above what a burst got)."""
        prediction = self.predicted_wait()
        if prediction is None:
            return
        wait, service = prediction
        reported = wait + service + self.intake_s
        measured = (self.drain.predicted_s(self.pending) if wait else None) or 0.0
        decode = min(self.decode_s, budget / 2)  # as `_prefill_deadline` keeps back: a long generation still runs
        expected = max(reported, measured) + decode
        if expected > budget:
            raise Unavailable(f"proxy overloaded: predicted wait {wait:.2f} s at the prefills ({self.pending} "
                              f"requests on their way to them) plus its service ({service:.3f} s) and intake "
                              f"({self.intake_s:.3f} s), {reported:.2f} s ({measured:.2f} s as measured here), "
                              f"and its decode ({decode:.3f} s) does not fit the request's deadline of "
                              f"{max(budget, 0.0):.2f} s", code="overloaded_deadline",
                              retry_after=expected - max(budget, 0.0))

    def _prefill_deadline(self, job: Job) -> dict[str, str]:
        """The ``X-EPD-Deadline-Ms`` for a job's prefill: what is left of its deadline, less what its decode is
        expected to take (this proxy's measured time per token × its tokens, at most half of what is left, so a
        long generation is never refused for its length alone: its tokens stream, each bounded by --timeout).
        Decode is sent no such deadline: once prefilled, a request is not refused for it (its first token may be
        out); only its KV's arrival is bounded by the request's deadline (`_kv_deadline`)."""
        left = job.deadline - time.monotonic()
        reserve = min(self.decode_token_s * max(0, job.max_tokens - 1), left / 2)
        return {DEADLINE_HEADER: f"{max(0.0, left - reserve) * 1000:.0f}"}

    def observe_decode(self, seconds: float, tokens: int) -> None:
        """Fold one decode's time (its tokens after the first) into `decode_token_s` and `decode_s`."""
        if tokens >= 1:
            self.decode_token_s += EWMA_WEIGHT * (seconds / tokens - self.decode_token_s)
            self.decode_s += EWMA_WEIGHT * (seconds - self.decode_s)

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt every prefill takes (each tells it in /health; None before any did)."""
        return min((b.max_prompt_tokens for b in self.prefills.backends if b.max_prompt_tokens), default=None)

    def _parse(self, body: bytes | bytearray, kind: str, t0: int) -> tuple[Job, str, list[str]]:
        """The client's body as a job, its prompt and media, refused (400) when its text alone is longer than the
        model takes: checked here, before anything travels, and cheaply (`prompt_tokens`: a 50 MB ASCII prompt in
        O(1)); the images' tokens are the prefill's to count."""
        job, prompt, images = parse_request(decode_body(body), kind, t0)
        limit = self.max_prompt_tokens
        if limit is not None and (n := prompt_tokens(prompt)) > limit:
            self.refused["context_length_exceeded"] += 1
            raise BadRequest(f"the prompt is at least {n} tokens (its text alone); this model takes at most {limit}",
                             code="context_length_exceeded")
        return job, prompt, images

    def _decode_body(self, job: Job, kv_transfer_params: Any) -> dict[str, Any]:
        return {"request_id": job.rid, "max_tokens": job.max_tokens, "temperature": job.temperature,
                "seed": job.seed, "stream": True, "kv_transfer_params": kv_transfer_params}

    def _kv_deadline(self, job: Job) -> dict[str, str]:
        """The ``X-EPD-KV-Deadline-Ms`` for a job's /v1/decode, taken just before it is sent: its KV is due by the
        job's deadline, so a decode waiting on a prefill that died or froze mid-transfer answers 504 within it.
        Its tokens after are not: they stream, each bounded by --timeout."""
        kv_left = min(max(0.0, job.deadline - time.monotonic() - KV_ANSWER_S), self.settings.timeout)
        return {KV_DEADLINE_HEADER: f"{kv_left * 1000:.0f}"}

    async def _pipelined(self, job: Job, prompt: str,
                         images: list[str]) -> tuple[Backend, PrefillResponse, asyncio.Task | None] | None:
        """Ask decode and prefill at once: the prefill chosen up front, decode told only its side channel
        (vLLM's kv_transfer_params, SGLang's bootstrap address), so that decode allocates and sends its metadata
        while prefill runs. None when the chosen prefill does not tell its side channel: the caller goes the serial
        way. When it did not take the request (refused, busy, stalled, closed the connection unanswered), the
        serial way is taken here (decode asked once prefill answered). Raises `ServingError` as `_prefill` does."""
        backend = await self.client.choose(self.prefills, set())
        if backend is not None and not backend.probed:
            await self.client.probe(backend)  # learns its kv_url, once
        if backend is None or backend.kv_url is None:
            return None
        kv = {"remote_url": backend.kv_url, "remote_request_id": job.rid}
        if backend.kv_urls:
            kv["remote_urls"] = backend.kv_urls
        decode = asyncio.create_task(self._post(self.decodes, "/v1/decode", self._decode_body(job, kv),
                                                headers=self._kv_deadline(job)))
        try:
            _, prefill = await self._prefill(job, prompt, images, only=backend)
        except BaseException as exc:
            await _discard(decode)
            if not isinstance(exc, ServingError) or not (isinstance(exc, Unavailable) or exc.code in PASSED_OVER):
                await asyncio.shield(self._abort(backend, job.rid))  # decode may wait for it: answered at once
                raise
            passed = exc  # it never took the request: the serial way tries the others
        else:
            return backend, prefill, decode
        return *await self._prefill(job, prompt, images, passed=passed), None

    # ---- requests ----
    async def complete(self, request: Request, kind: str) -> Response:
        """Serve one /v1/chat/completions (`kind` "chat") or /v1/completions ("text") request; a 503 is counted
        in ``refused_total`` by its code."""
        try:
            return await self._complete(request, kind)
        except Unavailable as exc:
            self.refused[exc.code] += 1
            raise

    async def _complete(self, request: Request, kind: str) -> Response:
        # admitted (`gate`) before its body was read: TTFT counts the proxy's reading and parsing too
        t0, ahead = request.scope[ADMITTED]  # `gate` counted it pending
        try:
            # admitted already (`gate`, before routing), at most --timeout like it
            budget = min(deadline_budget(request.headers, self.settings.timeout), self.settings.timeout)
            body = await read_body(request)
            if len(body) <= SMALL_BODY_BYTES:
                job, prompt, images = self._parse(body, kind, t0)
            else:  # tens of MB of JSON and prompt text: off the event loop, which keeps answering /health
                job, prompt, images = await asyncio.to_thread(self._parse, body, kind, t0)
            del body
            job.deadline = t0 / 1e9 + budget
            t_parsed = time.monotonic_ns()
            self.record(Span(job.rid, -1, "proxy_parse", self.recorder.node, t0, t_parsed))
            self.intake_s += EWMA_WEIGHT * ((t_parsed - t0) / 1e9 - self.intake_s)
            piped = await self._pipelined(job, prompt, images) if job.stream and self.settings.pipelined else None
            if piped is None:
                decode = None
                prefill_backend, prefill = await self._prefill(job, prompt, images)
            else:
                prefill_backend, prefill, decode = piped
        finally:
            self.pending -= 1
        workers = sum(b.workers for b in self._admitting())
        if workers:
            self.drain.add(time.monotonic() - t0 / 1e9, ahead, workers)
        try:
            if client_gone(request):
                raise ClientClosed("the client closed the request before decode began")
            if job.stream:  # the stream starts with prefill's token; decode (asked already, or now) does the rest
                stream = _TokenStream(self, job, prefill_backend, prefill, decode)
                return ClosingStreamingResponse(stream.events(), stream.close, media_type="text/event-stream",
                                                headers={"Cache-Control": "no-cache"})
            # not streamed: the first token is prefill's answer (no span: the client sees the whole answer)
            self.latency["ttft"].observe((time.monotonic_ns() - job.t0) / 1e9)
            backend, response = await self._post(self.decodes, "/v1/decode",
                                                 self._decode_body(job, prefill.kv_transfer_params),
                                                 headers=self._kv_deadline(job))
        except BaseException:  # cancellation included: no decode will ask for the KV, so free it now
            if decode is not None:
                await _discard(decode)
            # a frozen or dead prefill is aborted in the background: its client's error does not wait on it
            await asyncio.shield(self._abort_lost([prefill_backend], job.rid))
            raise
        # decode streams to the proxy here too: the idle timeout bounds each token, not the whole generation,
        # and a proxy that gives up closes the stream, which stops decode
        tokens, finish_reason, done = [prefill.first_token], "length", False
        t_decode = time.monotonic()
        try:
            async for msg in _decode_stream(backend, response, prefill.first_token, self.recorder):
                if isinstance(msg, StreamToken):
                    tokens.append(msg.token)
                else:
                    finish_reason = msg.finish_reason
            done = True
        finally:
            backend.finish(response, reuse=done)
        self.observe_decode(time.monotonic() - t_decode, len(tokens) - 1)
        self.successes[finish_reason] += 1
        self.record(Span(job.rid, -1, "e2e", self.recorder.node, job.t0, time.monotonic_ns()))
        return json_response(completion(job, self.settings.model, detokenize(tokens), finish_reason, len(tokens)))

    def record(self, span: Span) -> None:
        """`span` to the recorder (when tracing); a ttft, tpot or e2e span's duration to its histogram too."""
        self.recorder.add(span)
        if span.stage in self.latency:
            self.latency[span.stage].observe((span.t_end_ns - span.t_start_ns) / 1e9)

    # ---- observability ----
    async def health(self) -> dict[str, Any]:
        """Probe every backend; ``status`` "ok" (200) when at least one prefill and one decode answer, else 503.

        Each backend's entry holds the proxy's view (``healthy``, ``inflight``, ``served``) and, under
        ``health``, the JSON its own ``/health`` answered (None when it did not answer 200).
        """
        prefill, decode = await asyncio.gather(backend_health(self.client, self.prefills.backends),
                                               backend_health(self.client, self.decodes.backends))
        ok = all(any(e["healthy"] for e in entries) for entries in (prefill, decode))
        return {"prefill": prefill, "decode": decode, "status": "ok" if ok else "unavailable",
                "model": self.settings.model, "policy": self.settings.policy}

    def metric_families(self) -> list[Metric]:
        """The proxy's ``/metrics`` families: vLLM's latency histograms and finished requests, aborted streams,
        prefill aborts, retries, the admission's prediction, backends."""
        m = self.metrics
        return [
            *m.instruments(),
            m.counter("vllm:request_success", "Count of successfully processed requests.", dict(self.successes),
                      "finished_reason"),
            m.counter("streams_aborted", "streams that ended early, by reason", self.streams_aborted, "reason"),
            m.counter("prefill_aborts", "/v1/abort calls to prefills, by result", self.prefill_aborts, "result"),
            m.family("retries", "counter", "requests passed on from a backend that did not take them, to the next "
                     "one if any is left, by role and reason (refused: connection refused; busy: 503; stalled; "
                     "disconnected: closed the connection before answering, prefill only)", ("role", "reason"),
                     sorted(self.retries.items())),
            m.counter("refused", "requests refused: 503s by their code (backend_unavailable: every backend refused, "
                      "its deadline not met), context_length_exceeded (400, before forwarding)", self.refused,
                      "reason"),
            m.gauge("pending", "requests admitted here and not yet answered by a prefill", self.pending),
            m.gauge("predicted_wait_seconds", "the wait at the prefills a request arriving now is predicted",
                    round((self.predicted_wait() or (0.0, 0.0))[0], 6)),
            m.gauge("planned_rate_per_second", "the prefills' summed rate the prediction is made with: the lowest "
                    "told lately, a share of a prior (0 before any told one)",
                    round(self.planned_rate(self._admitting()) if self._admitting() else 0.0, 6)),
            m.gauge("decode_token_seconds", "decode's time per token as the proxy sees it (weighted mean): the part "
                    "of a deadline kept back from prefill", round(self.decode_token_s, 6)),
            *backend_metrics(m, self.prefills.backends + self.decodes.backends, "backend", ("role", "url")),
        ]

    def refusals(self) -> dict[str, float]:
        """The proxy's refusals by code: its admission's 503s, every backend's refusal passed on, prompts too long."""
        return dict(self.refused)


class _TokenStream:
    """The client's SSE events: prefill's first token at once, then the decode server's NDJSON stream.

    The first token leaves as soon as prefill has answered it; decode is asked for the rest meanwhile, and its
    own token 0 (the same token, checked) is not sent again. From then on a decode failure is an error event
    in the stream, not an HTTP status. If decode never took the request, prefill is told to drop the KV.
    """

    def __init__(self, proxy: Proxy, job: Job, prefill_backend: Backend, prefill: PrefillResponse,
                 decode: asyncio.Task | None = None) -> None:
        self.proxy = proxy
        self.job = job
        self.prefill_backend = prefill_backend
        self.prefill = prefill
        self.decode = decode  # decode asked already (pipelined): its (backend, response) to come
        self.backend: Backend | None = None  # the decode server, once it took the request
        self.response: Answer | None = None
        self.outcome = "client_disconnect"  # unless the stream ends otherwise
        self.tokens = 0  # sent to the client, prefill's first token included
        self.t_first = 0
        self.t_last = 0
        self.closed = False

    def _event(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
               usage: dict[str, int] | None = None) -> bytes:
        return chunk(self.job, self.proxy.settings.model, text, finish_reason, role=role, usage=usage)

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE events: a role chunk (chat), text deltas, the finish chunk, usage if asked, ``[DONE]``."""
        job = self.job
        detok = Detokenizer()
        try:
            text = detok.feed(self.prefill.first_token)  # "" while a multi-byte character is partial
            self.t_first = self.t_last = time.monotonic_ns()
            self.proxy.record(Span(job.rid, -1, "ttft", self.proxy.recorder.node, job.t0, self.t_first))
            self.tokens = 1
            # one write for the role chunk and the first token
            yield (self._event("", role=True) if job.kind == "chat" else b"") + (self._event(text) if text else b"")
            if self.decode is None:
                self.decode = asyncio.create_task(self.proxy._post(
                    self.proxy.decodes, "/v1/decode", self.proxy._decode_body(job, self.prefill.kv_transfer_params),
                    headers=self.proxy._kv_deadline(job)))
            self.backend, self.response = await self.decode
            finish_reason = "length"
            async for msg in _decode_stream(self.backend, self.response, self.prefill.first_token,
                                            self.proxy.recorder):
                if isinstance(msg, StreamToken):
                    now = time.monotonic_ns()
                    self.proxy.latency["itl"].observe((now - self.t_last) / 1e9)
                    self.t_last = now
                    self.tokens += 1
                    text = detok.feed(msg.token)
                    if text:
                        yield self._event(text)
                else:
                    finish_reason = msg.finish_reason
            tail = detok.flush()
            if tail:
                yield self._event(tail)
            yield self._event(None if job.kind == "chat" else "", finish_reason)
            if job.include_usage:
                yield self._event(None, usage=usage(job, self.tokens))
            yield b"data: [DONE]\n\n"
            self.outcome = "ok"
            self.proxy.successes[finish_reason] += 1
        except ServingError as exc:
            self.outcome = exc.code
            yield b"data: " + msgspec.json.encode(error_body(exc)) + b"\n\n"
            yield b"data: [DONE]\n\n"

    async def close(self) -> None:
        """Close the upstream stream (the decode server stops), count the backend down, record the spans; if
        no decode took the request, have the prefill drop its KV."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.response is None:
                if self.decode is not None:
                    await _discard(self.decode)
                await asyncio.shield(self.proxy._abort(self.prefill_backend, self.job.rid))
            elif self.backend is not None:
                # a stream read to its end goes back to the pool; one cut short is closed: decode stops
                self.backend.finish(self.response, reuse=self.outcome == "ok")
        finally:
            proxy, job, node = self.proxy, self.job, self.proxy.recorder.node
            if self.tokens >= 2:
                tpot = (self.t_last - self.t_first) // (self.tokens - 1)
                proxy.record(Span(job.rid, -1, "tpot", node, self.t_first, self.t_first + tpot))
                if self.outcome == "ok":
                    proxy.observe_decode((self.t_last - self.t_first) / 1e9, self.tokens - 1)
            proxy.record(Span(job.rid, -1, "e2e", node, job.t0, time.monotonic_ns()))
            if self.outcome != "ok":
                proxy.streams_aborted[self.outcome] += 1


async def _decode_stream(backend: Backend, response: Answer, first_token: int,
                         recorder: Recorder) -> AsyncIterator[StreamToken | StreamDone]:
    """Decode's NDJSON stream, checked: its tokens after prefill's first (decode's token 0 must be that one, and is
    not yielded), then its `StreamDone` (whose spans go to `recorder`). A `StreamError` line, a token out of order,
    a malformed line or a stream that ends without its done line raise `ServingError`."""
    due = 0
    try:
        async for line in _lines(response.chunks()):
            msg = _decode_json(backend, line, StreamLine)
            if isinstance(msg, StreamDone):
                recorder.extend(msg.spans)
                yield msg
                return
            if isinstance(msg, StreamError):
                raise BadGateway(f"decode {backend.url} failed mid-stream: {msg.detail}")
            backend.liveness.heard()  # a token: streaming, however slowly its /health answers
            if msg.index != due:
                raise BadGateway(f"decode {backend.url} sent token {msg.index} where {due} was due")
            due += 1
            if msg.index == 0:
                if msg.token != first_token:
                    raise BadGateway(f"decode {backend.url} began with token {msg.token}, prefill answered "
                                     f"{first_token}")
                continue
            yield msg
    except EXCHANGE_ERRORS as exc:
        raise _transport_error(backend, exc) from None
    raise BadGateway(f"decode {backend.url} ended its stream before its done line")


async def _lines(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The non-empty NDJSON lines of a stream's pieces, however long (a done line carries a span per decode
    step)."""
    pending = b""
    async for piece in pieces:
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


async def _discard(decode: asyncio.Task) -> None:
    """Drop a decode request the proxy no longer wants: cancel it, or close the response it got."""
    if not decode.done():
        decode.cancel()
    with contextlib.suppress(BaseException):  # its failure or cancellation is moot now
        backend, response = await decode
        backend.finish(response, reuse=False)


def create_app(settings: ProxySettings) -> FastAPI:
    """The proxy's app; its HTTP client to the backends lives for the app's lifespan. Errors, unknown routes
    included, are OpenAI error objects."""
    app = role_app("proxy", lambda: Proxy(settings), ROUTES, error_body, gate=Proxy.gate)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await app.state.server.complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await app.state.server.complete(request, "text")

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(model_list(settings.model, created=app.state.server.started))

    return app


def main(argv: list[str] | None = None) -> int:
    """``epd-lab proxy``: serve until SIGINT/SIGTERM."""
    return serve_main(ProxySettings, create_app, argv, "epd-lab proxy",
                      "the OpenAI-compatible proxy over prefill and decode servers")


if __name__ == "__main__":
    from epd_lab.boundary import guarded

    sys.exit(guarded(main, sys.argv[1:]))  # a user's mistake in one line (epd_lab.boundary)
