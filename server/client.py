"""Clients of the jaxinfer gRPC server: `Client` (blocking) and `AsyncClient` (asyncio).

    client = jaxinfer.Client("localhost:50051")
    print(client.chat("Name three colours.").text)   # the server's chat template and sampling defaults
    for piece in client.generate([{"role": "user", "content": "Why stream tokens?"}], max_tokens=64):
        print(piece.text, end="", flush=True)
    print(piece.usage, piece.timings)          # the last piece carries them

    async with jaxinfer.AsyncClient("localhost:50051") as client:
        async for piece in client.generate([{"role": "user", "content": "Hi"}], max_tokens=32):
            ...

The input is a prompt string (sent as it is: no chat template), a list of chat
messages (dicts with role and content: the server renders them with the
model's chat template, as an instruct model expects) or a list of token ids;
`Client.chat` takes messages, or one user message as a string, and returns the
whole answer. Sampling options are keyword arguments named like
`jaxinfer.SamplingParams` fields (unset ones take the server's sampling
defaults: ``model_info()["generation_defaults"]``, from ``serve
--generation-config``), or a whole `SamplingParams` (every field sent). Leaving a stream early (``break``,
closing the generator) cancels the call, and the server aborts the request.

Structured output is ``structured_outputs=`` as in the library (a
`jaxinfer.StructuredOutputsParams` or a dict of its fields)::

    client.complete("A colour:", structured_outputs={"choice": ["red", "green"]}, max_tokens=8)

A request that ends with finish_reason ``"error"`` (e.g. its grammar allows
no token) says why in the last piece's ``error``.

Errors raise `ServerError` (``.code`` is a ``grpc.StatusCode``, ``.details``
the server's message); `InvalidArgument` is also a ValueError and
`DeadlineExceeded` also a TimeoutError.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Optional, Sequence, Union

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.outputs import Logprob
from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.server import jaxinfer_pb2 as pb
from jaxinfer.server import jaxinfer_pb2_grpc as pb_grpc

_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}
# SamplingOptions' structured-output fields: sent from SamplingParams.structured_outputs, not set by name.
_STRUCTURED_FIELDS = tuple(f.name for f in pb.SamplingOptions.DESCRIPTOR.oneofs_by_name["structured_output"].fields) + (
    "flexible_whitespace", "whitespace_pattern")
_SAMPLING_FIELDS = {f.name for f in pb.SamplingOptions.DESCRIPTOR.fields} - set(_STRUCTURED_FIELDS)


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


class ServerError(RuntimeError):
    """The server refused or failed a call."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(ServerError, ValueError):
    pass


class ResourceExhausted(ServerError):
    pass


class Unauthenticated(ServerError):
    pass


class Unavailable(ServerError):
    pass


class DeadlineExceeded(ServerError, TimeoutError):
    pass


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def _error(e: grpc.RpcError) -> ServerError:
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return _ERRORS.get(code, ServerError)(code, details or "")


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #


@dataclass
class GenerationPiece:
    """One streamed message: new text and its token ids; the last one also finish_reason, usage, timings."""

    request_id: str
    text: str
    token_ids: list
    logprobs: Optional[list] = None  # [Logprob] when asked for
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error" on the last piece
    stop_reason: Union[None, str, int] = None
    usage: Optional[dict] = None
    timings: Optional[dict] = None
    token_text: Optional[dict] = None  # token id -> text, for the ids in logprobs (models with a tokenizer)
    error: Optional[str] = None  # finish_reason "error": what went wrong (the server's message)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __str__(self) -> str:
        return self.text


@dataclass
class Completion:
    """A whole generation collected from its pieces (`Client.complete`)."""

    request_id: str
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[None, str, int] = None
    usage: Optional[dict] = None
    timings: Optional[dict] = None
    token_text: dict = field(default_factory=dict)
    error: Optional[str] = None  # finish_reason "error": what went wrong

    def add(self, piece: GenerationPiece) -> None:
        self.text += piece.text
        self.token_ids += piece.token_ids
        if piece.logprobs is not None:
            self.logprobs = (self.logprobs or []) + piece.logprobs
            self.token_text.update(piece.token_text or {})
        if piece.finished:
            self.finish_reason, self.stop_reason = piece.finish_reason, piece.stop_reason
            self.usage, self.timings = piece.usage, piece.timings
            self.error = piece.error


def _piece(r: pb.GenerateResponse) -> GenerationPiece:
    p = GenerationPiece(r.request_id, r.text, list(r.token_ids))
    if r.logprobs:
        p.logprobs = [Logprob(lp.token_id, lp.logprob, {t.token_id: t.logprob for t in lp.top}) for lp in r.logprobs]
        p.token_text = {lp.token_id: lp.token for lp in r.logprobs}
        p.token_text.update((t.token_id, t.token) for lp in r.logprobs for t in lp.top)
    if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        p.finish_reason = _FINISH.get(r.finish_reason, "error")
        which = r.WhichOneof("stop_reason")
        p.stop_reason = None if which is None else getattr(r, which)
        p.usage = _to_dict(r.usage)
        p.timings = _to_dict(r.timings)
        p.error = r.error or None
    return p


# --------------------------------------------------------------------------- #
# Requests
# --------------------------------------------------------------------------- #


def chat_messages(messages) -> list:
    """`Client.chat`'s input as messages: a string is one user message."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise TypeError("chat() takes a list of messages ({\"role\": ..., \"content\": ...}) or one user message "
                        f"as a string, got {type(messages).__name__}.")
    return list(messages)


def _chat_input(messages, chat_template_kwargs, add_generation_prompt) -> pb.ChatInput:
    chat = pb.ChatInput(add_generation_prompt=add_generation_prompt)
    for m in messages:
        chat.messages.add(role=m["role"], content=m["content"])
    if chat_template_kwargs:
        chat.chat_template_kwargs.update(chat_template_kwargs)
    return chat


def sampling_options(sampling_params=None, **kwargs) -> pb.SamplingOptions:
    """SamplingOptions from a `SamplingParams` (every field) and/or keyword overrides (only those given)."""
    values: dict = {}
    if sampling_params is not None:
        values = dataclasses.asdict(sampling_params)
        if values.get("max_tokens") is None:
            values.pop("max_tokens", None)  # unset: as many as the context allows
    values.update({k: v for k, v in kwargs.items() if v is not None})
    n = values.pop("n", 1)
    if n != 1:  # one Generate call streams one choice
        raise TypeError(f"n={n}: a Generate call streams one choice; send one call per choice (seed + i each), "
                        "or use the HTTP API's n.")
    if values.pop("prompt_logprobs", None) is not None:
        raise TypeError("prompt_logprobs is not in the gRPC API: use the HTTP API's prompt_logprobs (or echo with "
                        "logprobs) or the library's SamplingParams.")
    structured = values.pop("structured_outputs", None)
    unknown = sorted(set(values) - _SAMPLING_FIELDS)
    if unknown:
        hint = ""
        if set(unknown) & {"json", "regex", "choice", "grammar", "json_object", *_STRUCTURED_FIELDS}:
            hint = " (a constraint is structured_outputs=StructuredOutputsParams(json=... | regex=... | ...))"
        raise TypeError(f"unknown sampling option(s): {', '.join(unknown)}{hint}")
    opts = pb.SamplingOptions()
    if structured is not None:
        structured_outputs_to_proto(structured, opts)
    for k, v in values.items():
        if k == "stop":
            opts.stop.extend([v] if isinstance(v, str) else list(v or ()))
        elif k == "stop_token_ids":
            opts.stop_token_ids.extend(list(v or ()))
        elif k == "logit_bias":
            opts.logit_bias.update({int(t): float(b) for t, b in (v or {}).items()})
        elif v is not None:
            setattr(opts, k, v)
    return opts


def structured_outputs_to_proto(structured, opts: pb.SamplingOptions) -> pb.SamplingOptions:
    """Set ``opts``' structured_output from a `StructuredOutputsParams` or a dict of its fields (checked
    here, ValueError naming the field, as the library checks it); returns ``opts``."""
    sop = StructuredOutputsParams.from_dict(structured)
    kind = sop.kind
    if kind == "json":
        opts.json_schema = sop.json if isinstance(sop.json, str) else json.dumps(sop.json)
    elif kind == "json_object":
        opts.json_object = True
    elif kind == "choice":
        opts.choice.choices.extend(sop.choice)
    else:  # regex, grammar
        setattr(opts, kind, getattr(sop, kind))
    opts.flexible_whitespace = not sop.disable_any_whitespace
    if sop.whitespace_pattern is not None:
        opts.whitespace_pattern = sop.whitespace_pattern
    return opts


def generate_request(
    prompt,
    sampling_params=None,
    *,
    request_id: Optional[str] = None,
    priority: int = 0,
    chat_template_kwargs: Optional[dict] = None,
    add_generation_prompt: bool = True,
    **kwargs,
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        sampling=sampling_options(sampling_params, **kwargs), request_id=request_id or "", priority=priority
    )
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, pb.ChatInput):
        req.chat.CopyFrom(prompt)
    elif isinstance(prompt, Sequence) and len(prompt) and isinstance(prompt[0], dict):
        req.chat.CopyFrom(_chat_input(prompt, chat_template_kwargs, add_generation_prompt))
    elif isinstance(prompt, Sequence):
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(int(t) for t in prompt)
    else:
        raise TypeError(f"prompt must be a str, a list of chat messages or a list of token ids, got {type(prompt).__name__}")
    return req


def tokenize_request(text_or_messages, add_special_tokens=True, add_generation_prompt=True, chat_template_kwargs=None):
    if isinstance(text_or_messages, str):
        return pb.TokenizeRequest(prompt=text_or_messages, add_special_tokens=add_special_tokens)
    return pb.TokenizeRequest(chat=_chat_input(text_or_messages, chat_template_kwargs, add_generation_prompt))


def _to_dict(msg) -> dict:
    """A message as plain Python values (int64 stays int, unlike JSON mapping); unset optionals are None."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        v = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(v)
        elif f.is_repeated:
            out[f.name] = [_to_dict(x) for x in v] if f.message_type is not None else list(v)
        elif f.message_type is not None:
            out[f.name] = _to_dict(v) if msg.HasField(f.name) else None
        elif f.has_presence and not msg.HasField(f.name):
            out[f.name] = None
        else:
            out[f.name] = v
    return out


def _read(path_or_bytes) -> Optional[bytes]:
    if path_or_bytes is None or isinstance(path_or_bytes, bytes):
        return path_or_bytes
    with open(path_or_bytes, "rb") as f:
        return f.read()


def _channel_args(target, token, tls_ca, tls, options, max_message_bytes):
    opts = [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)] + list(options or ())
    creds = None
    if tls or tls_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca))
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return opts, creds, metadata


# --------------------------------------------------------------------------- #
# Clients
# --------------------------------------------------------------------------- #


class _Connection:
    """What both clients share: the channel (TLS, bearer token, message limits), the stubs, the default
    timeout, and the requests they build. ``_channels`` is the module that makes channels: ``grpc`` or ``grpc.aio``."""

    _channels: Any = grpc

    def __init__(
        self,
        target: str = "localhost:50051",
        token: Optional[str] = None,
        tls_ca: Union[None, str, bytes] = None,
        *,
        tls: bool = False,
        timeout: Optional[float] = None,
        options: Optional[list] = None,
        max_message_bytes: int = 16 * 1024 * 1024,
    ):
        opts, creds, self._metadata = _channel_args(target, token, tls_ca, tls, options, max_message_bytes)
        self.target = target
        self.timeout = timeout
        channels = self._channels
        self._channel = channels.secure_channel(target, creds, opts) if creds else channels.insecure_channel(target, opts)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _call_options(self, timeout: Optional[float]) -> dict:
        return {"timeout": timeout if timeout is not None else self.timeout, "metadata": self._metadata}


class Client(_Connection):
    """A blocking client. ``tls_ca``: a CA certificate (path or PEM bytes) turns TLS on; ``tls=True`` uses system roots."""

    def generate(self, prompt, sampling_params=None, *, timeout: Optional[float] = None, request_id=None,
                 priority: int = 0, chat_template_kwargs=None, add_generation_prompt=True,
                 **kwargs) -> Iterator[GenerationPiece]:
        """Yield `GenerationPiece`s as the server streams them; closing the iterator cancels the request."""
        req = generate_request(prompt, sampling_params, request_id=request_id, priority=priority,
                               chat_template_kwargs=chat_template_kwargs,
                               add_generation_prompt=add_generation_prompt, **kwargs)
        return self._stream(req, timeout)

    def _stream(self, req, timeout) -> Iterator[GenerationPiece]:
        call = self._stub.Generate(req, **self._call_options(timeout))
        done = False
        try:
            for r in call:
                yield _piece(r)
            done = True
        except grpc.RpcError as e:
            done = True
            raise _error(e) from None
        finally:
            if not done:
                call.cancel()

    def complete(self, prompt, sampling_params=None, **kw) -> Completion:
        """Generate and collect the whole result."""
        out = None
        for p in self.generate(prompt, sampling_params, **kw):
            out = out or Completion(p.request_id)
            out.add(p)
        return out

    def chat(self, messages, sampling_params=None, **kw) -> Completion:
        """The model's answer to a conversation (messages, or one user message as a string), rendered with the
        server's chat template and sampled at the server's defaults where ``kw`` sets nothing; `generate`'s
        keywords. To stream it: ``generate(messages, ...)``."""
        return self.complete(chat_messages(messages), sampling_params, **kw)

    def tokenize(self, text_or_messages, *, add_special_tokens=True, add_generation_prompt=True,
                 chat_template_kwargs=None, timeout: Optional[float] = None) -> dict:
        req = tokenize_request(text_or_messages, add_special_tokens, add_generation_prompt, chat_template_kwargs)
        return _to_dict(self._unary(self._stub.Tokenize, req, timeout))

    def model_info(self, timeout: Optional[float] = None) -> dict:
        return _to_dict(self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def health(self, service: str = "", timeout: Optional[float] = 5.0) -> str:
        """``"SERVING"`` or ``"NOT_SERVING"`` (the standard grpc.health.v1 check)."""
        r = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def _unary(self, method, req, timeout):
        try:
            return method(req, **self._call_options(timeout))
        except grpc.RpcError as e:
            raise _error(e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Connection):
    """The same over ``grpc.aio``: ``async for piece in client.generate(...)``; cancelling the task cancels the call."""

    _channels = grpc.aio

    async def generate(self, prompt, sampling_params=None, *, timeout: Optional[float] = None, request_id=None,
                       priority: int = 0, chat_template_kwargs=None, add_generation_prompt=True,
                       **kwargs) -> AsyncIterator[GenerationPiece]:
        req = generate_request(prompt, sampling_params, request_id=request_id, priority=priority,
                               chat_template_kwargs=chat_template_kwargs,
                               add_generation_prompt=add_generation_prompt, **kwargs)
        call = self._stub.Generate(req, **self._call_options(timeout))
        done = False
        try:
            async for r in call:
                yield _piece(r)
            done = True
        except grpc.RpcError as e:
            done = True
            raise _error(e) from None
        finally:
            if not done:
                call.cancel()

    async def complete(self, prompt, sampling_params=None, **kw) -> Completion:
        out = None
        async for p in self.generate(prompt, sampling_params, **kw):
            out = out or Completion(p.request_id)
            out.add(p)
        return out

    async def chat(self, messages, sampling_params=None, **kw) -> Completion:
        """`Client.chat` over asyncio."""
        return await self.complete(chat_messages(messages), sampling_params, **kw)

    async def tokenize(self, text_or_messages, *, add_special_tokens=True, add_generation_prompt=True,
                       chat_template_kwargs=None, timeout: Optional[float] = None) -> dict:
        req = tokenize_request(text_or_messages, add_special_tokens, add_generation_prompt, chat_template_kwargs)
        return _to_dict(await self._unary(self._stub.Tokenize, req, timeout))

    async def model_info(self, timeout: Optional[float] = None) -> dict:
        return _to_dict(await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def health(self, service: str = "", timeout: Optional[float] = 5.0) -> str:
        r = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def _unary(self, method, req, timeout):
        try:
            return await method(req, **self._call_options(timeout))
        except grpc.RpcError as e:
            raise _error(e) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
