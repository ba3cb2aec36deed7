"""The FastAPI app of the OpenAI-compatible API, and `HttpServer`, which runs it with uvicorn on the gRPC server's loop.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /health`` (200
``{"status": "ok"}`` while serving, 503 ``{"status": "draining"}`` while shutting
down), ``GET /metrics`` (the server's Prometheus registry, the same numbers as
``--metrics-port``), and the worker endpoints sglang-router reads when it registers a worker:
``GET /server_info`` and ``GET /model_info`` (SGLang's fields; `server_info` / `model_info`), also under
their older names ``/get_server_info`` and ``/get_model_info``.

The port speaks HTTP/1.1. A client that opens it with HTTP/2 prior knowledge (a gRPC client: sglang-router
probes every worker URL for an SGLang and a vLLM gRPC server besides HTTP) is answered in HTTP/2 with a
GOAWAY HTTP_1_1_REQUIRED, so it fails at once with a reason and nothing is logged as an invalid request.

While the model loads, `Startup` answers in the app's place (the listener
comes up before the load, as llama-server's does): ``/health`` is 503
``{"status": "loading", "stage": ...}`` with the start-up stage running now,
every other route a 503 error object that says the model is loading.

Auth: with a token configured (``--auth-token-file`` / ``$JAXINFER_AUTH_TOKEN``),
``/v1/*``, ``/tokenize`` and ``/detokenize`` need ``Authorization: Bearer <token>``
(what the ``openai`` client sends as its ``api_key``), as vLLM does; ``/health``
and ``/metrics`` stay open. CORS only with ``--allowed-origins``.

Errors are OpenAI's error object with a one-line message: a body that is not
JSON, or whose fields have the wrong types, is a 400 naming the field; an
unknown route is a 404; nothing a client sends becomes a 500 with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
from pathlib import Path
from typing import Callable, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from jaxinfer._version import __version__
from jaxinfer.server.auth import bearer_token
from jaxinfer.server.openai_api.errors import APIError, error_body
from jaxinfer.server.openai_api.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from jaxinfer.server.openai_api.serving import OpenAIServing, _message_dict

log = logging.getLogger("jaxinfer.server.http")

_OPEN_PATHS = ("/health", "/metrics")


def _validation_message(exc: RequestValidationError) -> tuple:
    """(one-line message, param) of pydantic's first complaint: the field's path and what is wrong with it."""
    errors = exc.errors()
    if not errors:
        return "the request body is invalid.", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        ctx = e.get("ctx") or {}
        return f"the request body is not valid JSON: {ctx.get('error', e.get('msg'))}.", None
    loc = [x for x in e.get("loc", ()) if x != "body"]
    if not loc and e.get("type") == "value_error":  # a check of the whole body (e.g. lone surrogates)
        msg = str(e.get("msg", ""))
        return msg.split("Value error, ", 1)[-1], None
    # a union reports each alternative's path (``prompt.str``, ``prompt.list[int]``): keep the request's own path
    path, union = "", False
    for x in loc:
        if isinstance(x, int):
            path += f"[{x}]"
        elif isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "dict", "list")):
            union = True  # the rest names one alternative of a union, not the request's own field
            break
        else:
            path += ("." if path else "") + str(x)
    if not path:
        return f"the request body must be a JSON object: {e.get('msg')}.", None
    if e.get("type") == "missing":
        return f"{path} is required.", str(loc[0])
    got = json.dumps(e.get("input"), default=str)[:80]
    if union:
        return f"{path} has none of the accepted types (got {got}).", str(loc[0])
    return f"{path}: {e.get('msg')} (got {got}).", str(loc[0])


def create_app(llm, servicer, config, metrics=None) -> FastAPI:
    """The app over one `LLM`, sharing the gRPC servicer's admission count, draining and metrics."""
    serving = OpenAIServing(llm, servicer, served_model_name=config.served_model_name,
                            model_aliases=config.model_aliases,
                            tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser)
    app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    token = config.auth_token.strip().encode() if config.auth_token else None
    app.add_middleware(_Guard, token=token, limit=config.max_message_bytes,
                       on_deny=lambda: servicer._rejected("unauthenticated"))
    if config.allowed_origins:  # added last, so outermost: refusals carry the CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        servicer._rejected("invalid_argument")
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}." if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        servicer._rejected("internal")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())}"),
                            status_code=500)

    def disconnected(request: Request):
        async def wait():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return
        return wait

    def respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return respond(await serving.chat(body, disconnected(request)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return respond(await serving.completion(body, disconnected(request)))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(serving, llm)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        serving.check_model(name)
        return model_card(serving, llm)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer.")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages.", param="prompt")

        def run():
            if body.prompt is not None:
                return llm.processor.tokenize(body.prompt, add_special_tokens=body.add_special_tokens,
                                              fit_context=False)
            kwargs = dict(body.chat_template_kwargs or {})
            if body.tools:
                kwargs["tools"] = body.tools
            add_generation_prompt = body.add_generation_prompt
            if body.continue_final_message and "add_generation_prompt" not in body.model_fields_set:
                add_generation_prompt = False
            return llm.processor.tokenize(messages=[_message_dict(i, m) for i, m in enumerate(body.messages)],
                                          add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs,
                                          fit_context=False, continue_final_message=body.continue_final_message)

        try:
            tp = await servicer._in_pool(run, pool=servicer._tokenize_pool)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        out = {"count": len(tp.ids), "max_model_len": llm.max_model_len, "tokens": tp.ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [t or "" for t in llm.tokenizer.convert_ids_to_tokens(tp.ids)]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer.")
        vocab = llm.model_config.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}] = {t} is out of range: token ids must be in [0, {vocab}).",
                               param="tokens")
        text = await servicer._in_pool(llm.tokenizer.decode, body.tokens, pool=servicer._tokenize_pool)
        return {"prompt": text}

    @app.get("/health")
    async def health():
        if servicer.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(serving, llm, config)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return model_info(serving, llm)

    return app


class Startup:
    """The ASGI app uvicorn serves: answers for the real app while the model loads, then hands every request to it.

    ``state()`` says what the start is doing (``{"stage": ..., ...}``, read at each request). Until `ready`:
    ``/health`` is 503 ``{"status": "loading", **state()}``, and every other route a 503 OpenAI error
    object saying the model is loading (with ``Retry-After``); nothing else is served, so no route
    needs the token yet. After `stopping` (a signal before the model was ready) /health says ``"stopping"``.
    """

    def __init__(self, state: Callable[[], dict]):
        self.state = state
        self.app = None  # the FastAPI app (`create_app`), once the model is loaded
        self.stopping = False

    def ready(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        app = self.app
        if app is not None:
            return await app(scope, receive, send)
        if scope["type"] != "http":  # lifespan is off and websockets are not served
            return None
        if scope["path"] == "/health":
            status = "stopping" if self.stopping else "loading"
            response = JSONResponse({"status": status, **self.state()}, status_code=503)
        else:
            what = "shutting down" if self.stopping else "loading its model"
            stage = self.state().get("stage")
            detail = f" ({stage})" if stage and not self.stopping else ""
            body = error_body(503, f"the server is {what}{detail}; GET /health answers 200 once it is ready.")
            response = JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        await response(scope, receive, send)


class _Guard:
    """Plain ASGI middleware: the bearer token (open paths aside) and the body-size limit, counted as the body
    arrives, so a chunked upload is held to it as well as one with a Content-Length."""

    def __init__(self, app, *, token: Optional[bytes], limit: int, on_deny):
        self.app = app
        self.token = token
        self.limit = limit
        self.on_deny = on_deny

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if self.token is not None and scope["method"] != "OPTIONS" and not scope["path"].startswith(_OPEN_PATHS):
            given = headers.get("authorization", "")
            got = bearer_token(given) if given else None
            if got is None or not hmac.compare_digest(got.encode(), self.token):
                self.on_deny()
                what = "missing" if not given else "invalid"
                body = error_body(401, f"{what} API key: send 'Authorization: Bearer <token>'.", code="invalid_api_key")
                return await JSONResponse(body, status_code=401)(scope, receive, send)
        size = headers.get("content-length", "")
        if size.isdigit() and int(size) > self.limit:
            return await self._too_large(int(size), scope, receive, send)
        seen = 0
        refused = False

        async def counted_receive():
            # past the limit: answer 413 now and tell the app the client is gone, so it stops reading
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    await self._too_large(seen, scope, receive, send, at_least=True)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not refused:  # after a 413 the app's own answer is dropped
                await send(message)

        await self.app(scope, counted_receive, guarded_send)

    async def _too_large(self, size: int, scope, receive, send, at_least: bool = False):
        what = f"more than {size - 1}" if at_least else str(size)
        body = error_body(413, f"the request body is {what} bytes, more than the server's limit of {self.limit} "
                          "bytes (serve --max-message-size).")
        await JSONResponse(body, status_code=413)(scope, receive, send)


def model_card(serving: OpenAIServing, llm) -> dict:
    source = getattr(llm, "model_source", None)
    return {
        "id": serving.model_name, "object": "model", "created": serving.created, "owned_by": "jaxinfer",
        "root": str(source.path) if source is not None else llm.model_name, "parent": None,
        "max_model_len": llm.max_model_len, "vocab_size": llm.model_config.vocab_size,
        "sampling_defaults": serving.sampling_defaults(),  # what a request's unset sampling fields take
    }


def _model_paths(llm) -> tuple:
    """(model path, tokenizer path) as SGLang reports them: where the model was loaded from, and the directory
    holding its tokenizer (None for a GGUF file or an in-memory model: there is no file a router could read)."""
    source = getattr(llm, "model_source", None)
    if source is None:
        return None, None
    path = Path(source.path)
    tokenizer = str(path) if path.is_dir() and (path / "tokenizer.json").is_file() else None
    return str(path), tokenizer


def server_info(serving: OpenAIServing, llm, config) -> dict:
    """``GET /server_info``: SGLang's server description, in the fields sglang-router reads when it registers a
    worker (model_path, served_model_name, tp_size, dp_size, disaggregation_mode: its labels; served_model_name,
    else model_path, is the worker's model id) and the engine's limits under SGLang's names.

    dp_size is 1: the router's ``--dp-aware`` mode addresses ranks inside one server (``routed_dp_rank``),
    which this server does not take; replicas are separate servers behind the router."""
    ecfg = llm.engine_config
    allocator = llm.engine.allocator
    model_path, tokenizer_path = _model_paths(llm)
    mode = getattr(config, "disaggregation_mode", None)
    info = {
        "model_path": model_path or llm.model_name,
        "tokenizer_path": tokenizer_path,
        "served_model_name": serving.model_name,
        "tp_size": ecfg.tensor_parallel_size,
        "dp_size": 1,
        "disaggregation_mode": mode or "null",  # SGLang's spelling of "no role"
        "page_size": ecfg.page_size,
        "context_length": llm.max_model_len,
        "max_running_requests": ecfg.max_num_seqs,
        "max_prefill_tokens": llm.engine.scheduler.budget,  # the tokens one step computes
        "max_total_tokens": allocator.num_usable * ecfg.page_size,  # KV-cache tokens
        "kv_cache_dtype": ecfg.kv_cache_dtype,
        "dtype": ecfg.dtype,
        "version": __version__,
    }
    port = getattr(config, "disaggregation_bootstrap_port", None)
    if mode and port is not None:
        info["disaggregation_bootstrap_port"] = port
    return info


def model_info(serving: OpenAIServing, llm) -> dict:
    """``GET /model_info``: SGLang's model description (model_path, tokenizer_path, is_generation, model_type)."""
    model_path, tokenizer_path = _model_paths(llm)
    return {
        "model_path": model_path or llm.model_name,
        "tokenizer_path": tokenizer_path,
        "served_model_name": serving.model_name,
        "is_generation": True,
        "model_type": llm.model_config.architecture,
        "context_length": llm.max_model_len,
        "vocab_size": llm.model_config.vocab_size,
    }


# --------------------------------------------------------------------------- #
# the uvicorn server, on the caller's event loop
# --------------------------------------------------------------------------- #


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), bound now (so a busy port fails before the model loads)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what an HTTP/2 client with prior knowledge sends first
_H2_HTTP_1_1_REQUIRED = 0xD
_H2_REFUSAL = b"this port speaks HTTP/1.1 (jaxinfer's OpenAI API); jaxinfer's gRPC API has a port of its own"


def _h2_frame(kind: int, payload: bytes) -> bytes:
    """One HTTP/2 frame on stream 0 with no flags: 24-bit length, type, flags, stream id, payload (RFC 9113 4.1)."""
    return len(payload).to_bytes(3, "big") + bytes([kind, 0]) + (0).to_bytes(4, "big") + payload


H2_REFUSAL = (_h2_frame(0x4, b"")  # the server's preface: an empty SETTINGS frame
              + _h2_frame(0x7, (0).to_bytes(4, "big") + _H2_HTTP_1_1_REQUIRED.to_bytes(4, "big") + _H2_REFUSAL))


def _answering_h2c(base: type) -> type:
    """uvicorn's HTTP/1.1 protocol class, made to answer a connection that opens with HTTP/2's preface: the
    server's SETTINGS and a GOAWAY(HTTP_1_1_REQUIRED), then the connection closes (RFC 9113 3.4, 5.4.1),
    where uvicorn would log an invalid request and answer HTTP/1.1 400 to a client that cannot read it."""

    class Protocol(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._first_bytes: Optional[bytes] = b""  # None once the connection is known to be HTTP/1.1

        def data_received(self, data: bytes) -> None:
            if self._first_bytes is None:
                return super().data_received(data)
            head = self._first_bytes + data
            n = min(len(head), len(H2_PREFACE))
            if head[:n] != H2_PREFACE[:n]:
                self._first_bytes = None
                return super().data_received(head)
            if len(head) < len(H2_PREFACE):
                self._first_bytes = head  # the preface split across reads: wait for the rest
                return None
            self._first_bytes = None
            log.debug("answered an HTTP/2 (gRPC) connection from %s with GOAWAY HTTP_1_1_REQUIRED",
                      getattr(self, "client", None))
            self.transport.write(H2_REFUSAL)
            self.transport.close()
            return None

    Protocol.__name__ = Protocol.__qualname__ = f"H2cAnswering{base.__name__}"
    return Protocol


class HttpServer:
    """uvicorn serving the app on the running event loop; signals stay with the caller (`jaxinfer.server.serve`).

    ``app``: any ASGI 3 app: the `create_app` app, or a `Startup` that hands over to it once the model is loaded.
    """

    def __init__(self, app, sock: socket.socket, *, verbose: bool = False):
        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the gRPC server's serve() owns SIGTERM/SIGINT and drains both
                yield

        http = _answering_h2c(import_from_string(HTTP_PROTOCOLS["auto"]))
        cfg = uvicorn.Config(app, log_config=None, access_log=verbose, lifespan="off", timeout_keep_alive=30,
                             timeout_graceful_shutdown=2, ws="none", interface="asgi3", http=http)
        self.server = _Server(cfg)
        self.sock = sock
        self.port: int = sock.getsockname()[1]
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped at start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout=10.0)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            self._task.cancel()
        self._task = None
