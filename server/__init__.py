"""The gRPC server of jaxinfer: the `jaxinfer.v1` API (``jaxinfer.proto``), the service, the clients.

    jaxinfer serve --model smollm2-135m-instruct --port 50051
    client = jaxinfer.Client("localhost:50051")

    from jaxinfer.server import ServerConfig, ServerThread
    with ServerThread(llm, ServerConfig(port=0)) as srv: ...

One module per piece: ``config`` (ServerConfig, read_auth_token), ``convert``
(messages <-> library types), ``servicer`` (the Generation service), ``auth``
(bearer tokens), ``server`` (JaxinferServer, serve), ``thread`` (ServerThread),
``client`` (Client, AsyncClient), ``metrics`` (Prometheus), ``cli``; and
``openai_api``, the OpenAI-compatible HTTP API that ``JaxinferServer`` also serves
when ``ServerConfig.http_port`` is set (``jaxinfer serve --http-port``).
Importing this package does not import grpc; its modules do.
Regenerate the API code with ``python -m jaxinfer.server.codegen``.
"""

import importlib

_LAZY = {
    "Client": "jaxinfer.server.client",
    "AsyncClient": "jaxinfer.server.client",
    "ServerError": "jaxinfer.server.client",
    "JaxinferServer": "jaxinfer.server.server",
    "serve": "jaxinfer.server.server",
    "ServerConfig": "jaxinfer.server.config",
    "read_auth_token": "jaxinfer.server.config",
    "ServerThread": "jaxinfer.server.thread",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxinfer.server' has no attribute {name!r}")
