"""Command-line pieces for the server: ``jaxinfer serve`` and ``jaxinfer generate --server``.

Wired into ``jaxinfer/cli/main.py``:

    s = sub.add_parser("serve", ...); add_serve_arguments(s); s.set_defaults(func=run_serve)
    # in cmd_generate: if args.server: return generate_via_server(args)

The flags themselves (model, engine, sampling, prompt format, output, server)
are the groups of `jaxinfer.cli.flags`, shared with local ``generate``,
``warmup`` and ``bench``: the same names, help and defaults everywhere.
Both functions return an exit status: 0, 1 (the server failed or is
unreachable) or 2 (bad input, reported as one ``jaxinfer: error: ...`` line).

Imports: `jaxinfer.cli.main` imports this module for ``--help``, so its top imports
nothing slow; the server (`jaxinfer.server`: protobuf, grpc, fastapi), the engine
(`jaxinfer.engine.distributed`, `jaxinfer.llm`: JAX) and `jaxinfer.metrics` (numpy)
are imported inside the function that uses them, after the flags are checked. ``serve``
imports the server before it binds the ports and the engine after (a start-up stage,
while ``/health`` answers "loading").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import socket
import sys
from typing import Optional

from jaxinfer import progress
from jaxinfer.cli.argtypes import int_in
from jaxinfer.cli.flags import (
    EXIT_INCOMPLETE,
    UsageError,
    add_engine_flags,
    add_model_flags,
    chat_messages,
    chat_mode,
    check_engine_flags,
    check_generate_args,
    constraint_flag,
    generate_result,
    generate_sampling,
    length_notice,
    llm_kwargs,
    positive_int,
    print_logprobs,
    refuse_local_flags,
    seconds,
)
from jaxinfer.engine.compile_cache import enable_compilation_cache

_nonnegative_int = int_in(0)
_port = int_in(0, 65535)


def _err(message: str, code: int) -> int:
    sys.stderr.write(f"jaxinfer: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    return code


# --------------------------------------------------------------------------- #
# jaxinfer serve
# --------------------------------------------------------------------------- #


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """serve's flags: the model and engine groups of every command, then the network's and the scheduler's own."""
    add_model_flags(p)
    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, loopback only; 0.0.0.0 for every interface)")
    n.add_argument("--port", type=_port, default=50051, help="port to bind (default: 50051; 0 picks a free one)")
    n.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve TLS (needs --tls-key)")
    n.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    n.add_argument("--auth-token-file", metavar="FILE",
                   help="require 'authorization: Bearer <token>' with the token in FILE "
                   "(default: $JAXINFER_AUTH_TOKEN if set; health checks stay open)")
    n.add_argument("--max-message-size", type=positive_int, default=16 * 1024 * 1024, metavar="BYTES",
                   help="largest request or response message (default: 16 MiB)")
    n.add_argument("--max-waiting", type=_nonnegative_int, metavar="N",
                   help="admission control: refuse new requests (RESOURCE_EXHAUSTED) when N are already waiting "
                   "beyond the engine's batch (default: unbounded)")
    n.add_argument("--grace-period", type=seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, let running requests finish for this long, then abort them (default: 30)")
    n.add_argument("--no-reflection", action="store_true", help="do not serve gRPC server reflection")
    n.add_argument("--metrics-port", type=_port, metavar="PORT",
                   help="serve Prometheus metrics (text exposition) at http://HOST:PORT/metrics, on the same host "
                   "as the server (default: off)")
    h = p.add_argument_group("OpenAI-compatible HTTP API")
    h.add_argument("--http-port", type=_port, metavar="PORT",
                   help="also serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, "
                   "/tokenize, /detokenize, /health, /metrics) on this port of --host, on the same engine "
                   "(default: off; 0 picks a free one)")
    h.add_argument("--served-model-name", metavar="NAME",
                   help="the model name /v1/models lists and requests must use (default: the model's name)")
    h.add_argument("--allowed-origins", metavar="ORIGINS", type=_origins, default=(),
                   help="comma-separated origins allowed by CORS, for browser chat UIs ('*' for any; default: none)")
    h.add_argument("--tool-call-parser", metavar="NAME",
                   help="how to read tool calls in the model's output: hermes, llama3_json, mistral (default: the "
                   "format the model's chat template shows, if any)")
    h.add_argument("--reasoning-parser", metavar="NAME",
                   help="split the model's reasoning from its answer: qwen3, deepseek_r1 (<think>...</think> -> "
                   "reasoning_content; default: off)")
    d = p.add_argument_group("prefill/decode disaggregation (SGLang's flags; behind sglang-router --pd-disaggregation)")
    d.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null",
                   help="prefill: compute prompts and their first token, hold their KV for a decode server; "
                   "decode: take each request's KV from the prefill server its bootstrap_host/port/room name, "
                   "and decode (default: null, one engine does both)")
    d.add_argument("--disaggregation-bootstrap-port", type=_port, default=8998, metavar="PORT",
                   help="prefill: the HTTP port decode servers ask for a request's KV (default: 8998; 0: any)")
    d.add_argument("--disaggregation-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="prefill: free a prompt's held KV pages when no decode server has taken them after "
                   "this long; decode: give up waiting for a transfer after this long (default: 30)")
    e = add_engine_flags(p, warmup="before accepting requests (default: on; --no-warmup accepts requests at once "
                         "and compiles each program when a request first needs it)")
    e.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs, or priority (a request's priority field; lower runs first) (default: fcfs)")
    e.add_argument("--log-stats-interval", type=seconds, default=10.0, metavar="SECONDS",
                   help="log the engine's throughput / running / waiting / KV line this often while busy "
                   "(default: 10; 0 disables)")


def _origins(text: str) -> tuple:
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    if not origins:
        raise argparse.ArgumentTypeError("give at least one origin, e.g. http://localhost:3000 or '*'")
    return origins


def server_config_from_args(args: argparse.Namespace):
    from jaxinfer.server.config import ServerConfig, read_auth_token

    config = ServerConfig(
        host=args.host, port=args.port, max_waiting=args.max_waiting, grace_period=args.grace_period,
        tls_cert=args.tls_cert, tls_key=args.tls_key, auth_token=read_auth_token(args.auth_token_file),
        max_message_bytes=args.max_message_size, reflection=not args.no_reflection,
        metrics_port=getattr(args, "metrics_port", None), http_port=getattr(args, "http_port", None),
        served_model_name=getattr(args, "served_model_name", None),
        model_aliases=(args.model,) if getattr(args, "model", None) else (),
        allowed_origins=getattr(args, "allowed_origins", ()) or (),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        access_log=bool(getattr(args, "verbose", False)),
    )
    _check_parsers(config)
    # what /server_info reports (sglang-router reads the role and the bootstrap port there)
    mode = getattr(args, "disaggregation_mode", "null")
    config.disaggregation_mode = None if mode in (None, "null") else mode
    config.disaggregation_bootstrap_port = args.disaggregation_bootstrap_port if mode == "prefill" else None
    return config


def kv_transfer_config(args: argparse.Namespace) -> Optional[dict]:
    """The LLM's ``kv_transfer_config`` from --disaggregation-mode (None: no role)."""
    mode = getattr(args, "disaggregation_mode", "null")
    if mode in (None, "null"):
        return None
    return {"role": mode, "bootstrap_host": args.host, "bootstrap_port": args.disaggregation_bootstrap_port,
            "timeout_s": args.disaggregation_timeout, "transfer_host": args.host}


def _check_parsers(config) -> None:
    """Unknown parser names fail before the model loads (ValueError naming the choices)."""
    if config.http_port is None and (config.tool_call_parser or config.reasoning_parser):
        raise ValueError("--tool-call-parser and --reasoning-parser need --http-port (they shape OpenAI responses).")
    if config.tool_call_parser:
        from jaxinfer.server.openai_api.tool_parsers import get_tool_parser

        get_tool_parser(config.tool_call_parser)
    if config.reasoning_parser:
        from jaxinfer.server.openai_api.reasoning import get_reasoning_parser

        get_reasoning_parser(config.reasoning_parser)


def bind_ports(config) -> object:
    """Check the gRPC port and bind the HTTP one before the (slow) model load; returns the HTTP socket or None.

    A busy port is an OSError here, in seconds, instead of after loading and compiling.
    """
    from jaxinfer.server.openai_api.app import bind_socket

    if config.port:
        probe = bind_socket(config.host, config.port)  # gRPC binds its own socket later: only check it is free
        probe.close()
    if config.metrics_port:
        bind_socket(config.metrics_host or config.host, config.metrics_port).close()
    if config.http_port is None:
        return None
    sock = bind_socket(config.host, config.http_port)
    if config.port and sock.getsockname()[1] == config.port:
        sock.close()
        raise OSError(socket.errno.EADDRINUSE, "--http-port and --port are the same port")
    return sock


def _quiet_third_party(verbose: bool) -> None:
    """Third-party INFO (absl and orbax at restore, uvicorn at start) stays out of the log unless --verbose."""
    if verbose:
        return
    for name in ("absl", "orbax", "uvicorn", "uvicorn.error", "uvicorn.access", "jax", "jaxlib", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from absl import logging as absl_logging  # lazy: optional, it comes with JAX and orbax

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:  # pragma: no cover - absl comes with orbax
        pass


class _NotProgress(logging.Filter):
    """Drops the start-up stage records of `jaxinfer.progress` (warnings pass)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "jaxinfer" and record.module == "progress" and record.levelno <= logging.INFO)


def _configure_logging(args: argparse.Namespace) -> None:
    """INFO for jaxinfer's loggers, WARNING for JAX's, and each start-up stage reported once.

    The stages of the start are INFO records of `jaxinfer.progress`: with
    progress shown on stderr (a terminal, or --verbose) they would appear a
    second time as log lines, and --quiet wants none, so in both cases they
    are dropped from the log; otherwise (stderr is a log file) the log lines
    are how they are reported.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not os.environ.get("JAX_LOGGING_LEVEL"):  # JAX's own setting wins when given
        # e.g. "Unable to initialize backend 'tpu'" from jax._src.xla_bridge on a CPU machine
        for name in ("jax", "jaxlib", "jax._src.xla_bridge"):
            logging.getLogger(name).setLevel(logging.WARNING)
    _quiet_third_party(bool(getattr(args, "verbose", False)))
    if progress.showing() or getattr(args, "quiet", False):
        logger = logging.getLogger("jaxinfer")
        if not any(isinstance(f, _NotProgress) for f in logger.filters):
            logger.addFilter(_NotProgress())


def run_serve(args: argparse.Namespace) -> int:
    """Bind the ports, answer health as loading while the model loads, then serve until SIGTERM/SIGINT.

    The listeners come up before anything slow (JAX, the model, the compiles): gRPC health says
    NOT_SERVING and HTTP ``/health`` 503 ``{"status": "loading", "stage": ...}`` until the model is
    ready, then SERVING and 200. Returns the exit status; a signal while loading raises
    KeyboardInterrupt (the CLI's exit 130, without waiting for the load).
    """
    _configure_logging(args)
    log = logging.getLogger("jaxinfer.server")
    try:
        config = server_config_from_args(args)  # checked before the (slow) model load
        for path in (args.tls_cert, args.tls_key):
            if path is not None:
                open(path, "rb").close()
    except (ValueError, OSError) as e:
        return _err(str(e), 2)
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):  # one of several processes: process 0 serves, the rest follow
        from jaxinfer.engine import distributed

        if distributed.is_multiprocess() and not distributed.is_leader():
            return _follow(args)
    # grpc, fastapi and uvicorn are imported before the ports are bound, so that they answer as soon as they are
    from jaxinfer.server.server import StoppedWhileLoading, serve

    try:  # before anything slow (JAX, the model): a busy port fails in a second
        http_socket = bind_ports(config)
    except OSError as e:
        return _err(f"cannot serve on {config.host}: {e.strerror or e} (a port given by --port, --http-port or "
                    "--metrics-port is in use or not allowed; choose another, or 0 for a free one)", 2)
    if config.host not in ("127.0.0.1", "localhost", "::1") and not (config.tls_cert and config.auth_token):
        log.warning("binding %s without %s: anyone who can reach this address can use the model",
                    config.host, "TLS and a token" if not config.tls_cert and not config.auth_token
                    else "TLS" if not config.tls_cert else "a token")

    loaded: list = []  # the LLM, once built (closed at the end)
    load_failed: list = []  # the load's own exception (told apart from the listeners')

    def load():
        try:
            loaded.append(_load_llm(args))
        except BaseException as e:
            load_failed.append(e)
            raise
        return loaded[0]

    def ready(server) -> None:
        llm = server.llm
        e = llm.engine_config
        security = ("TLS" if config.tls_cert else "plaintext") + (", token auth" if config.auth_token else "")
        kv = llm.engine.kv
        role = ""
        if kv is not None and kv.role == "prefill":
            config.disaggregation_bootstrap_port = kv.bootstrap_port  # the bound one (--disaggregation-bootstrap-port 0)
            role = f"; prefill role, KV bootstrap on port {kv.bootstrap_port}"
        elif kv is not None:
            role = "; decode role"

        print(
            f"jaxinfer: serving {llm.model_name} on {server.address} ({security}; max_model_len "
            f"{llm.max_model_len}, {e.num_pages - 1} KV pages x {e.page_size}, max_num_seqs {e.max_num_seqs}, "
            f"backend {llm.info()['backend']}"
            + (f"; metrics at {server.metrics_url}" if server.metrics_url else "")
            + (f"; OpenAI-compatible API at {server.http_url}/v1 as {config.served_model_name or llm.model_name!r}"
               if server.http_url else "") + role + ") - ready",
            flush=True,
        )

    try:
        serve(None, config, ready=ready, http_socket=http_socket, load=load)
    except StoppedWhileLoading:
        sys.stderr.write("jaxinfer: stopped while loading the model\n")
        sys.stderr.flush()
        raise KeyboardInterrupt from None
    except ValueError as e:  # a flag the engine refuses, or a model that cannot be loaded
        return _err(str(e), 2)
    except OSError as e:
        if load_failed:  # the model's files, not the server's ports
            raise
        return _err(f"could not serve on {config.address}: {e}", 1)
    finally:
        if http_socket is not None:
            http_socket.close()  # no-op once the HTTP server has closed it
        for llm in loaded:
            llm.close()
    print("jaxinfer: server stopped", flush=True)
    return 0


def _load_llm(args: argparse.Namespace):
    """The engine flags checked, then the model loaded (and warmed up): serve's start-up stages."""
    check_engine_flags(args)
    # importing the engine (JAX) takes seconds on a cold start: a stage of its own, so /health names it
    with progress.stage("loading the engine") if "jaxinfer.llm" not in sys.modules else contextlib.nullcontext():
        enable_compilation_cache()
        from jaxinfer.llm import LLM
    return LLM(**llm_kwargs(args), scheduling_policy=args.scheduling_policy,
               log_stats_interval=args.log_stats_interval or None, warmup=args.warmup,
               kv_transfer_config=kv_transfer_config(args))


def _follow(args: argparse.Namespace) -> int:
    """A follower process of a multi-process run: load the model and run process 0's steps (no listeners)."""
    from jaxinfer.engine import distributed

    try:
        llm = _load_llm(args)
    except ValueError as e:
        return _err(str(e), 2)
    try:
        distributed.run_as_follower(llm)
    finally:
        llm.close()
    return 0


# --------------------------------------------------------------------------- #
# jaxinfer generate --server
# --------------------------------------------------------------------------- #



def server_error_message(address: str, e) -> str:
    """What a failed call to the server at `address` means, in one line (UNAVAILABLE: nothing answered there)."""
    import grpc  # lazy: see the module docstring

    if e.code == grpc.StatusCode.UNAVAILABLE and not _server_said_it(e.details):
        return f"no server answered at {address}: {e.details}"
    if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the server at {address} did not answer in time: {e.details}"
    return f"the server at {address} answered {e.code.name}: {e.details}"


def _server_said_it(details: str) -> bool:
    """UNAVAILABLE from our own server (shutting down) rather than from the channel (no connection)."""
    return "shutting down" in details or "the server was stopped" in details or "shut down" in details


def server_summary(final) -> dict:
    """A finished request's server timings and usage as the keys of `RequestMetrics.summary`."""
    usage = final.usage or {}
    return dict(final.timings or {}, prompt_tokens=usage.get("prompt_tokens", 0),
                cached_tokens=usage.get("cached_tokens", 0), output_tokens=usage.get("completion_tokens", 0))


def generate_via_server(args: argparse.Namespace) -> int:
    """``jaxinfer generate --server HOST:PORT PROMPT``: the output of local generate, made by a server.

    The same checks, sampling defaults, chat decision, max_tokens fitting and
    output as local generate (`jaxinfer.cli.flags`), with the server's model.
    """
    from jaxinfer.metrics import format_trace
    from jaxinfer.server.config import read_auth_token
    from jaxinfer.server.client import Client, Completion, InvalidArgument, ServerError

    try:
        refuse_local_flags(args)
        prompt, overrides = check_generate_args(args)
        token = read_auth_token(getattr(args, "auth_token_file", None))
    except (ValueError, OSError) as e:
        return _err(str(e), 2)

    timeout = getattr(args, "timeout", None)
    client = Client(args.server, token=token, tls_ca=getattr(args, "tls_ca", None))
    out = sys.stdout
    try:
        info = client.model_info(timeout=timeout or 30.0)
        # the model's defaults (the server applies them) under the CLI's under the flags, as locally
        model_defaults = info.get("generation_defaults") or {}  # None from a server that does not report them
        kw = generate_sampling(overrides, model_defaults.get("temperature"))
        chat = chat_mode(args, info["has_chat_template"], f"the server's model {info['name']!r}")
        messages = chat_messages(prompt, getattr(args, "system", None)) if chat else None
        max_tokens = kw.pop("max_tokens")
        if getattr(args, "max_tokens", None) is None and info["has_tokenizer"]:
            # the default shrinks to fit the context, as the processor's fit_max_tokens does locally
            room = info["max_model_len"] - client.tokenize(
                messages if chat else prompt, chat_template_kwargs=getattr(args, "chat_template_kwargs", None))["count"]
            if room > 0:
                max_tokens = min(max_tokens, room)
        final = None
        printed = False
        pieces = client.generate(messages if chat else prompt, max_tokens=max_tokens, timeout=timeout,
                                 chat_template_kwargs=getattr(args, "chat_template_kwargs", None), **kw)
        try:
            for piece in pieces:
                final = final or Completion(piece.request_id)
                final.add(piece)
                if piece.text and not args.json:
                    out.write(piece.text)
                    out.flush()
                    printed = True
        except KeyboardInterrupt:
            pieces.close()  # cancels the call: the server aborts the request
            if printed:
                out.write("\n")
            raise
    except (UsageError, InvalidArgument) as e:
        return _err(e.details if isinstance(e, InvalidArgument) else str(e), 2)
    except ServerError as e:
        return _err(server_error_message(args.server, e), 1)
    finally:
        client.close()

    if args.json:
        tt = final.token_text
        result = generate_result(
            info["name"], chat, prompt, server=args.server, token_ids=final.token_ids, text=final.text,
            finish_reason=final.finish_reason, stop_reason=final.stop_reason, usage=final.usage,
            timings=server_summary(final), logprobs=(final.logprobs or []) if kw.get("logprobs") is not None else None,
            token_text=lambda i: tt.get(i) or None,
            **({"error": final.error} if final.error else {}),
        )
        out.write(json.dumps(result, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
        if kw.get("logprobs") is not None and final is not None:  # the same table as local generate's
            tt = final.token_text
            print_logprobs(lambda i: tt.get(i) or None, final.logprobs or [])
    out.flush()
    if getattr(args, "trace", False) and final is not None and final.timings:
        sys.stderr.write(format_trace(server_summary(final), where="server side") + "\n")
    if final is not None and final.finish_reason == "error":  # as local generate: the reason, status 1
        return _err(final.error or "the request failed on the server", 1)
    if final is not None and final.finish_reason == "length":  # as local generate: a line, and status 3 when
        flag = constraint_flag(args)                             # a constrained output is incomplete
        incomplete = flag is not None and not _constraint_met(args, final.text)
        prompt_tokens = int((final.usage or {}).get("prompt_tokens", 0))
        sys.stderr.write(length_notice(len(final.token_ids), prompt_tokens, info["max_model_len"],
                                       flag if incomplete else None, getattr(args, "max_tokens", None)) + "\n")
        return EXIT_INCOMPLETE if incomplete else 0
    return 0


def _constraint_met(args: argparse.Namespace, text: str) -> bool:
    """Whether a constrained output cut by the limit is nonetheless whole (the server does not say whether the
    grammar reached an end, so it is checked here): JSON that parses, a choice, a full regex match; a grammar's
    output counts as incomplete."""
    if args.json_schema is not None or args.json_object:
        try:
            json.loads(text)
            return True
        except ValueError:
            return False
    if args.choice:
        return text in args.choice
    if args.regex:
        return re.fullmatch(args.regex, text) is not None
    return False


def main(argv: Optional[list] = None) -> int:
    """``python -m jaxinfer.cli.serve [serve flags]``: the server without the main CLI (development)."""
    p = argparse.ArgumentParser(prog="python -m jaxinfer.cli.serve", description="Serve a model over gRPC.")
    add_serve_arguments(p)
    return run_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
