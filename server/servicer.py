"""The `jaxinfer.v1.Generation` service: `GenerationServicer` bridges Generate, Tokenize and GetModelInfo to an `LLM`.

One `Generate` call is one engine request. The handler submits it and writes
each `StreamDelta` to the client as the engine thread produces it. The
request is aborted in the engine, so its KV pages return at the next engine
step, whenever the call ends before the request does: the client cancels,
disconnects or passes its deadline (grpc cancels the handler task, and a
done-callback on the call aborts it even while no message is in flight).

Rules the service keeps (the API doc in README.md says the same):

* **Tokenizing is off the event loop.** Building a request (template,
  tokenize, validate) and the Tokenize work run in a small thread pool owned
  by the servicer, so a huge prompt does not stall other streams or the
  health check, as far as the tokenizer releases the GIL while it works
  (SentencePiece does; a Hugging Face ``tokenizers.Tokenizer.encode`` call
  holds it throughout; ``encode_batch_fast``, which `jaxinfer.text.tokenizer` uses,
  lets go of it but for converting its input and output). Tokenize calls have
  their own threads, so long texts sent to Tokenize do not delay Generate.
* **request_id.** A client-chosen id must be unique among the Generate calls
  in flight, else ALREADY_EXISTS. An id is free again once the server has
  seen the call that held it end: finished, or cancelled by the client (or
  past its deadline). On one channel the next call is guaranteed to find it
  free: HTTP/2 frames are ordered, so grpc has read the old stream's
  RST_STREAM before the new call's headers. The old handler hears of it a
  few event-loop turns later (milliseconds), so a call whose id is held by a
  call that still looks alive waits up to `RELEASE_WAIT_S` for that call to
  end before it is refused; a holder that has ended is aborted and the new
  call takes the id over (the old handler's clean-up only unregisters an
  entry that is still its own). The engine's inbox is ordered too, so the
  old abort reaches the engine before the new request does; a stream's
  first abort frees its id in the engine at once, and later ones do nothing.
* **Malformed requests.** Bytes that do not parse as the method's request
  message get INVALID_ARGUMENT and one WARNING line naming the method and the
  peer (each method's deserializer hands the handler a `MalformedRequest`
  marker instead of raising inside grpc). Unknown fields are ignored, as
  protobuf does.
* **Tokenize responses fit the message limit.** A response larger than the
  server's ``max_message_bytes`` is refused with RESOURCE_EXHAUSTED (the
  status gRPC itself gives an oversized message) and a message naming the
  response's and the request's sizes and the limit, instead of failing in
  grpc's send.

Structured output: `SamplingOptions`' ``structured_output`` oneof becomes the
request's `StructuredOutputsParams` (`structured_outputs_from_proto`); one that
does not compile is INVALID_ARGUMENT with the library's message, which names
the kind (``structured_outputs.json does not compile: ...``), refused before
the request takes any engine resources. A request that ends with
FINISH_REASON_ERROR says why in its last message's ``error``.

Admission control: with ``max_waiting`` set, a call is refused at once with
RESOURCE_EXHAUSTED when ``max_num_seqs + max_waiting`` Generate calls are
already in flight (everything beyond the engine's batch capacity is counted
as waiting). Bad input is INVALID_ARGUMENT with the library's own message
(field and limit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import grpc
from google.protobuf.message import DecodeError

from jaxinfer._version import __version__
from jaxinfer.engine.kv_transfer import error_status
from jaxinfer.metrics import RequestMetrics
from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.server import jaxinfer_pb2 as pb
from jaxinfer.server import jaxinfer_pb2_grpc as pb_grpc
from jaxinfer.server.config import SERVICE_NAME, ServerConfig
from jaxinfer.server.convert import (
    chat_input_from_proto, generation_defaults_to_proto, sampling_params_from_proto, stream_delta_to_proto,
)

log = logging.getLogger("jaxinfer.server")

TOKENIZE_WORKERS = 4  # threads that build requests and tokenize, per server
RELEASE_WAIT_S = 0.5  # how long a call waits for the running call that holds its request_id to end


def structured_outputs_from_proto(opts: pb.SamplingOptions) -> Optional[StructuredOutputsParams]:
    """The request's constraint (None when ``structured_output`` is unset); ValueError naming the field."""
    kind = opts.WhichOneof("structured_output")
    pattern = opts.whitespace_pattern or None
    if kind is None:
        if opts.flexible_whitespace or pattern is not None:
            name = "flexible_whitespace" if opts.flexible_whitespace else "whitespace_pattern"
            raise ValueError(f"sampling.{name} applies to a JSON constraint, but structured_output is unset: set "
                             "json_schema or json_object too.")
        return None
    kw: dict = {"disable_any_whitespace": not opts.flexible_whitespace, "whitespace_pattern": pattern}
    if kind == "json_schema":
        kw["json"] = opts.json_schema
    elif kind == "json_object":
        if not opts.json_object:
            raise ValueError("sampling.json_object is false: set it true for any JSON object, or leave "
                             "structured_output unset.")
        kw["json_object"] = True
    elif kind == "choice":
        kw["choice"] = list(opts.choice.choices)
    else:  # regex, grammar
        kw[kind] = getattr(opts, kind)
    return StructuredOutputsParams(**kw)


_TRANSFER_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                   410: grpc.StatusCode.NOT_FOUND, 502: grpc.StatusCode.UNAVAILABLE,
                   504: grpc.StatusCode.DEADLINE_EXCEEDED}


def _transfer_failure(delta) -> Optional[grpc.StatusCode]:
    """The gRPC status of a request whose KV transfer failed (`jaxinfer.engine.kv_transfer.error_status`), else None."""
    out = delta.output
    if out is None or not out.outputs or out.outputs[0].finish_reason != "error":
        return None
    status = error_status(out.outputs[0].error)
    return None if status is None else _TRANSFER_CODES.get(status, grpc.StatusCode.FAILED_PRECONDITION)


def response_for(delta, token_str: Callable[[int], str]) -> pb.GenerateResponse:
    """`stream_delta_to_proto`, with the request's error on the last message when it ended with one."""
    r = stream_delta_to_proto(delta, token_str)
    out = delta.output
    if out is not None and out.outputs and getattr(out.outputs[0], "error", None):
        r.error = out.outputs[0].error
    return r


class MessageTooLarge(Exception):
    """A response would exceed the server's message size limit."""


class MalformedRequest:
    """Stands in for a request whose bytes do not parse as the method's message."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: str):
        self.type_name = type_name
        self.error = error


def _lenient_deserializer(message_cls) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return MalformedRequest(message_cls.DESCRIPTOR.full_name, str(e) or "the bytes do not parse")

    return parse


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


class _Call:
    """One Generate call in flight: its engine stream, its context and the task that runs its handler."""

    __slots__ = ("stream", "context", "task", "finished")

    def __init__(self, stream, context):
        self.stream = stream
        self.context = context
        self.task = asyncio.current_task()
        self.finished = asyncio.Event()  # set when the handler has cleaned up and unregistered the call

    def abort(self) -> None:
        """Abort the request (only the stream's first abort acts; it frees the id in the engine at once)."""
        self.stream.abort()

    def ended(self) -> bool:
        """Whether the server has seen this call end, even if its handler has not finished cleaning up."""
        if self.context.done() or self.context.cancelled():
            return True
        task = self.task
        if task is None:
            return False
        if task.done():
            return True
        cancelling = getattr(task, "cancelling", None)  # Python 3.11+: grpc has injected the client's cancel
        return bool(cancelling is not None and cancelling())


class GenerationServicer(pb_grpc.GenerationServicer):
    """Generate, Tokenize and GetModelInfo over one `LLM` (the rules in full: this module's docstring).

    ``active`` maps the request id of every Generate call in flight to its call record. A request_id is
    free again once the server has seen its call end (finished, cancelled, past its deadline); on the same
    channel the next call can always reuse it, a call that finds it held waits up to `RELEASE_WAIT_S` for
    the holder to end, then gets ALREADY_EXISTS. Building requests and tokenizing run in the servicer's
    thread pool (`close` stops it); malformed request bytes get INVALID_ARGUMENT; a Tokenize response over
    ``max_message_bytes`` gets RESOURCE_EXHAUSTED.
    """

    def __init__(self, llm, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.engine = llm.engine
        self.active: dict = {}  # request id -> _Call (Generate calls in flight)
        self.rejected = 0
        self.draining = False
        self.abort_message: Optional[str] = None  # set when shutdown aborts what is left
        self.idle = asyncio.Event()
        self.idle.set()
        self.throughput = _Throughput(self.engine.stats)
        self.metrics = None  # a ServerMetrics when the server exports Prometheus metrics
        self._token_text: dict = {}
        self._pool = ThreadPoolExecutor(max_workers=TOKENIZE_WORKERS, thread_name_prefix="jaxinfer-prepare")
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxinfer-tokenize")

    # -- wiring -------------------------------------------------------------------

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register every method of the Generation service, each with a deserializer that tolerates bad bytes.

        A request that does not parse reaches the handler as a `MalformedRequest`, which is answered with
        INVALID_ARGUMENT (see `_refuse_malformed`) instead of an UNKNOWN status and a traceback from grpc.
        """
        service = pb.DESCRIPTOR.services_by_name["Generation"]
        handlers = {}
        for method in service.methods:
            if method.client_streaming:
                raise NotImplementedError(f"{method.full_name}: client-streaming methods are not wired up")
            stream = method.server_streaming
            make = grpc.unary_stream_rpc_method_handler if stream else grpc.unary_unary_rpc_method_handler
            handlers[method.name] = make(
                self._refusing_malformed(f"/{SERVICE_NAME}/{method.name}", getattr(self, method.name)),
                request_deserializer=_lenient_deserializer(getattr(pb, method.input_type.name)),
                response_serializer=getattr(pb, method.output_type.name).SerializeToString,
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        server.add_registered_method_handlers(SERVICE_NAME, handlers)

    def _refusing_malformed(self, method: str, handler: Callable):
        async def handle(request, context):
            if isinstance(request, MalformedRequest):
                await self._refuse_malformed(method, request, context)
            return await handler(request, context)

        return handle

    async def _refuse_malformed(self, method: str, request: MalformedRequest, context) -> None:
        log.warning("refused a malformed %s request from %s: %s", method, context.peer(), request.error)
        if method.endswith("/Generate"):
            self._rejected("invalid_argument")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request.type_name}: {request.error}.")

    async def _in_pool(self, fn: Callable, *args, pool: Optional[ThreadPoolExecutor] = None):
        """Run blocking work (templates, tokenizers) in the servicer's threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(pool or self._pool, fn, *args)

    def close(self) -> None:
        """Stop the tokenizing threads (work already running finishes; queued work is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected(reason)

    # -- Generate ---------------------------------------------------------------

    def _build_request(self, msg: pb.GenerateRequest, arrival: float):
        """The request through the engine's one front door (`jaxinfer.engine.processor`); ValueError for bad input."""
        params = sampling_params_from_proto(msg.sampling, self.llm.get_default_sampling_params())
        structured = structured_outputs_from_proto(msg.sampling)
        if structured is not None:  # compiled by make_request: a bad one is a ValueError naming its kind
            params = params.clone(structured_outputs=structured)
        kind = msg.WhichOneof("input")
        if kind is None:
            raise ValueError("the request has no input: set one of prompt, chat or token_ids.")
        prompt = msg.prompt if kind == "prompt" else list(msg.token_ids.ids) if kind == "token_ids" else None
        chat = chat_input_from_proto(msg.chat) if kind == "chat" else {}
        kv = None
        if msg.HasField("kv_transfer"):
            t = msg.kv_transfer
            kv = {"bootstrap_host": t.bootstrap_host or None, "bootstrap_port": t.bootstrap_port or None,
                  "bootstrap_room": t.bootstrap_room or None}
        return self.llm.make_request(
            prompt, params, request_id=msg.request_id or None, priority=msg.priority,
            metrics=RequestMetrics(arrival_time=arrival), kv_transfer_params=kv, **chat,
        )

    def _capacity(self) -> Optional[int]:
        if self.config.max_waiting is None:
            return None
        return self.llm.engine_config.max_num_seqs + self.config.max_waiting

    async def _refuse_if_draining(self, context) -> None:
        if self.draining:
            self._rejected("shutting_down")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down and accepts no new requests.")

    def capacity_refusal(self, n: int = 1) -> Optional[str]:
        """Why `n` more requests cannot be admitted now, or None (both protocols' requests count together)."""
        cap = self._capacity()
        if cap is None or len(self.active) + n <= cap:
            return None
        more = "" if n == 1 else f" and this call asks for {n}"
        return (
            f"the server is at capacity: {len(self.active)} requests in flight{more}, the most allowed is {cap} "
            f"(max_num_seqs={self.llm.engine_config.max_num_seqs} running + "
            f"max_waiting={self.config.max_waiting} waiting); retry later."
        )

    async def _refuse_if_full(self, context) -> None:
        message = self.capacity_refusal()
        if message is not None:
            self.rejected += 1
            self._rejected("resource_exhausted")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    async def _take_request_id(self, rid: str, context) -> None:
        """Return once ``rid`` is free for this call, else abort the call with ALREADY_EXISTS (see the module doc).

        grpc hands a handler its client's cancel a few loop turns after it has read it, so a new call on the
        same channel can get here while the old one still looks alive: a live holder gets `RELEASE_WAIT_S` to
        end. One that has ended (cancelled, past its deadline) is aborted here, before this call's request is
        submitted, and this call takes the id over; the old handler's clean-up leaves the new entry alone.
        """
        old = self.active.get(rid)
        if old is not None and not old.ended():
            try:
                await asyncio.wait_for(old.finished.wait(), RELEASE_WAIT_S)
            except asyncio.TimeoutError:
                pass
            old = self.active.get(rid)
        if old is not None and old.ended():
            old.abort()  # the engine's inbox is ordered: the old request goes before the new one arrives
            del self.active[rid]
            log.debug("request_id %r: taken over from a call that has ended", rid)
        if rid in self.active:
            await self._refuse_duplicate(rid, context)

    async def _refuse_duplicate(self, rid: str, context) -> None:
        self._rejected("duplicate_request_id")
        await context.abort(
            grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in use by a running request."
        )

    async def Generate(self, request, context):
        arrival = time.perf_counter()
        await self._refuse_if_draining(context)
        await self._refuse_if_full(context)  # before tokenizing: a full server says so at once
        if request.request_id:  # and so does a request_id in use
            await self._take_request_id(request.request_id, context)
        try:
            req = await self._in_pool(self._build_request, request, arrival)
        except ValueError as e:
            self._rejected("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - a bug preparing one request must not look like bad input
            log.exception("could not prepare a request")
            self._rejected("internal")
            await context.abort(grpc.StatusCode.INTERNAL, f"could not prepare the request: {e}")
        rid = req.request_id
        await self._take_request_id(rid, context)  # again: another call may have taken it meanwhile
        await self._refuse_if_draining(context)  # shutdown may have begun while it was tokenized
        await self._refuse_if_full(context)  # again: others may have been admitted meanwhile

        # These two checks await only to refuse, so from them to here the state is still as checked.
        try:
            stream = self.llm.submit(req)
        except ValueError:  # the engine holds a live request with this id (one not made by this server)
            await self._refuse_duplicate(rid, context)
        call = _Call(stream, context)
        self.active[rid] = call
        self.idle.clear()
        # Aborts the request if the call ends first (cancel, disconnect, deadline), even between messages.
        context.add_done_callback(lambda _ctx: call.abort())
        deltas = stream.__aiter__()
        try:
            async for delta in deltas:
                code = _transfer_failure(delta)
                if code is not None:  # its KV never came: the call fails with the transfer's status
                    await context.abort(code, delta.output.outputs[0].error)
                await context.write(response_for(delta, self._token_str))
        except RuntimeError as e:  # the engine failed this request
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            if stream.output is None:
                call.abort()
            try:
                await deltas.aclose()
            except BaseException:  # noqa: BLE001 - closing after a cancel must not mask it
                pass
            if self.active.get(rid) is call:  # a newer call may have taken the id over already
                del self.active[rid]
            call.finished.set()
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
            s = self._token_text[token_id] = tok.token_text(token_id)
        return s

    # -- Tokenize -----------------------------------------------------------------

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """The Tokenize answer; ValueError for bad input, `MessageTooLarge` when it would not fit a message."""
        kind = request.WhichOneof("input")
        if kind is None:
            raise ValueError("the request has no input: set prompt or chat.")
        if kind == "prompt":
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            tp = self.llm.processor.tokenize(request.prompt, add_special_tokens=add_special, fit_context=False)
        else:
            tp = self.llm.processor.tokenize(**chat_input_from_proto(request.chat), fit_context=False)
        ids, text, tok = tp.ids, tp.text, self.llm.tokenizer
        response = pb.TokenizeResponse(
            token_ids=ids, tokens=[t or "" for t in tok.convert_ids_to_tokens(ids)], count=len(ids),
            max_model_len=self.llm.max_model_len, prompt=text,
        )
        size, limit = response.ByteSize(), self.config.max_message_bytes
        if size > limit:
            raise MessageTooLarge(
                f"the Tokenize response would be {size} bytes ({len(ids)} tokens and the text; the request was "
                f"{request.ByteSize()} bytes), more than the server's message size limit of {limit} bytes "
                f"(serve --max-message-size): tokenize a shorter text."
            )
        return response

    async def Tokenize(self, request, context):
        if self.llm.tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer.")
        try:
            return await self._in_pool(self._tokenize, request, pool=self._tokenize_pool)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except MessageTooLarge as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    # -- GetModelInfo ---------------------------------------------------------------

    def model_info(self) -> pb.ModelInfo:
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
            generation_config=str(getattr(llm, "generation_config", None) or ""),
            tensor_parallel_size=e.tensor_parallel_size, kv_bytes_per_token=info["kv_bytes_per_token"],
            quantization=info["quantization"] or "",
        )

    async def GetModelInfo(self, request, context):
        return self.model_info()
