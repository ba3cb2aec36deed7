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

With ``http_port`` set, the same process also serves the OpenAI-compatible HTTP API
(`jaxinfer.server.openai_api`: uvicorn on this server's event loop, over the same
`LLM`). Its requests are registered in the servicer's ``active`` map beside the gRPC
calls, so admission control, draining and the grace period count both protocols.

Metrics: with ``metrics_port`` set, Prometheus text on ``http://host:port/metrics``
(`jaxinfer.server.metrics`: vLLM's names with the ``jaxinfer:`` prefix), from
this server's own registry.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.server.auth import BearerTokenInterceptor
from jaxinfer.server.config import SERVICE_NAME, ServerConfig
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.openai_api.app import HttpServer, bind_socket, create_app
from jaxinfer.server.servicer import GenerationServicer

log = logging.getLogger("jaxinfer.server")


class JaxinferServer:
    """A ``grpc.aio`` server around one `LLM`: Generation + health + reflection. Owns no model state."""

    def __init__(self, llm, config: Optional[ServerConfig] = None, *, http_socket=None):
        self.llm = llm
        self.http = None  # an openai_api.app.HttpServer when config.http_port is set
        self._http_socket = http_socket  # bound by the caller before loading the model (serve's CLI), else here
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
        try:
            port = await self._start(cfg)
        except BaseException:
            self.servicer.close()
            raise
        return port

    async def _start(self, cfg: ServerConfig) -> int:
        if cfg.metrics_port is not None or cfg.http_port is not None:  # HTTP serves /metrics on its own port too
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
        self.servicer.add_to_server(server)
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
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_http(cfg.metrics_host or cfg.host, cfg.metrics_port)
            except OSError as e:
                await server.stop(None)
                raise OSError(f"could not serve metrics on port {cfg.metrics_port}: {e}") from e
        if cfg.http_port is not None:
            try:
                await self._start_http(cfg)
            except BaseException:
                await server.stop(None)
                if self.metrics is not None:
                    self.metrics.stop_http()
                raise
        await server.start()
        self._server = server
        self.port = port
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sampler = asyncio.create_task(self._sample_stats())
        return port

    async def _start_http(self, cfg: ServerConfig) -> None:
        sock, self._http_socket = self._http_socket, None
        if sock is None:
            try:
                sock = bind_socket(cfg.host, cfg.http_port)
            except OSError as e:
                raise OSError(f"could not serve HTTP on port {cfg.http_port}: {e}") from e
        app = create_app(self.llm, self.servicer, cfg, self.metrics)
        self.http = HttpServer(app, sock, verbose=cfg.access_log)
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
                for call in list(s.active.values()):
                    call.abort()
                try:
                    await asyncio.wait_for(s.idle.wait(), timeout=10.0)
                except asyncio.TimeoutError:
                    log.warning("%d request(s) did not end after abort", len(s.active))
        if self._sampler is not None:
            self._sampler.cancel()
        await self._server.stop(1.0)
        self._server = None
        if self.http is not None:
            await self.http.stop()
        s.close()
        if self.metrics is not None:
            self.metrics.stop_http()
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


def serve(llm, config: ServerConfig, *, ready: Optional[Callable[[JaxinferServer], None]] = None,
          http_socket=None) -> None:
    """Run a server until SIGTERM or SIGINT, then shut down gracefully (a second signal: no grace).

    ``http_socket``: the HTTP API's listening socket, bound before the model was loaded.
    """

    async def main():
        server = JaxinferServer(llm, config, http_socket=http_socket)
        await server.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals = []

        def on_signal(signum):
            if stop.is_set():  # second signal: abort what is left now
                server.servicer.abort_message = "the server was stopped: this request was aborted."
                for call in list(server.servicer.active.values()):
                    call.abort()
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
