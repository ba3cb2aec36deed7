"""`ServerThread`: a `JaxinferServer` on its own event loop in a background thread.

For tests, notebooks and programs that embed a server next to their own code:

    with ServerThread(llm, ServerConfig(port=0)) as srv:
        client = jaxinfer.Client(srv.address)
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Optional

from jaxinfer.server.config import ServerConfig
from jaxinfer.server.server import JaxinferServer
from jaxinfer.server.servicer import GenerationServicer


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
    def http_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the OpenAI-compatible API (``ServerConfig(http_port=0)``)."""
        return self.server.http_url

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
