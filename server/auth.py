"""Bearer-token authentication of a gRPC server: `BearerTokenInterceptor`.

A call must carry ``authorization: Bearer <token>`` metadata. The scheme name
is matched case-insensitively (RFC 6750 / RFC 7235: ``bearer`` and ``BEARER``
are the same scheme), whitespace around the scheme and the token is ignored,
and the token is compared in constant time. A refused call gets
UNAUTHENTICATED; the health service stays open so load balancers can probe.
"""

from __future__ import annotations

import hmac
from typing import Callable, Optional

import grpc

from jaxinfer.server.config import HEALTH_PREFIX

_SCHEME = "bearer"


def bearer_token(header: str) -> Optional[str]:
    """The token of an ``authorization`` value that uses the Bearer scheme (any case), else None."""
    parts = header.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != _SCHEME:
        return None
    return parts[1].strip()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without ``authorization: Bearer <token>`` metadata (UNAUTHENTICATED); health stays open."""

    def __init__(self, token: str, open_prefixes: tuple = (HEALTH_PREFIX,), on_deny: Optional[Callable] = None):
        self._expected = token.strip().encode()
        self._open = open_prefixes
        self._on_deny = on_deny  # called with the method name of each refused call

    async def intercept_service(self, continuation, details):
        if details.method.startswith(self._open):
            return await continuation(details)
        given = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value if isinstance(value, str) else value.decode("latin-1")
        token = bearer_token(given) if given else None
        if token is not None and hmac.compare_digest(token.encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        msg = "missing bearer token" if not given else "invalid bearer token"
        if self._on_deny is not None:
            self._on_deny(details.method)
        return _denying_handler(handler, f"{msg}: send 'authorization: Bearer <token>' metadata.")


def _denying_handler(handler, message: str):
    """A handler of the same shape as ``handler`` that answers every call with UNAUTHENTICATED."""

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
