"""The gRPC service: bridges `jaxinfer.v1.Generation` to the engine, on ``grpc.aio``.

    server = JaxinferServer(llm, ServerConfig(port=50051))
    port = await server.start()
    ...
    await server.shutdown(grace=30)

One `Generate` call is one engine request. The handler submits it and writes
each `StreamDelta` to the client as the engine thread produces it. The
request is aborted in the engine, so its KV pages return at the next engine
step, whenever the call ends before the request does: the client cancels,
disconnects or passes its deadline (the handler task is cancelled, and a
done-callback on the call aborts it even while no message is in flight).

Admission control: with ``max_waiting`` set, a call is refused at once with
RESOURCE_EXHAUSTED when ``max_num_seqs + max_waiting`` Generate calls are
already in flight on this server (everything beyond the engine's batch
capacity is counted as waiting). Bad input is INVALID_ARGUMENT with the
library's own message (field and limit). `serve()` runs a server until
SIGTERM/SIGINT and then shuts it down gracefully: health turns NOT_SERVING,
new calls get UNAVAILABLE, running requests may finish within the grace
period, and the rest are aborted with UNAVAILABLE and a message that says so.

Metrics: with ``metrics_port`` set, Prometheus text on ``http://host:port/metrics``
(`jaxinfer.server.metrics`: vLLM's names with the ``jaxinfer:`` prefix), from
this server's own registry.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.metrics import RequestMetrics
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server import jaxinfer_pb2 as pb
from jaxinfer.server import jaxinfer_pb2_grpc as pb_grpc

log = logging.getLogger("jaxinfer.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxinfer.v1.Generation"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
DEFAULT_PORT = 50051
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
AUTH_TOKEN_ENV = "JAXINFER_AUTH_TOKEN"

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}

# SamplingOptions fields copied one-to-one onto SamplingParams when set.
_OPTIONAL_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos", "logprobs", "skip_special_tokens",
    "include_stop_str_in_output",
)
# Template variables a client may not set through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "chat_template", "tokenize")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0: pick a free port (see JaxinferServer.port)
    max_waiting: Optional[int] = None  # None: unbounded
    grace_period: float = 30.0  # seconds running requests get to finish on shutdown
    tls_cert: Optional[str] = None  # PEM file paths; both or neither
    tls_key: Optional[str] = None
    auth_token: Optional[str] = None  # require "authorization: Bearer <token>" (health stays open)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    reflection: bool = True
    metrics_port: Optional[int] = None  # Prometheus text on http://<metrics_host>:<port>/metrics; None: off, 0: any
    metrics_host: Optional[str] = None  # None: the server's host

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and a private key (--tls-key).")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be at least 0, got {self.max_waiting}.")
        if self.grace_period < 0:
            raise ValueError(f"grace_period must be non-negative, got {self.grace_period}.")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be at least 1024, got {self.max_message_bytes}.")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("the auth token is empty.")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}.")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


def read_auth_token(path: Optional[str]) -> Optional[str]:
    """The bearer token from a file (first line, stripped), else from $JAXINFER_AUTH_TOKEN, else None."""
    if path:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"the auth token file {path} is empty.")
        return token
    token = os.environ.get(AUTH_TOKEN_ENV, "").strip()
    return token or None


# --------------------------------------------------------------------------- #
# Conversions
# --------------------------------------------------------------------------- #


def sampling_params_from_proto(opts: pb.SamplingOptions, defaults: SamplingParams) -> SamplingParams:
    """The model's defaults overridden by every field the client set; raises ValueError when out of range."""
    kw = {name: getattr(opts, name) for name in _OPTIONAL_SAMPLING if opts.HasField(name)}
    kw["max_tokens"] = opts.max_tokens if opts.HasField("max_tokens") else None
    kw["stop"] = list(opts.stop)
    kw["stop_token_ids"] = list(opts.stop_token_ids)
    return defaults.clone(**kw)


def generation_defaults_to_proto(g) -> pb.SamplingOptions:
    """The sampling defaults a model ships (`GenerationDefaults`), with the fields it leaves unset unset."""
    opts = pb.SamplingOptions()
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                       ("repetition_penalty", float)):
        v = getattr(g, name, None)
        if v is not None:
            setattr(opts, name, kind(v))
    return opts


def chat_messages_from_proto(chat: pb.ChatInput) -> list:
    if not chat.messages:
        raise ValueError("chat.messages must not be empty: send at least one message.")
    messages = []
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise ValueError(f"chat.messages[{i}].role must not be empty (e.g. 'user', 'system', 'assistant').")
        messages.append({"role": m.role, "content": m.content})
    return messages


def template_kwargs_from_proto(chat: pb.ChatInput) -> dict:
    kwargs = json_format.MessageToDict(chat.chat_template_kwargs) if chat.HasField("chat_template_kwargs") else {}
    bad = sorted(set(kwargs) & set(_RESERVED_TEMPLATE_KWARGS))
    if bad:
        raise ValueError(f"chat.chat_template_kwargs may not set {', '.join(bad)}.")
    return kwargs


def _percentile(xs: list, q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def timings_to_proto(m: RequestMetrics) -> pb.Timings:
    s = m.summary()
    t = pb.Timings(
        tokenize_s=m.tokenize_s,
        template_tokens=m.template_tokens,
        user_tokens=m.user_tokens,
        prefill_chunks=s["prefill_chunks"],
        decode_steps=m.decode_steps,
    )
    for name in ("queue_s", "prefill_s", "ttft_s", "tpot_s", "itl_mean_s", "itl_max_s", "e2e_s"):
        if s[name] is not None:
            setattr(t, name, s[name])
    itl = m.itl_s
    if itl:
        t.itl_p50_s = _percentile(itl, 0.50)
        t.itl_p99_s = _percentile(itl, 0.99)
    return t


# --------------------------------------------------------------------------- #
# The servicer
# --------------------------------------------------------------------------- #


class _Throughput:
    """Tokens/s over a sliding window of engine-counter samples (taken by the server every second)."""

    def __init__(self, stats, window: int = 10):
        self._stats = stats
        self._samples: deque = deque(maxlen=window + 1)
        self.sample()

    def sample(self) -> None:
        self._samples.append((time.perf_counter(), self._stats.prompt_tokens, self._stats.generation_tokens))

    def rates(self) -> tuple:
        now = (time.perf_counter(), self._stats.prompt_tokens, self._stats.generation_tokens)
        t0, p0, g0 = self._samples[0]
        dt = now[0] - t0
        if dt <= 0:
            return 0.0, 0.0
        return (now[1] - p0) / dt, (now[2] - g0) / dt


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, llm, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.engine = llm.engine
        self.active: dict = {}  # request id -> RequestStream (Generate calls in flight)
        self.rejected = 0
        self.draining = False
        self.abort_message: Optional[str] = None  # set when shutdown aborts what is left
        self.idle = asyncio.Event()
        self.idle.set()
        self.throughput = _Throughput(self.engine.stats)
        self.metrics = None  # a ServerMetrics when the server exports Prometheus metrics
        self._token_text: dict = {}

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected(reason)

    # -- Generate ---------------------------------------------------------------

    def _build_request(self, msg: pb.GenerateRequest):
        """Tokenize / template / validate; raises ValueError with a message naming the field and limit."""
        llm = self.llm
        arrival = time.perf_counter()
        params = sampling_params_from_proto(msg.sampling, llm.get_default_sampling_params())
        kind = msg.WhichOneof("input")
        tok = llm.tokenizer
        metrics = RequestMetrics(arrival_time=arrival)
        prompt_text = None
        t0 = time.perf_counter()
        if kind is None:
            raise ValueError("the request has no input: set one of prompt, chat or token_ids.")
        if kind == "prompt":
            if not msg.prompt:
                raise ValueError("prompt is empty: it must contain at least one character.")
            if tok is None:
                raise ValueError("this model has no tokenizer: send token_ids instead of a prompt.")
            ids = tok.encode(msg.prompt)
            prompt_text = msg.prompt
            metrics.user_tokens = len(ids)
        elif kind == "chat":
            if tok is None or tok.chat_template is None:
                raise ValueError("this model has no chat template: send a prompt or token_ids instead of chat.")
            messages = chat_messages_from_proto(msg.chat)
            add_gen = msg.chat.add_generation_prompt if msg.chat.HasField("add_generation_prompt") else True
            prompt_text = tok.apply_chat_template(
                messages, add_generation_prompt=add_gen, **template_kwargs_from_proto(msg.chat)
            )
            ids = tok.encode(prompt_text, add_special_tokens=False)
            metrics.user_tokens = sum(len(tok.encode(m["content"], add_special_tokens=False)) for m in messages)
            metrics.template_tokens = max(0, len(ids) - metrics.user_tokens)
        else:
            ids = list(msg.token_ids.ids)
            vocab = llm.model_config.vocab_size
            for i, t in enumerate(ids):
                if not 0 <= t < vocab:
                    raise ValueError(
                        f"token_ids.ids[{i}] = {t} is out of range: token ids must be in [0, {vocab}) "
                        f"(the vocabulary size is {vocab})."
                    )
            metrics.user_tokens = len(ids)
        metrics.tokenize_s = time.perf_counter() - t0
        return llm.make_request(
            ids, params, prompt=prompt_text, metrics=metrics,
            request_id=msg.request_id or None, priority=msg.priority,
        )

    def _capacity(self) -> Optional[int]:
        if self.config.max_waiting is None:
            return None
        return self.llm.engine_config.max_num_seqs + self.config.max_waiting

    async def Generate(self, request, context):
        if self.draining:
            self._rejected("shutting_down")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down and accepts no new requests.")
        try:
            req = self._build_request(request)
        except ValueError as e:
            self._rejected("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - a bug preparing one request must not look like bad input
            log.exception("could not prepare a request")
            self._rejected("internal")
            await context.abort(grpc.StatusCode.INTERNAL, f"could not prepare the request: {e}")
        rid = req.request_id
        if rid in self.active:
            self._rejected("duplicate_request_id")
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in use by a running request."
            )
        cap = self._capacity()
        if cap is not None and len(self.active) >= cap:
            self.rejected += 1
            self._rejected("resource_exhausted")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is at capacity: {len(self.active)} requests in flight, the most allowed is {cap} "
                f"(max_num_seqs={self.llm.engine_config.max_num_seqs} running + "
                f"max_waiting={self.config.max_waiting} waiting); retry later.",
            )

        stream = self.llm.submit(req)
        self.active[rid] = stream
        self.idle.clear()
        # Aborts the request if the call ends first (cancel, disconnect, deadline), even between messages.
        context.add_done_callback(lambda _ctx: stream.abort())
        deltas = stream.__aiter__()
        try:
            async for delta in deltas:
                await context.write(self._response(delta))
        except RuntimeError as e:  # the engine failed this request
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            if stream.output is None:
                stream.abort()
            try:
                await deltas.aclose()
            except BaseException:  # noqa: BLE001 - closing after a cancel must not mask it
                pass
            self.active.pop(rid, None)
            if not self.active:
                self.idle.set()
            if self.metrics is not None:
                self.metrics.on_call_end(stream)
        out = stream.output
        if self.abort_message is not None and out is not None and out.outputs[0].finish_reason == "abort":
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.abort_message)

    def _token_str(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        if tok is None:
            return ""
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = tok.decode([token_id], skip_special_tokens=False)
        return s

    def _response(self, delta) -> pb.GenerateResponse:
        r = pb.GenerateResponse(request_id=delta.request_id, text=delta.text, token_ids=delta.token_ids)
        for lp in delta.logprobs or ():
            if lp is None:
                continue
            top = sorted(lp.top.items(), key=lambda kv: -kv[1])
            r.logprobs.append(pb.TokenLogprob(
                token_id=int(lp.token_id), logprob=float(lp.logprob), token=self._token_str(int(lp.token_id)),
                top=[pb.TopLogprob(token_id=int(i), logprob=float(v), token=self._token_str(int(i))) for i, v in top],
            ))
        out = delta.output
        if out is not None:
            comp = out.outputs[0]
            r.finish_reason = FINISH_REASONS.get(comp.finish_reason, pb.FINISH_REASON_ERROR)
            if isinstance(comp.stop_reason, str):
                r.stop_string = comp.stop_reason
            elif comp.stop_reason is not None:
                r.stop_token_id = int(comp.stop_reason)
            u = out.usage
            r.usage.CopyFrom(pb.Usage(
                prompt_tokens=u["prompt_tokens"], cached_tokens=u["cached_tokens"],
                completion_tokens=u["completion_tokens"], total_tokens=u["total_tokens"],
            ))
            r.timings.CopyFrom(timings_to_proto(out.metrics))
        return r

    # -- Tokenize -----------------------------------------------------------------

    async def Tokenize(self, request, context):
        tok = self.llm.tokenizer
        if tok is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer.")
        kind = request.WhichOneof("input")
        try:
            if kind is None:
                raise ValueError("the request has no input: set prompt or chat.")
            if kind == "prompt":
                text = request.prompt
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = tok.encode(text, add_special_tokens=add_special)
            else:
                if tok.chat_template is None:
                    raise ValueError("this model has no chat template: tokenize a prompt instead.")
                add_gen = request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
                text = tok.apply_chat_template(
                    chat_messages_from_proto(request.chat), add_generation_prompt=add_gen,
                    **template_kwargs_from_proto(request.chat),
                )
                ids = tok.encode(text, add_special_tokens=False)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(
            token_ids=ids, tokens=[t or "" for t in tok.convert_ids_to_tokens(ids)], count=len(ids),
            max_model_len=self.llm.max_model_len, prompt=text,
        )

    # -- GetModelInfo ---------------------------------------------------------------

    def model_info(self) -> pb.ModelInfo:
        from jaxinfer._version import __version__

        llm, e = self.llm, self.llm.engine_config
        info = llm.info()
        snap = self.engine.stats.snapshot()
        prompt_tps, gen_tps = self.throughput.rates()
        tok = llm.tokenizer
        stats = pb.EngineLiveStats(
            running=snap["running"], waiting=snap["waiting"], kv_usage=snap["kv_usage"],
            prefix_hit_rate=snap["prefix_hit_rate"], prompt_throughput=prompt_tps, generation_throughput=gen_tps,
            prompt_tokens_total=snap["prompt_tokens"], generation_tokens_total=snap["generation_tokens"],
            steps=snap["steps"], preemptions=snap["preemptions"],
            finished={str(k): int(v) for k, v in snap["finished"].items()},
            server_active=len(self.active), server_rejected=self.rejected,
        )
        return pb.ModelInfo(
            name=info["model"], architecture=info["architecture"] or "", max_model_len=info["max_model_len"],
            vocab_size=info["vocab_size"], dtype=info["dtype"], backend=info["backend"],
            page_size=e.page_size, num_pages=e.num_pages, kv_capacity_tokens=info["kv_capacity_tokens"],
            max_num_seqs=e.max_num_seqs, max_num_batched_tokens=self.engine.scheduler.budget,
            max_logprobs=e.max_logprobs, batch_buckets=e.batch_buckets, chunk_buckets=e.chunk_buckets,
            page_buckets=e.page_buckets, has_tokenizer=tok is not None,
            has_chat_template=tok is not None and tok.chat_template is not None,
            max_waiting=-1 if self.config.max_waiting is None else self.config.max_waiting,
            version=__version__, stats=stats,
            generation_defaults=generation_defaults_to_proto(llm.generation_defaults),
        )

    async def GetModelInfo(self, request, context):
        return self.model_info()


# --------------------------------------------------------------------------- #
# Auth
# --------------------------------------------------------------------------- #


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without ``authorization: Bearer <token>`` metadata (UNAUTHENTICATED); health stays open."""

    def __init__(self, token: str, open_prefixes: tuple = (HEALTH_PREFIX,), on_deny: Optional[Callable] = None):
        self._expected = f"Bearer {token}".encode()
        self._open = open_prefixes
        self._on_deny = on_deny  # called with the method name of each refused call

    async def intercept_service(self, continuation, details):
        if details.method.startswith(self._open):
            return await continuation(details)
        given = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value if isinstance(value, str) else value.decode("latin-1")
        if given and hmac.compare_digest(given.encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        msg = "missing bearer token" if not given else "invalid bearer token"
        if self._on_deny is not None:
            self._on_deny(details.method)
        return _denying_handler(handler, f"{msg}: send 'authorization: Bearer <token>' metadata.")


def _denying_handler(handler, message: str):
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)


# --------------------------------------------------------------------------- #
# The server
# --------------------------------------------------------------------------- #


class JaxinferServer:
    """A ``grpc.aio`` server around one `LLM`: Generation + health + reflection. Owns no model state."""

    def __init__(self, llm, config: Optional[ServerConfig] = None):
        self.llm = llm
        self.config = config or ServerConfig()
        self.port: Optional[int] = None
        self.servicer: Optional[GenerationServicer] = None
        self.health: Optional[health.aio.HealthServicer] = None
        self._server: Optional[grpc.aio.Server] = None
        self._sampler: Optional[asyncio.Task] = None
        self._stopped = asyncio.Event()
        self.metrics = None  # a ServerMetrics when config.metrics_port is set
        self.metrics_port: Optional[int] = None

    async def start(self) -> int:
        cfg = self.config
        self.servicer = GenerationServicer(self.llm, cfg)
        if cfg.metrics_port is not None:
            from jaxinfer.server.metrics import ServerMetrics

            servicer = self.servicer
            self.metrics = ServerMetrics(self.llm.engine, self.llm.model_name, active_calls=lambda: len(servicer.active))
            servicer.metrics = self.metrics

        def on_deny(method: str) -> None:
            if self.metrics is not None and method.startswith(f"/{SERVICE_NAME}/Generate"):
                self.metrics.rejected("unauthenticated")

        interceptors = [BearerTokenInterceptor(cfg.auth_token, on_deny=on_deny)] if cfg.auth_token else []
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        pb_grpc.add_GenerationServicer_to_server(self.servicer, server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [SERVICE_NAME, health.SERVICE_NAME]
        if cfg.reflection:
            names.append(reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, server)
        if cfg.tls_cert:
            with open(cfg.tls_key, "rb") as f:
                key = f.read()
            with open(cfg.tls_cert, "rb") as f:
                cert = f.read()
            port = server.add_secure_port(cfg.address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(cfg.address)
        if not port:
            raise OSError(f"could not bind {cfg.address}")
        if self.metrics is not None:
            try:
                self.metrics_port = self.metrics.start_http(cfg.metrics_host or cfg.host, cfg.metrics_port)
            except OSError as e:
                await server.stop(None)
                raise OSError(f"could not serve metrics on port {cfg.metrics_port}: {e}") from e
        await server.start()
        self._server = server
        self.port = port
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sampler = asyncio.create_task(self._sample_stats())
        return port

    async def _sample_stats(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.servicer.throughput.sample()

    @property
    def address(self) -> str:
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.port}"

    @property
    def metrics_url(self) -> Optional[str]:
        """``http://host:port/metrics`` when Prometheus metrics are served, else None."""
        if self.metrics_port is None:
            return None
        host = (self.config.metrics_host or self.config.host).strip("[]")
        host = "127.0.0.1" if host == "0.0.0.0" else "[::1]" if host == "::" else f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.metrics_port}/metrics"

    async def shutdown(self, grace: Optional[float] = None) -> None:
        """Drain: NOT_SERVING, refuse new calls, let running ones finish for `grace` s, abort the rest, stop."""
        if self._server is None:
            return
        grace = self.config.grace_period if grace is None else grace
        s = self.servicer
        s.draining = True
        await self.health.enter_graceful_shutdown()
        if s.active:
            log.info("shutting down: waiting up to %.1f s for %d running request(s)", grace, len(s.active))
            try:
                await asyncio.wait_for(s.idle.wait(), timeout=grace)
            except asyncio.TimeoutError:
                s.abort_message = (
                    f"the server shut down: this request was aborted after the {grace:g} s grace period."
                )
                log.info("grace period over: aborting %d request(s)", len(s.active))
                for stream in list(s.active.values()):
                    stream.abort()
                try:
                    await asyncio.wait_for(s.idle.wait(), timeout=10.0)
                except asyncio.TimeoutError:
                    log.warning("%d request(s) did not end after abort", len(s.active))
        if self._sampler is not None:
            self._sampler.cancel()
        await self._server.stop(1.0)
        self._server = None
        if self.metrics is not None:
            self.metrics.stop_http()
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


class ServerThread:
    """A `JaxinferServer` on its own event loop in a background thread (tests, notebooks, embedding).

        with ServerThread(llm, ServerConfig(port=0)) as srv:
            client = jaxinfer.Client(srv.address)
    """

    def __init__(self, llm, config: Optional[ServerConfig] = None):
        self.llm = llm
        self.config = config or ServerConfig(port=0)
        self.server: Optional[JaxinferServer] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._done: Optional[asyncio.Event] = None

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread = threading.Thread(target=self._run, name="jaxinfer-grpc", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the gRPC server did not start")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        async def main():
            self.loop = asyncio.get_running_loop()
            self.server = JaxinferServer(self.llm, self.config)
            try:
                await self.server.start()
            except BaseException as e:  # noqa: BLE001 - reported to start()
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            await self.server.wait_for_termination()

        asyncio.run(main())

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        host = "localhost" if self.config.host in ("127.0.0.1", "0.0.0.0", "::", "[::]") else self.config.host
        return f"{host}:{self.port}"

    @property
    def servicer(self) -> GenerationServicer:
        return self.server.servicer

    def call(self, fn: Callable, timeout: float = 10.0):
        """Run ``fn()`` on the server's loop (for reading its state safely) and return its result."""

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def shutdown(self, grace: Optional[float] = None, wait: bool = True):
        """Graceful shutdown; with ``wait=False`` returns a concurrent Future at once."""
        fut = asyncio.run_coroutine_threadsafe(self.server.shutdown(grace), self.loop)
        if not wait:
            return fut
        fut.result()
        self._thread.join(10.0)
        return None

    def __enter__(self) -> "ServerThread":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        if self._thread is not None and self._thread.is_alive() and self.server is not None:
            self.shutdown(grace=0)


def serve(llm, config: ServerConfig, *, ready: Optional[Callable[[JaxinferServer], None]] = None) -> None:
    """Run a server until SIGTERM or SIGINT, then shut down gracefully (a second signal: no grace)."""

    async def main():
        server = JaxinferServer(llm, config)
        await server.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals = []

        def on_signal(signum):
            if stop.is_set():  # second signal: abort what is left now
                server.servicer.abort_message = "the server was stopped: this request was aborted."
                for stream in list(server.servicer.active.values()):
                    stream.abort()
                return
            log.info("received %s: draining", signal.Signals(signum).name)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
                signals.append(sig)
            except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
                pass
        if ready is not None:
            ready(server)
        await stop.wait()
        await server.shutdown(config.grace_period)
        for sig in signals:
            loop.remove_signal_handler(sig)

    asyncio.run(main())
