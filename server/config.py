"""What a gRPC server is configured with: `ServerConfig`, its defaults, and where the auth token comes from.

    config = ServerConfig(port=0, max_waiting=64, auth_token=read_auth_token(None))

Validation happens when the config is built, so a bad flag fails before any
model is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from jaxinfer.server import jaxinfer_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxinfer.v1.Generation"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
DEFAULT_PORT = 50051
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
AUTH_TOKEN_ENV = "JAXINFER_AUTH_TOKEN"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0: pick a free port (see JaxinferServer.port)
    max_waiting: Optional[int] = None  # None: unbounded
    grace_period: float = 30.0  # seconds running requests get to finish on shutdown
    tls_cert: Optional[str] = None  # PEM file paths; both or neither
    tls_key: Optional[str] = None
    auth_token: Optional[str] = None  # require "authorization: Bearer <token>" (health stays open)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # the largest request and the largest response
    reflection: bool = True
    metrics_port: Optional[int] = None  # Prometheus text on http://<metrics_host>:<port>/metrics; None: off, 0: any
    metrics_host: Optional[str] = None  # None: the server's host
    # The OpenAI-compatible HTTP API (jaxinfer.server.openai_api) on the same host and engine
    http_port: Optional[int] = None  # None: off, 0: any free port (see JaxinferServer.http_port)
    served_model_name: Optional[str] = None  # the name /v1/models lists and requests must use (None: the model's)
    model_aliases: tuple = ()  # other names requests may use when served_model_name is not set (serve's --model)
    allowed_origins: tuple = ()  # CORS origins for browser clients ("*" for any); empty: no CORS
    tool_call_parser: Optional[str] = None  # None: the family's own format when its chat template shows one
    reasoning_parser: Optional[str] = None  # e.g. "qwen3": <think>...</think> -> reasoning_content
    access_log: bool = False  # one INFO line per HTTP request (serve --verbose)

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
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}.")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("the served model name is empty.")
        self.allowed_origins = tuple(self.allowed_origins or ())

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
