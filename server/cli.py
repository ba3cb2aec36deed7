"""Command-line pieces for the server: ``jaxinfer serve`` and ``jaxinfer generate --server``.

Wired into ``jaxinfer/cli.py``:

    s = sub.add_parser("serve", ...); add_serve_arguments(s); s.set_defaults(func=run_serve)
    add_server_client_arguments(generate_parser)   # --server, --auth-token-file, --tls-ca, --timeout
    # in cmd_generate: if args.server: return generate_via_server(args)

Both functions return an exit status: 0, 1 (the server failed or is unreachable)
or 2 (bad input, reported as one ``jaxinfer: error: ...`` line).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional

from jaxinfer.argtypes import DTYPE_CHOICES, DTYPE_HELP, int_in, non_negative_number

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MAX_TOKENS = 256  # as local generate
_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logprobs")


_positive_int = int_in(1)
_nonnegative_int = int_in(0)
_port = int_in(0, 65535)
_seconds = non_negative_number


def _err(message: str, code: int) -> int:
    sys.stderr.write(f"jaxinfer: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    return code


# --------------------------------------------------------------------------- #
# jaxinfer serve
# --------------------------------------------------------------------------- #


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from jaxinfer.cli import _add_model_args

    _add_model_args(p)  # --model, --no-model-cache: as for generate
    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, loopback only; 0.0.0.0 for every interface)")
    n.add_argument("--port", type=_port, default=50051, help="port to bind (default: 50051; 0 picks a free one)")
    n.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve TLS (needs --tls-key)")
    n.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    n.add_argument("--auth-token-file", metavar="FILE",
                   help="require 'authorization: Bearer <token>' with the token in FILE "
                   "(default: $JAXINFER_AUTH_TOKEN if set; health checks stay open)")
    n.add_argument("--max-message-size", type=_positive_int, default=16 * 1024 * 1024, metavar="BYTES",
                   help="largest request or response message (default: 16 MiB)")
    n.add_argument("--max-waiting", type=_nonnegative_int, metavar="N",
                   help="admission control: refuse new requests (RESOURCE_EXHAUSTED) when N are already waiting "
                   "beyond the engine's batch (default: unbounded)")
    n.add_argument("--grace-period", type=_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, let running requests finish for this long, then abort them (default: 30)")
    n.add_argument("--no-reflection", action="store_true", help="do not serve gRPC server reflection")
    n.add_argument("--metrics-port", type=_port, metavar="PORT",
                   help="serve Prometheus metrics (text exposition) at http://HOST:PORT/metrics, on the same host "
                   "as the server (default: off)")
    e = p.add_argument_group("engine")
    add_engine_arguments(e)
    e.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    e.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs, or priority (a request's priority field; lower runs first)")
    e.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every program before accepting requests (default: on; --no-warmup accepts "
                   "requests at once and compiles each program when a request first needs it)")
    e.add_argument("--log-stats-interval", type=_seconds, default=10.0, metavar="SECONDS",
                   help="log the engine's throughput / running / waiting / KV line this often while busy "
                   "(default: 10; 0 disables)")


def add_engine_arguments(e) -> None:
    """The engine's sizes (a preset and overrides): what decides the program list (serve, warmup)."""
    e.add_argument("--engine-config", metavar="NAME",
                   help="engine preset: cpu, gpu or tpu (default: the one for JAX's backend)")
    e.add_argument("--max-model-len", type=_positive_int, metavar="N", help="cap the context length, in tokens")
    e.add_argument("--dtype", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    e.add_argument("--max-num-seqs", type=_positive_int, metavar="N", help="most requests decoded together")
    e.add_argument("--num-pages", type=_positive_int, metavar="N", help="KV cache pages (page 0 is reserved)")
    e.add_argument("--max-num-batched-tokens", type=_positive_int, metavar="N", help="token budget of one step")


def server_config_from_args(args: argparse.Namespace):
    from jaxinfer.server.service import ServerConfig, read_auth_token

    return ServerConfig(
        host=args.host, port=args.port, max_waiting=args.max_waiting, grace_period=args.grace_period,
        tls_cert=args.tls_cert, tls_key=args.tls_key, auth_token=read_auth_token(args.auth_token_file),
        max_message_bytes=args.max_message_size, reflection=not args.no_reflection,
        metrics_port=getattr(args, "metrics_port", None),
    )


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
    import os

    from jaxinfer import progress

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not os.environ.get("JAX_LOGGING_LEVEL"):  # JAX's own setting wins when given
        # e.g. "Unable to initialize backend 'tpu'" from jax._src.xla_bridge on a CPU machine
        for name in ("jax", "jaxlib", "jax._src.xla_bridge"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if progress.showing() or getattr(args, "quiet", False):
        logger = logging.getLogger("jaxinfer")
        if not any(isinstance(f, _NotProgress) for f in logger.filters):
            logger.addFilter(_NotProgress())


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the server, serve until SIGTERM/SIGINT; returns the exit status."""
    _configure_logging(args)
    log = logging.getLogger("jaxinfer.server")
    try:
        config = server_config_from_args(args)  # checked before the (slow) model load
        for path in (args.tls_cert, args.tls_key):
            if path is not None:
                open(path, "rb").close()
    except (ValueError, OSError) as e:
        return _err(str(e), 2)
    if config.host not in ("127.0.0.1", "localhost", "::1") and not (config.tls_cert and config.auth_token):
        log.warning("binding %s without %s: anyone who can reach this address can use the model",
                    config.host, "TLS and a token" if not config.tls_cert and not config.auth_token
                    else "TLS" if not config.tls_cert else "a token")

    from jaxinfer.compile_cache import enable_compilation_cache
    from jaxinfer.llm import LLM
    from jaxinfer.server.service import serve

    enable_compilation_cache()
    overrides = {k: getattr(args, k) for k in ("max_num_seqs", "num_pages") if getattr(args, k) is not None}
    try:
        llm = LLM(
            args.model, engine_config=args.engine_config, dtype=args.dtype, max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching, scheduling_policy=args.scheduling_policy,
            log_stats_interval=args.log_stats_interval or None,
            max_num_batched_tokens=args.max_num_batched_tokens, warmup=args.warmup,
            model_cache=not args.no_model_cache, **overrides,
        )
    except ValueError as e:
        return _err(str(e), 2)

    def ready(server) -> None:
        e = llm.engine_config
        security = ("TLS" if config.tls_cert else "plaintext") + (", token auth" if config.auth_token else "")
        print(
            f"jaxinfer: serving {llm.model_name} on {server.address} ({security}; max_model_len "
            f"{llm.max_model_len}, {e.num_pages - 1} KV pages x {e.page_size}, max_num_seqs {e.max_num_seqs}, "
            f"backend {llm.info()['backend']}"
            + (f"; metrics at {server.metrics_url}" if server.metrics_url else "") + ") - ready",
            flush=True,
        )

    try:
        serve(llm, config, ready=ready)
    except OSError as e:
        return _err(f"could not serve on {config.address}: {e}", 1)
    finally:
        llm.close()
    print("jaxinfer: server stopped", flush=True)
    return 0


# --------------------------------------------------------------------------- #
# jaxinfer generate --server
# --------------------------------------------------------------------------- #


def add_server_client_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--server", metavar="HOST:PORT",
                   help="generate on a running 'jaxinfer serve' instead of loading the model here "
                   "(model and engine flags are then the server's)")
    g.add_argument("--auth-token-file", metavar="FILE",
                   help="send the bearer token in FILE (default: $JAXINFER_AUTH_TOKEN if set)")
    g.add_argument("--tls-ca", metavar="FILE", help="connect with TLS, trusting this CA certificate (PEM)")
    g.add_argument("--timeout", type=_seconds, metavar="SECONDS", help="deadline for the whole request")


def _read_prompt(value: str) -> str:
    if value == "-":
        value = sys.stdin.read().rstrip("\r\n")
    if value == "":
        raise ValueError("the prompt is empty: pass some text (or '-' to read it from stdin).")
    return value


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    kw = {}
    for name in _SAMPLING_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if getattr(args, "stop", None):
        kw["stop"] = list(args.stop)
    if getattr(args, "ignore_eos", False):
        kw["ignore_eos"] = True
    return kw


def trace_text(timings: dict, usage: dict) -> str:
    """The request's timeline, in the format of local ``generate --trace``."""

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f} ms"

    t, u = timings, usage
    out_tokens = u.get("completion_tokens", 0)
    cached = u.get("cached_tokens", 0)
    e2e = t.get("e2e_s")
    return "\n".join([
        "── request trace ──",
        f"prompt tokens     {u.get('prompt_tokens', 0)} ({t.get('user_tokens', 0)} user + "
        f"{t.get('template_tokens', 0)} template" + (f", {cached} cached" if cached else "") + ")",
        f"tokenize          {ms(t.get('tokenize_s'))}",
        f"queue wait        {ms(t.get('queue_s'))}",
        f"prefill           {ms(t.get('prefill_s'))} in {t.get('prefill_chunks', 0)} chunk(s)",
        f"time to 1st token {ms(t.get('ttft_s'))}",
        f"decode steps      {t.get('decode_steps', 0)}, mean step {ms(t.get('tpot_s'))} (TPOT)",
        f"inter-token gap   mean {ms(t.get('itl_mean_s'))}, p50 {ms(t.get('itl_p50_s'))}, "
        f"p99 {ms(t.get('itl_p99_s'))}, max {ms(t.get('itl_max_s'))}",
        f"output tokens     {out_tokens}" + (f" ({out_tokens / e2e:.1f} tok/s end to end)" if e2e else ""),
        f"total             {ms(e2e)} (server side)",
    ])


def generate_via_server(args: argparse.Namespace) -> int:
    """``jaxinfer generate --server HOST:PORT PROMPT``: the output of local generate, made by a server."""
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.server.client import Client, InvalidArgument, ServerError
    from jaxinfer.server.service import read_auth_token

    try:
        prompt = _read_prompt(args.prompt)
        kw = _sampling_kwargs(args)
        max_tokens = getattr(args, "max_tokens", None)
        SamplingParams(**kw, max_tokens=max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS)
        system = getattr(args, "system", None)
        chat_flag = getattr(args, "chat", None)
        if system is not None and chat_flag is False:
            raise ValueError("--system needs chat mode; drop --no-chat.")
        token = read_auth_token(getattr(args, "auth_token_file", None))
    except (ValueError, OSError) as e:
        return _err(str(e), 2)

    client = Client(args.server, token=token, tls_ca=getattr(args, "tls_ca", None))
    out = sys.stdout
    try:
        info = client.model_info(timeout=args.timeout or 30.0)
        # the same sampling defaults as local generate: the model's (the server applies them), else the CLI's
        from jaxinfer.cli import cli_sampling_defaults

        model_defaults = info.get("generation_defaults") or {}  # None from a server that does not report them
        kw = {**cli_sampling_defaults(model_defaults.get("temperature")), **kw}
        chat = info["has_chat_template"] if chat_flag is None else chat_flag
        if chat and not info["has_chat_template"]:
            return _err(f"the server's model {info['name']!r} has no chat template; use --no-chat.", 2)
        messages = None
        if chat:
            messages = ([{"role": "system", "content": system}] if system is not None else [])
            messages.append({"role": "user", "content": prompt})
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
            if info["has_tokenizer"]:  # the default shrinks to fit a short context, as locally
                n = client.tokenize(messages if chat else prompt)["count"]
                if 0 < info["max_model_len"] - n < max_tokens:
                    max_tokens = info["max_model_len"] - n
        from jaxinfer.server.client import Completion

        final = None
        printed = False
        pieces = client.generate(messages if chat else prompt, max_tokens=max_tokens, timeout=args.timeout, **kw)
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
    except InvalidArgument as e:
        return _err(e.details, 2)
    except ServerError as e:
        return _err(f"the server at {args.server} answered {e.code.name}: {e.details}", 1)
    finally:
        client.close()

    if args.json:
        result = {
            "model": info["name"], "chat": bool(chat), "prompt": prompt, "server": args.server,
            "prompt_token_count": final.usage["prompt_tokens"], "token_ids": final.token_ids, "text": final.text,
            "finish_reason": final.finish_reason, "stop_reason": final.stop_reason, "usage": final.usage,
            "timings": dict(final.timings, prompt_tokens=final.usage["prompt_tokens"],
                            cached_tokens=final.usage["cached_tokens"],
                            output_tokens=final.usage["completion_tokens"]),
        }
        if kw.get("logprobs") is not None:
            tt = final.token_text
            result["logprobs"] = [
                {"token_id": lp.token_id, "token": tt.get(lp.token_id) or None, "logprob": lp.logprob,
                 "top": [{"token_id": i, "token": tt.get(i) or None, "logprob": v}
                         for i, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]}
                for lp in final.logprobs or ()
            ]
        out.write(json.dumps(result, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
    out.flush()
    if getattr(args, "trace", False) and final is not None and final.timings:
        sys.stderr.write(trace_text(final.timings, final.usage) + "\n")
    return 0


def main(argv: Optional[list] = None) -> int:
    """``python -m jaxinfer.server.cli [serve flags]``: the server without the main CLI (development)."""
    p = argparse.ArgumentParser(prog="python -m jaxinfer.server.cli", description="Serve a model over gRPC.")
    add_serve_arguments(p)
    return run_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
