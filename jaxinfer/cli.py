"""The ``jaxinfer`` command: generate (streamed), tokenize and bench from a terminal.

    jaxinfer generate "Why is the sky blue?" --max-tokens 64 --temperature 0
    echo "Explain paged attention" | jaxinfer generate - --json
    jaxinfer tokenize --chat "Hello"
    jaxinfer convert model.gguf ./converted && jaxinfer generate "Hi" --model ./converted
    jaxinfer bench --num-prompts 64 --input-len 128 --output-len 32 --request-rate 8

Bad input (a flag out of range, an empty prompt, an unknown model, a prompt
longer than the context) exits with status 2 and one line on stderr,
``jaxinfer: error: <message>``. Sampling and engine flags are checked before
the model is loaded, so they fail at once. Ctrl-C exits with status 130.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, Optional, Sequence

from jaxinfer import progress
from jaxinfer._version import __version__
from jaxinfer.argtypes import DTYPE_CHOICES, DTYPE_HELP, int_in, number, unescape
from jaxinfer.compile_cache import enable_compilation_cache

_T_START = time.perf_counter()  # ~ the process start, for the "ready in" line

PROG = "jaxinfer"
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MAX_TOKENS = 256
CLI_TEMPERATURE, CLI_TOP_P = 0.2, 0.9  # when the model gives no generation defaults
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports it

# Sampling flags that map one-to-one onto SamplingParams fields.
_SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
)


def cli_sampling_defaults(model_temperature: Optional[float]) -> dict:
    """What ``generate`` (local and ``--server``) puts over the model's generation defaults.

    A model that ships no temperature gets temperature 0.2 and top-p 0.9
    instead of the library's 1.0 / 1.0; flags given on the command line
    override these in turn.
    """
    return {} if model_temperature is not None else {"temperature": CLI_TEMPERATURE, "top_p": CLI_TOP_P}


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 2."""


def one_line(message: str) -> str:
    """Collapse a multi-line message (bullet lists included) onto one line."""
    parts: list[str] = []
    in_bullets = False
    for raw in str(message).splitlines():
        line = raw.strip()
        if not line:
            continue
        bullet = line.startswith("- ")
        if bullet:
            line = line[2:].strip()
            if parts and in_bullets:
                parts[-1] += ";"
        elif in_bullets and parts and parts[-1][-1] not in ".:;!?":
            parts[-1] += "."
        parts.append(line)
        in_bullets = bullet
    return " ".join(parts)


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line: ``jaxinfer: error: ... (see '... --help')``."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(f"{one_line(message)} (see '{self.prog} --help')")


# --------------------------------------------------------------------------- #
# Argument types
# --------------------------------------------------------------------------- #


_positive_int = int_in(1)
_int = int_in()
_float = number


# --------------------------------------------------------------------------- #
# Parser
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="An LLM inference engine on JAX: generate text, inspect tokenization and benchmark serving "
        "from a terminal.",
        epilog="Run 'jaxinfer <command> --help' for a command's options. "
        "Caches live in ~/.cache/jaxinfer ($XDG_CACHE_HOME): converted models (JAXINFER_MODEL_CACHE=0 or "
        "--no-model-cache to disable), compiled programs (JAXINFER_COMPILATION_CACHE=0) and the CPU kernel.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser(
        "generate",
        help="generate text for a prompt, streamed as it is produced",
        description="Generate text for PROMPT and stream it to stdout as tokens are produced. "
        "Sampling flags that are not given take the model's generation defaults "
        "(generation_config.json), else temperature 0.2 and top-p 0.9 (what SmolLM2's authors suggest; "
        "small models ramble at 1.0).",
    )
    g.add_argument("prompt", metavar="PROMPT", help="the prompt text, or '-' to read it from stdin")
    _add_model_args(g)
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=_int, metavar="N",
                   help=f"most tokens to generate (default: {DEFAULT_MAX_TOKENS}, or what the context has room for)")
    s.add_argument("--temperature", type=_float, metavar="T",
                   help="0 is greedy (default: the model's, else 0.2)")
    s.add_argument("--top-p", type=_float, metavar="P", help="nucleus sampling mass, in (0, 1]")
    s.add_argument("--top-k", type=_int, metavar="K", help="keep the K most likely tokens; 0 disables")
    s.add_argument("--min-p", type=_float, metavar="P", help="drop tokens below P times the top probability")
    s.add_argument("--seed", type=_int, metavar="N", help="seed for reproducible sampling")
    s.add_argument("--stop", action="append", metavar="TEXT", type=unescape,
                   help=r"stop when TEXT is generated (not printed); repeatable; \n, \t, \r and \\ in TEXT "
                   r"stand for a newline, a tab, a carriage return and a backslash")
    s.add_argument("--presence-penalty", type=_float, metavar="X", help="in [-2, 2]")
    s.add_argument("--frequency-penalty", type=_float, metavar="X", help="in [-2, 2]")
    s.add_argument("--repetition-penalty", type=_float, metavar="X", help="in (0, 100]; 1 disables")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    s.add_argument("--logprobs", type=_int, metavar="N",
                   help="report the logprob of each token and the N most likely alternatives")
    c = g.add_argument_group("prompt format")
    c.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap PROMPT in the model's chat template (default: on when the model has one)")
    c.add_argument("--system", metavar="TEXT", help="a system message (chat mode)")
    o = g.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print nothing while generating, then one JSON object with the text, token ids, "
                   "usage and timings")
    o.add_argument("--trace", action="store_true",
                   help="after the text, print the request's timeline (tokenize, prefill, TTFT, decode) to stderr")
    e = g.add_argument_group("engine")
    e.add_argument("--engine-config", metavar="NAME",
                   help="engine preset: cpu, gpu or tpu (default: the one for JAX's backend)")
    e.add_argument("--max-model-len", type=_positive_int, metavar="N",
                   help="cap the context length (prompt + output), in tokens")
    e.add_argument("--dtype", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    from jaxinfer.server.cli import add_engine_arguments, add_serve_arguments, add_server_client_arguments

    add_server_client_arguments(g)  # --server HOST:PORT, --auth-token-file, --tls-ca, --timeout
    _add_progress_args(g)
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser(
        "tokenize",
        help="show the token ids and token strings of a text",
        description="Tokenize TEXT with the model's tokenizer (no weights are loaded).",
    )
    t.add_argument("text", metavar="TEXT", help="the text, or '-' to read it from stdin")
    _add_model_args(t)
    t.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                   help="render TEXT as a user message with the chat template and the generation prompt "
                   "(default: off)")
    t.add_argument("--system", metavar="TEXT", help="a system message (with --chat)")
    t.add_argument("--json", action="store_true", help="print one JSON object: token_ids, tokens, count")
    t.set_defaults(func=cmd_tokenize)

    b = sub.add_parser(
        "bench",
        help="measure serving throughput and latency under a synthetic or dataset load",
        description="Send many requests to the engine, paced by a request rate and capped by a concurrency "
        "limit, and report request and token throughput with the mean, median, p90 and p99 of time to "
        "first token (TTFT), time per output token (TPOT), inter-token latency (ITL) and end-to-end latency, "
        "as vLLM's 'bench serve' does. Prompts are random token ids of the given lengths, or the prompts of "
        "--dataset; every request produces exactly its output length (end-of-sequence is ignored).",
    )
    _add_model_args(b)
    w = b.add_argument_group("workload")
    w.add_argument("--num-prompts", type=_positive_int, metavar="N",
                   help="how many requests to measure (default: 100, or every prompt of --dataset)")
    w.add_argument("--input-len", type=_positive_int, metavar="N", help="prompt length in tokens (default: 128)")
    w.add_argument("--output-len", type=_positive_int, metavar="N", help="output length in tokens (default: 64)")
    w.add_argument("--input-len-range", metavar="LO:HI",
                   help="random prompt lengths, uniform in [LO, HI] (instead of --input-len)")
    w.add_argument("--output-len-range", metavar="LO:HI",
                   help="random output lengths, uniform in [LO, HI] (instead of --output-len)")
    w.add_argument("--dataset", metavar="FILE",
                   help='a JSON list of prompts: strings, or {"prompt": TEXT, "output_len": N} objects '
                   "(an entry without output_len gets --output-len)")
    w.add_argument("--temperature", type=_float, default=0.0, metavar="T", help="sampling temperature (default: 0)")
    w.add_argument("--seed", type=_int, default=0, metavar="N",
                   help="seed for prompts, lengths, arrivals and sampling (default: 0)")
    a = b.add_argument_group("load")
    a.add_argument("--request-rate", type=_float, default=float("inf"), metavar="R",
                   help="requests per second, sent as a Poisson process; inf sends all at once (default: inf)")
    a.add_argument("--burstiness", type=_float, default=1.0, metavar="X",
                   help="shape of the gamma-distributed gaps between arrivals: 1 is Poisson, below 1 burstier, "
                   "above 1 more regular (default: 1)")
    a.add_argument("--max-concurrency", type=_positive_int, metavar="C",
                   help="at most C requests in flight at once (default: no limit)")
    a.add_argument("--warmup-requests", type=_int, default=0, metavar="K",
                   help="send K unmeasured requests first (default: 0)")
    e = b.add_argument_group("engine")
    e.add_argument("--engine-config", metavar="NAME",
                   help="engine preset: cpu, gpu or tpu (default: the one for JAX's backend)")
    e.add_argument("--max-model-len", type=_positive_int, metavar="N",
                   help="cap the context length (prompt + output), in tokens")
    e.add_argument("--dtype", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    e.add_argument("--max-num-seqs", type=_positive_int, metavar="N",
                   help="most requests in the running batch (default: the preset's)")
    e.add_argument("--max-num-batched-tokens", type=_positive_int, metavar="N",
                   help="token budget of one engine step (default: the preset's)")
    e.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    e.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile (or load from the program cache) every program the engine can use before the run, "
                   "so no measured request waits for a compile (default: on; --no-warmup measures the first "
                   "requests' compiles too)")
    o = b.add_argument_group("output")
    o.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="write every figure (and each request's) as JSON to FILE; with no FILE, print the "
                   "JSON to stdout instead of the table")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sv = b.add_argument_group("server")
    sv.add_argument("--server", metavar="HOST:PORT",
                    help="benchmark a running 'jaxinfer serve' over gRPC instead of a model loaded here; latencies "
                    "are timed on the client as the streamed messages arrive, the server's own timings are "
                    "reported beside them (model and engine flags are then the server's)")
    sv.add_argument("--auth-token-file", metavar="FILE",
                    help="with --server: send the bearer token in FILE (default: $JAXINFER_AUTH_TOKEN if set)")
    sv.add_argument("--tls-ca", metavar="FILE", help="with --server: connect with TLS, trusting this CA (PEM)")
    _add_progress_args(b)
    b.set_defaults(func=cmd_bench)

    cv = sub.add_parser(
        "convert",
        help="convert a GGUF file or a Hugging Face directory into the engine's own checkpoint",
        description="Convert SRC (a model name, a .gguf file or a Hugging Face model directory) once into DST: the "
        "parameter tree in the engine's dtype (an orbax checkpoint), the model config, the generation defaults "
        "and the tokenizer (tokenizer.json or tokenizer.model). '--model DST' and jaxinfer.LLM(DST) then load it "
        "without parsing or dequantizing anything. This is what the model cache does on a first load.",
    )
    cv.add_argument("src", metavar="SRC", help="the model to convert")
    cv.add_argument("dst", metavar="DST", help="the directory to write (must not exist, unless --force)")
    cv.add_argument("--dtype", choices=DTYPE_CHOICES,
                    help="the parameters' dtype (default: the engine preset's for JAX's backend; auto: bfloat16 "
                    "where the hardware multiplies it natively, else float32)")
    cv.add_argument("--force", action="store_true", help="replace DST if it exists")
    _add_progress_args(cv)
    cv.set_defaults(func=cmd_convert)

    wu = sub.add_parser(
        "warmup",
        help="compile every program the engine can run into the program cache, or list them",
        description="Load the model and compile (or load from the program cache) every XLA program the engine can "
        "run with this engine configuration: one per padded shape (batch rows x prefill chunk, batch rows for "
        "decode); sampling settings, logprobs and context lengths are data and add none. Later starts (generate, "
        "serve, bench) then load them from ~/.cache/jaxinfer/programs in a fraction of a second each. With --list, "
        "print the list and each program's state instead.",
    )
    _add_model_args(wu)
    wu.add_argument("--list", action="store_true",
                    help="print the program list (ready / cached on disk / to compile) and compile nothing")
    add_engine_arguments(wu.add_argument_group("engine (as for serve)"))
    _add_progress_args(wu)
    wu.set_defaults(func=cmd_warmup)

    sv = sub.add_parser(
        "serve",
        help="serve the model over gRPC (streaming)",
        description="Serve a model over gRPC: Generate (streamed), Tokenize, GetModelInfo, health, reflection. "
        "Binds 127.0.0.1 unless --host says otherwise.",
    )
    add_serve_arguments(sv)
    _add_progress_args(sv)
    sv.set_defaults(func=cmd_serve)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxinfer.server.cli import run_serve

    return run_serve(args)


def _add_progress_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("progress").add_mutually_exclusive_group()
    g.add_argument("--quiet", action="store_true", help="no start-up progress lines on stderr")
    g.add_argument("--verbose", action="store_true",
                   help="start-up progress lines (resolving, converting, restoring, compiling, ready) on stderr even "
                   "when it is not a terminal (default: only on a terminal)")


def configure_progress(args: argparse.Namespace) -> None:
    """Start-up progress on stderr: on a terminal by default, always with --verbose, never with --quiet."""
    from jaxinfer import progress

    if getattr(args, "quiet", False):
        show = False
    elif getattr(args, "verbose", False):
        show = True
    else:
        try:
            show = sys.stderr is not None and sys.stderr.isatty()
        except (OSError, ValueError):  # a closed stderr
            show = False
    progress.configure(show=show)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a model name, a .gguf file, a Hugging Face model directory or a directory written by "
                   f"'jaxinfer convert' (default: {DEFAULT_MODEL})")
    p.add_argument("--no-model-cache", action="store_true",
                   help="convert the model in memory instead of restoring it from (or saving it to) the model cache "
                   "($JAXINFER_MODEL_CACHE, else ~/.cache/jaxinfer/models; JAXINFER_MODEL_CACHE=0 also turns it off)")


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def read_prompt(value: str, what: str = "prompt") -> str:
    """The argument itself, or stdin for '-' (trailing newlines dropped, as ``$(...)`` does)."""
    if value == "-":
        value = sys.stdin.read().rstrip("\r\n")
    if value == "":
        raise UsageError(f"the {what} is empty: pass some text (or '-' to read it from stdin).")
    return value


def _messages(text: str, system: Optional[str]) -> list:
    msgs = []
    if system is not None:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": text})
    return msgs


def _sampling_overrides(args: argparse.Namespace) -> dict:
    """The SamplingParams fields the user gave on the command line."""
    kw: dict[str, Any] = {"max_tokens": args.max_tokens if args.max_tokens is not None else DEFAULT_MAX_TOKENS}
    for name in _SAMPLING_FLAGS:
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    if args.stop:
        kw["stop"] = list(args.stop)
    if args.ignore_eos:
        kw["ignore_eos"] = True
    return kw


class _StopOnInterrupt:
    """While generating, Ctrl-C asks the loop to stop after the current token.

    Raising KeyboardInterrupt inside a JAX call can leave the runtime's threads
    in a state that aborts the process at exit; a flag checked between tokens
    ends the request cleanly instead. A second Ctrl-C interrupts at once.
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_StopOnInterrupt":
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _write(stream, text: str) -> None:
    stream.write(text)
    stream.flush()


# --------------------------------------------------------------------------- #
# Commands
# --------------------------------------------------------------------------- #


def cmd_generate(args: argparse.Namespace) -> int:
    if getattr(args, "server", None):
        from jaxinfer.server.cli import generate_via_server

        return generate_via_server(args)
    from jaxinfer.config import EngineConfig
    from jaxinfer.sampling_params import SamplingParams

    # Everything that can be checked without the model is checked first.
    prompt = read_prompt(args.prompt)
    overrides = _sampling_overrides(args)
    SamplingParams(**overrides)  # raises ValueError with vLLM's wording
    if args.system is not None and args.chat is False:
        raise UsageError("--system needs chat mode; drop --no-chat.")
    engine = EngineConfig.preset(args.engine_config) if args.engine_config else None
    (engine or EngineConfig.for_backend()).replace(
        **{k: v for k, v in (("dtype", args.dtype), ("max_model_len", args.max_model_len)) if v is not None}
    )

    enable_compilation_cache()
    from jaxinfer.llm import LLM

    llm = LLM(args.model, engine_config=engine, dtype=args.dtype, max_model_len=args.max_model_len,
              model_cache=not args.no_model_cache)
    params = llm.get_default_sampling_params().clone(**cli_sampling_defaults(llm.generation_defaults.temperature))
    params = params.clone(**overrides)
    tok = llm.tokenizer
    has_template = tok is not None and tok.chat_template is not None
    chat = has_template if args.chat is None else args.chat
    if chat and not has_template:
        raise UsageError(f"model {llm.model_name!r} has no chat template; use --no-chat.")
    if args.system is not None and not chat:
        raise UsageError(f"--system needs chat mode, but model {llm.model_name!r} has no chat template.")

    messages = _messages(prompt, args.system) if chat else None
    n = len(tok.apply_chat_template(messages, tokenize=True) if chat else tok.encode(prompt)) if tok else 0
    if args.max_tokens is None:
        # the default shrinks to fit a short context; an explicit --max-tokens is checked as given
        if 0 < llm.max_model_len - n < params.max_tokens:
            params = params.clone(max_tokens=llm.max_model_len - n)
    if 0 < n < llm.max_model_len:  # compile (or load) just this request's programs, with progress
        llm.engine.runner.programs.warmup(llm.engine.request_program_keys(n, params.max_tokens), complete=False)
    progress.ready(_T_START)
    deltas = llm.stream_chat(messages, params) if chat else llm.stream(prompt, params)

    out = sys.stdout
    final = None
    printed = False
    with _StopOnInterrupt() as interrupt:
        try:
            for d in deltas:
                if d.text and not args.json:
                    _write(out, d.text)
                    printed = True
                if d.output is not None:
                    final = d.output
                if interrupt.requested:
                    break
        finally:
            deltas.close()  # aborts an unfinished request and frees its KV pages
    if interrupt.requested:
        if printed:
            _write(out, "\n")
        raise KeyboardInterrupt

    if args.json:
        _write(out, json.dumps(_json_result(prompt, chat, llm, final, params), ensure_ascii=False) + "\n")
    else:
        _write(out, "\n")
    if args.trace and final is not None:
        _write(sys.stderr, final.metrics.trace() + "\n")
    return 0


def _json_result(prompt: str, chat: bool, llm, final, params) -> dict:
    comp = final.outputs[0]
    result = {
        "model": llm.model_name,
        "chat": chat,
        "prompt": prompt,
        "prompt_token_count": len(final.prompt_token_ids),
        "token_ids": [int(t) for t in comp.token_ids],
        "text": comp.text,
        "finish_reason": comp.finish_reason,
        "stop_reason": comp.stop_reason,
        "usage": final.usage,
        "timings": final.metrics.summary(),
    }
    if params.logprobs is not None:
        result["logprobs"] = [_logprob_entry(llm.tokenizer, lp) for lp in (comp.logprobs or [])]
    return result


def _token_text(tokenizer, token_id: int) -> Optional[str]:
    if tokenizer is None:
        return None
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _logprob_entry(tokenizer, lp) -> dict:
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])
    return {
        "token_id": int(lp.token_id),
        "token": _token_text(tokenizer, int(lp.token_id)),
        "logprob": float(lp.logprob),
        "top": [{"token_id": int(i), "token": _token_text(tokenizer, int(i)), "logprob": float(v)} for i, v in top],
    }


def cmd_tokenize(args: argparse.Namespace) -> int:
    from jaxinfer import model_cache
    from jaxinfer.weights import resolve_model

    text = read_prompt(args.text, "text")
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat.")
    # the model cache's tokenizer when the model was loaded before, else the source's (no weights either way)
    tok = model_cache.load_tokenizer(resolve_model(args.model), use_cache=not args.no_model_cache)
    if args.chat:
        if tok.chat_template is None:
            raise UsageError(f"the tokenizer of {args.model!r} has no chat template; drop --chat.")
        rendered = tok.apply_chat_template(_messages(text, args.system), add_generation_prompt=True)
        ids = tok.encode(rendered, add_special_tokens=False)
    else:
        ids = tok.encode(text)
    tokens = tok.convert_ids_to_tokens(ids)
    if args.json:
        _write(sys.stdout, json.dumps({"token_ids": ids, "tokens": tokens, "count": len(ids)}, ensure_ascii=False) + "\n")
    else:
        width = max((len(str(i)) for i in ids), default=1)
        lines = [f"{i:>{width}}  {t!r}" for i, t in zip(ids, tokens)]
        lines.append(f"{len(ids)} tokens")
        _write(sys.stdout, "\n".join(lines) + "\n")
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    enable_compilation_cache()
    from jaxinfer.llm import LLM

    overrides = {k: getattr(args, k) for k in ("max_num_seqs", "num_pages") if getattr(args, k) is not None}
    llm = LLM(args.model, engine_config=args.engine_config, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, model_cache=not args.no_model_cache, **overrides)
    try:
        table = llm.engine.runner.programs
        keys = llm.engine.program_keys()
        attention = "CPU kernel, full-width page table" if table.full_width else "pure-JAX gather, page buckets"
        if args.list:
            lines = [f"{len(keys)} programs for {llm.model_name} ({llm.engine_config.name} preset, "
                     f"{llm.engine_config.dtype}, attention: {attention}); cache: {table.cache_dir() or 'off'}"]
            lines += [f"  {str(k):44s} {state}" for k, state in table.status(keys)]
            _write(sys.stdout, "\n".join(lines) + "\n")
            return 0
        table.warmup(keys)
        progress.ready(_T_START)
        _write(sys.stdout, f"{len(keys)} programs ready ({table.loaded_from_disk} loaded from the program cache); "
                           f"cache: {table.cache_dir() or 'off'}\n")
        return 0
    finally:
        llm.close()


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxinfer import model_cache
    from jaxinfer.config import EngineConfig, resolve_dtype
    from jaxinfer.weights import resolve_model

    dtype = resolve_dtype(args.dtype or EngineConfig.for_backend().dtype)
    source = resolve_model(args.src)
    dst = model_cache.convert(source, args.dst, dtype, overwrite=args.force)
    _write(sys.stdout, f"{dst}\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.no_model_cache:
        os.environ["JAXINFER_MODEL_CACHE"] = "0"  # the benchmark builds its LLM itself
    enable_compilation_cache()
    from jaxinfer.benchmarks.serving import bench_command

    return bench_command(args)


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    sys.stderr.write(f"{PROG}: error: {one_line(message)}\n")
    sys.stderr.flush()
    return code


def _stop_early(code: int, argv: Optional[Sequence[str]]) -> int:
    """Leave at once after an interrupt or a closed pipe.

    Tearing the interpreter down while a dispatched device step may still be
    running has been seen to abort the process (``terminate called after
    throwing ...``) now and then, so the command-line process exits without
    teardown; called in-process (``main([...])``) it just returns the code.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if argv is None:
        os._exit(code)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        if hasattr(args, "quiet"):  # generate, serve, bench
            configure_progress(args)
        return args.func(args)
    except UsageError as e:
        return _fail(str(e))
    except ValueError as e:  # SamplingParams / EngineConfig / LLM validation, ModelNotFoundError
        return _fail(str(e))
    except KeyboardInterrupt:
        return _stop_early(EXIT_INTERRUPTED, argv)
    except BrokenPipeError:
        # the reader went away (``| head``): stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return _stop_early(EXIT_BROKEN_PIPE, argv)
    except OSError as e:
        return _fail(f"{e.strerror or e}" + (f": {e.filename}" if getattr(e, "filename", None) else ""), 1)


if __name__ == "__main__":
    sys.exit(main())
