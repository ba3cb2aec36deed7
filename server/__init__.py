"""The gRPC server of jaxinfer: the `jaxinfer.v1` API (``jaxinfer.proto``), the service, the clients.

    jaxinfer serve --model smollm2-135m-instruct --port 50051
    client = jaxinfer.Client("localhost:50051")

Importing this package does not import grpc; its modules do.
Regenerate the API code with ``python -m jaxinfer.server.codegen``.
"""

_LAZY = {
    "Client": "jaxinfer.server.client",
    "AsyncClient": "jaxinfer.server.client",
    "ServerError": "jaxinfer.server.client",
    "JaxinferServer": "jaxinfer.server.service",
    "ServerConfig": "jaxinfer.server.service",
    "ServerThread": "jaxinfer.server.service",
    "serve": "jaxinfer.server.service",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxinfer.server' has no attribute {name!r}")
