"""The gRPC server process: `JaxinferServer` (a ``grpc.aio`` server around one `LLM`) and `serve`.

    server = JaxinferServer(llm, ServerConfig(port=50051))
    port = await server.start()
    ...
    await server.shutdown(grace=30)

It serves `jaxinfer.v1.Generation` (`jaxinfer.server.servicer`), the standard
health service and reflection, with optional TLS and bearer tokens
(`jaxinfer.server.auth`). `serve()` runs a server until SIGTERM/SIGINT and then
shuts it down gracefully: health turns NOT_SERVING, new calls get UNAVAILABLE,
running requests may finish within the grace period, and the rest are aborted
with UNAVAILABLE and a message that says so.

Start-up you can watch: ``JaxinferServer(None, config)`` (``serve(None, config,
load=...)``, as ``jaxinfer serve`` does) brings its listeners up before the model
is loaded. Until `JaxinferServer.attach` hands it the `LLM`, gRPC health is
NOT_SERVING and Generation calls get UNAVAILABLE naming the start-up stage, and
HTTP ``/health`` answers 503 ``{"status": "loading", "stage": ...}`` (the stage
running now, from `jaxinfer.progress`); then health turns SERVING and /health 200.

With ``http_port`` set, the same process also serves the OpenAI-compatible HTTP API
(`jaxinfer.server.openai_api`: uvicorn on this server's event loop, over the same
`LLM`). Its requests are registered in the servicer's ``active`` map beside the gRPC
calls, so admission control, draining and the grace period count both protocols.

Metrics: with ``metrics_port`` set, Prometheus text on ``http://host:port/metrics``
(`jaxinfer.server.metrics`: vLLM's names with the ``jaxinfer:`` prefix), from
this server's own registry, once the model is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer import progress
from jaxinfer.server import jaxinfer_pb2 as pb
from jaxinfer.server.auth import BearerTokenInterceptor
from jaxinfer.server.config import SERVICE_NAME, ServerConfig
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.openai_api.app import HttpServer, Startup, bind_socket, create_app
from jaxinfer.server.servicer import GenerationServicer

log = logging.getLogger("jaxinfer.server")


class StoppedWhileLoading(Exception):
    """`serve` was stopped by a signal before its model was loaded (the load may still be running)."""


class _Registrations:
    """Stands in for a grpc server in ``GenerationServicer.add_to_server``: keeps what it registers."""

    def __init__(self):
        self.generic: tuple = ()

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic += tuple(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        pass  # the generic handlers above serve the same methods


class _GenerationMethods(grpc.GenericRpcHandler):
    """The Generation service on the grpc server from its start: UNAVAILABLE, naming the start-up stage, until
    a servicer is attached (the model is loaded); then that servicer's own handlers."""

    def __init__(self, loading: Callable[[], dict]):
        self._loading = loading
        self._attached: Optional[tuple] = None
        self._refusals = {}
        for m in pb.DESCRIPTOR.services_by_name["Generation"].methods:
            make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
            self._refusals[f"/{SERVICE_NAME}/{m.name}"] = make(self._refuse)

    def attach(self, servicer: GenerationServicer) -> None:
        registrations = _Registrations()
        servicer.add_to_server(registrations)
        self._attached = registrations.generic

    def service(self, handler_call_details):
        attached = self._attached
        if attached is None:
            return self._refusals.get(handler_call_details.method)
        for generic in attached:
            handler = generic.service(handler_call_details)
            if handler is not None:
                return handler
        return None

    async def _refuse(self, request, context) -> None:
        stage = self._loading().get("stage", "loading")
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"the server is loading its model ({stage}); grpc.health.v1 says SERVING once it is ready.")


class JaxinferServer:
    """A ``grpc.aio`` server around one `LLM`: Generation + health + reflection. Owns no model state.

    ``llm`` None: `start` brings the listeners up in the loading state (health NOT_SERVING, HTTP /health 503
    "loading") and `attach` serves the model once it is loaded.
    """

    def __init__(self, llm=None, config: Optional[ServerConfig] = None, *, http_socket=None):
        self.llm = llm
        self.http = None  # an openai_api.app.HttpServer when config.http_port is set
        self.startup: Optional[Startup] = None  # the HTTP app uvicorn serves: answers while loading
        self._http_socket = http_socket  # bound by the caller before loading the model (serve's CLI), else here
        self.config = config or ServerConfig()
        self.port: Optional[int] = None
        self.servicer: Optional[GenerationServicer] = None
        self.health: Optional[health.aio.HealthServicer] = None
        self._generation = _GenerationMethods(self.loading_state)
        self._server: Optional[grpc.aio.Server] = None
        self._sampler: Optional[asyncio.Task] = None
        self._stopped = asyncio.Event()
        self._t_start = time.monotonic()  # reset when the listeners come up
        self.metrics = None  # a ServerMetrics when config.metrics_port is set
        self.metrics_port: Optional[int] = None

    @property
    def ready(self) -> bool:
        """Whether the model is being served (health SERVING)."""
        return self.servicer is not None

    def loading_state(self) -> dict:
        """What the start is doing: ``{"stage": the start-up stage running now, "elapsed_s": since the listeners
        came up}``, with the stage's own ``stage_elapsed_s`` and, when it counts, ``done`` of ``total``."""
        now = progress.current()
        state = {"stage": now["stage"] if now else "loading the model",
                 "elapsed_s": round(time.monotonic() - self._t_start, 1)}
        if now:
            state["stage_elapsed_s"] = now["elapsed_s"]
            if "total" in now:
                state.update(done=now["done"], total=now["total"])
        return state

    async def start(self) -> int:
        """Bind and start the listeners; with an `LLM`, serve it at once, else answer "loading" until `attach`."""
        port = await self._listen(self.config)
        if self.llm is not None:
            try:
                await self.attach(self.llm)
            except BaseException:
                await self._stop_listeners()
                raise
        return port

    async def _listen(self, cfg: ServerConfig) -> int:
        self._t_start = time.monotonic()

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
        server.add_generic_rpc_handlers((self._generation,))
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
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if cfg.http_port is not None:
            try:
                await self._start_http(cfg)
            except BaseException:
                await server.stop(None)
                raise
        await server.start()
        self._server = server
        self.port = port
        return port

    async def attach(self, llm) -> None:
        """Serve `llm` (loaded while the listeners answered "loading"): health SERVING, /health 200."""
        cfg = self.config
        servicer = GenerationServicer(llm, cfg)
        try:
            if cfg.metrics_port is not None or cfg.http_port is not None:  # HTTP serves /metrics on its port too
                self.metrics = ServerMetrics(llm.engine, llm.model_name, active_calls=lambda: len(servicer.active))
                servicer.metrics = self.metrics
            if cfg.metrics_port is not None:
                try:
                    self.metrics_port = self.metrics.start_http(cfg.metrics_host or cfg.host, cfg.metrics_port)
                except OSError as e:
                    raise OSError(f"could not serve metrics on port {cfg.metrics_port}: {e}") from e
            app = create_app(llm, servicer, cfg, self.metrics) if self.startup is not None else None
        except BaseException:
            servicer.close()
            if self.metrics is not None:
                self.metrics.stop_http()
            raise
        self.llm = llm
        self.servicer = servicer
        self._generation.attach(servicer)
        if app is not None:
            self.startup.ready(app)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sampler = asyncio.create_task(self._sample_stats())

    async def _start_http(self, cfg: ServerConfig) -> None:
        sock, self._http_socket = self._http_socket, None
        if sock is None:
            try:
                sock = bind_socket(cfg.host, cfg.http_port)
            except OSError as e:
                raise OSError(f"could not serve HTTP on port {cfg.http_port}: {e}") from e
        self.startup = Startup(self.loading_state)
        self.http = HttpServer(self.startup, sock, verbose=cfg.access_log)
        await self.http.start()

    @property
    def http_port(self) -> Optional[int]:
        return None if self.http is None else self.http.port

    @property
    def http_url(self) -> Optional[str]:
        """``http://host:port`` of the OpenAI-compatible API (its routes are under ``/v1``), or None."""
        if self.http is None:
            return None
        host = self.config.host.strip("[]")
        host = "127.0.0.1" if host == "0.0.0.0" else "[::1]" if host == "::" else f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.http.port}"

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
        if s is not None:
            s.draining = True
        if self.startup is not None:
            self.startup.stopping = True
        await self.health.enter_graceful_shutdown()
        if s is not None and s.active:
            log.info("shutting down: waiting up to %.1f s for %d running request(s)", grace, len(s.active))
            try:
                await asyncio.wait_for(s.idle.wait(), timeout=grace)
            except asyncio.TimeoutError:
                s.abort_message = (
                    f"the server shut down: this request was aborted after the {grace:g} s grace period."
                )
                log.info("grace period over: aborting %d request(s)", len(s.active))
                for call in list(s.active.values()):
                    call.abort()
                try:
                    await asyncio.wait_for(s.idle.wait(), timeout=10.0)
                except asyncio.TimeoutError:
                    log.warning("%d request(s) did not end after abort", len(s.active))
        await self._stop_listeners()
        if s is not None:
            s.close()
        self._stopped.set()

    async def _stop_listeners(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            self._sampler = None
        if self._server is not None:
            await self._server.stop(1.0)
            self._server = None
        if self.http is not None:
            await self.http.stop()
        if self.metrics is not None:
            self.metrics.stop_http()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


def serve(llm, config: ServerConfig, *, ready: Optional[Callable[[JaxinferServer], None]] = None,
          http_socket=None, load: Optional[Callable[[], object]] = None) -> None:
    """Run a server until SIGTERM or SIGINT, then shut down gracefully (a second signal: no grace).

    ``llm`` None and ``load`` given: the listeners come up first and answer as loading (gRPC health
    NOT_SERVING, HTTP /health 503 with the stage) while ``load()`` builds the `LLM` in a worker thread;
    then the model is served. An exception from ``load`` stops the listeners and is raised here; a signal
    before the load ends stops them and raises `StoppedWhileLoading` (the load thread is a daemon).
    ``ready(server)``: called once the model is served.
    ``http_socket``: the HTTP API's listening socket, bound before the model was loaded.
    """
    if (llm is None) == (load is None):
        raise ValueError("serve needs an LLM or a load function (one of the two).")

    async def main():
        server = JaxinferServer(llm, config, http_socket=http_socket)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals = []

        def on_signal(signum):
            if stop.is_set():  # second signal: abort what is left now
                if server.servicer is not None:
                    server.servicer.abort_message = "the server was stopped: this request was aborted."
                    for call in list(server.servicer.active.values()):
                        call.abort()
                return
            log.info("received %s: %s", signal.Signals(signum).name, "draining" if server.ready else "stopping")
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
                signals.append(sig)
            except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
                pass
        try:
            await server.start()  # the handlers are in place first: a signal as soon as /health answers counts
            if load is not None:
                http = f" and {server.http_url} (HTTP, /health)" if server.http_url else ""
                progress.say(f"listening on {server.address} (gRPC){http}: loading the model, ready when health "
                             "says so")
                loading = asyncio.ensure_future(_in_daemon_thread(load))
                stopping = asyncio.ensure_future(stop.wait())
                await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if not loading.done():
                    loading.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waits on it now
                    await server.shutdown(0)
                    raise StoppedWhileLoading("stopped by a signal while loading the model")
                try:
                    await server.attach(loading.result())
                except BaseException:
                    await server.shutdown(0)
                    raise
            if ready is not None:
                ready(server)
            await stop.wait()
            await server.shutdown(config.grace_period)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    asyncio.run(main())


async def _in_daemon_thread(fn: Callable[[], object]):
    """``fn()`` in a daemon thread (a model load cannot be cancelled; a signal must not wait for it to end)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result, error) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: serve returned (stopped while loading)
            pass

    threading.Thread(target=run, name="jaxinfer-load", daemon=True).start()
    return await done
