"""The ``jaxinfer`` command: generate (streamed), chat, tokenize, serve, warmup, convert and bench from a terminal.

    jaxinfer generate "Why is the sky blue?" --max-tokens 64 --temperature 0
    jaxinfer chat                                   # a conversation; /help lists its commands
    echo "Explain paged attention" | jaxinfer generate - --json
    jaxinfer serve --port 50051 & jaxinfer generate --server localhost:50051 "Hi"   # the same output
    jaxinfer generate "A colour:" --choice red --choice "green, dark" --temperature 1
    jaxinfer generate "A user as JSON:" --json-schema user.schema.json
    jaxinfer tokenize --chat "Hello"
    jaxinfer convert model.gguf ./converted && jaxinfer generate "Hi" --model ./converted
    jaxinfer bench --num-prompts 64 --input-len 128 --output-len 32 --request-rate 8

The flag groups (model, engine, sampling, prompt format, output, server,
progress) are defined once in `jaxinfer.cli.flags` and shared by every
command, with the same defaults whichever path runs. Bad input (a flag out of
range, an empty prompt, an unknown model, a prompt longer than the context)
exits with status 2 and one line on stderr, ``jaxinfer: error: <message>``.
Sampling and engine flags are checked before the model is loaded, so they
fail at once, and so do a structured-output schema, regex or grammar that does
not parse. A request that ends with finish_reason "error" (its grammar allowed
no token) keeps the text it made, and exits with status 1 and the reason on
stderr. A request that ends at the length limit (--max-tokens, or the end of the
context) says so in one line on stderr; when its output was constrained
(--json-schema, --json-object, --regex, --choice, --grammar) that output is
incomplete, and the status is 3. Ctrl-C exits with status 130.

Imports: ``jaxinfer --help``, a usage error and the first progress line come before
anything slow is imported, so the engine and the loaders (`jaxinfer.llm`,
`jaxinfer.engine`, `jaxinfer.loading`, `jaxinfer.ops`: JAX) and bench's command
(`jaxinfer.cli.bench`: the tools and numpy) are imported inside the command that
needs them (check: ``python -X importtime -c "import jaxinfer.cli.main"`` lists no
jax, grpc or numpy).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Optional, Sequence

from jaxinfer import progress
from jaxinfer._version import __version__
from jaxinfer.cli.argtypes import DTYPE_CHOICES
from jaxinfer.cli.flags import (
    CLI_TEMPERATURE,
    EXIT_INCOMPLETE,
    CLI_TOP_P,
    DEFAULT_MAX_TOKENS,
    UsageError,
    add_client_flags,
    constraint_flag,
    length_notice,
    add_engine_flags,
    add_model_flags,
    add_output_flags,
    add_progress_flags,
    add_prompt_format_flags,
    add_sampling_flags,
    any_int,
    chat_messages,
    chat_mode,
    check_engine_flags,
    check_generate_args,
    cli_sampling_defaults,
    configure_progress,
    generate_result,
    generate_sampling,
    load_llm,
    model_name,
    number,
    one_line,
    positive_int,
    print_logprobs,
    read_prompt,
)
from jaxinfer.cli.interrupt import PiecePump, StopOnInterrupt
from jaxinfer.cli.serve import add_serve_arguments, generate_via_server, run_serve
from jaxinfer.engine.compile_cache import enable_compilation_cache

_T_START = time.perf_counter()  # ~ the process start, for the "ready in" line

# generate's defaults are re-exported from here for scripts and tests that import them from the CLI
__all__ = ["main", "build_parser", "one_line", "UsageError", "CLI_TEMPERATURE", "CLI_TOP_P", "DEFAULT_MAX_TOKENS",
           "cli_sampling_defaults"]

PROG = "jaxinfer"
EXIT_USAGE = 2
EXIT_REQUEST_FAILED = 1  # the request ended with finish_reason "error" (e.g. its structured output failed)
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports it


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line: ``jaxinfer: error: ... (see '... --help')``.

    An unknown flag after a command names that command's help (``jaxinfer generate --help``),
    not the top level's: argparse hands unknown arguments up to the top parser, which reports them.
    """

    commands: dict = {}  # command name -> its parser (set on the top-level parser)

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(f"{one_line(message)} (see '{self.prog} --help')")

    def parse_args(self, args=None, namespace=None):  # noqa: D401 - argparse API
        argv = sys.argv[1:] if args is None else list(args)
        ns, extras = self.parse_known_args(argv, namespace)
        if extras:
            command = getattr(ns, "command", None)
            owner = self
            if command in self.commands and command in argv and extras[0] in argv:
                if argv.index(extras[0]) > argv.index(command):  # given after the command: its flag
                    owner = self.commands[command]
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


# --------------------------------------------------------------------------- #
# Parser
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="An LLM inference engine on JAX: generate text, chat, serve it over gRPC, inspect tokenization "
        "and benchmark serving from a terminal.",
        epilog="Run 'jaxinfer <command> --help' for a command's options. "
        "Caches live in ~/.cache/jaxinfer ($XDG_CACHE_HOME): converted models (JAXINFER_MODEL_CACHE=0 or "
        "--no-model-cache to disable), compiled programs (JAXINFER_COMPILATION_CACHE=0) and the CPU kernel.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser(
        "generate",
        help="generate text for a prompt, streamed as it is produced",
        description="Generate text for PROMPT and stream it to stdout as tokens are produced, with a model loaded "
        "here or, with --server, by a running 'jaxinfer serve' (same flags, same defaults, same output). "
        "Sampling flags that are not given take the model's generation defaults (generation_config.json), else "
        f"temperature {CLI_TEMPERATURE} and top-p {CLI_TOP_P} (what SmolLM2's authors suggest; small models ramble "
        "at 1.0). When the output stops at the length limit (--max-tokens, or the end of the context) a line on "
        "stderr says so. Exit status: 0 done; 1 the request failed (a constraint allowed no token; the reason on "
        "stderr); 2 bad usage; 3 a constrained output (--json-schema, --json-object, --regex, --choice, --grammar) "
        "stopped at the length limit, so it is incomplete; 130 interrupted (Ctrl-C).",
    )
    g.add_argument("prompt", metavar="PROMPT", help="the prompt text, or '-' to read it from stdin")
    add_model_flags(g)
    add_sampling_flags(g, structured=True)
    add_prompt_format_flags(g)
    add_output_flags(g)
    add_engine_flags(g)
    add_client_flags(g)
    add_progress_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "chat",
        help="hold a conversation with the model in the terminal",
        description="Chat with the model: each line you type is sent with the conversation so far through the "
        "model's chat template and the answer streams back, with a model loaded here or, with --server, by a "
        "running 'jaxinfer serve'. Commands: /exit (or /quit), /clear (forget the conversation, keep the system "
        "prompt), /system TEXT (set the system prompt; alone: remove it), /help. Ctrl-C stops an answer as it "
        "streams (what was said stays in the conversation); at the prompt it clears the line, and a second "
        "Ctrl-C or Ctrl-D leaves. Without a terminal on stdin each line is answered in turn until the end of "
        "input (printf 'Hi\\nWhat is 2+2?\\n' | jaxinfer chat). Sampling flags and defaults are generate's; "
        f"--max-tokens (default {DEFAULT_MAX_TOKENS}) bounds each answer, and shrinks to the room the context "
        "has left.",
    )
    add_model_flags(c)
    add_sampling_flags(c)
    add_prompt_format_flags(c, chat_flag=False)
    add_engine_flags(c)
    add_client_flags(c, server_help="chat with a running 'jaxinfer serve' instead of loading the model here, "
                     "with the same flags and defaults (model and engine flags are refused: they are the server's)")
    add_progress_flags(c)
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser(
        "tokenize",
        help="show the token ids and token strings of a text",
        description="Tokenize TEXT with the model's tokenizer (no weights are loaded), as generate does.",
    )
    t.add_argument("text", metavar="TEXT", help="the text, or '-' to read it from stdin")
    add_model_flags(t)
    add_prompt_format_flags(t, chat_default=False, what="TEXT")
    add_output_flags(t, json_help="print one JSON object: token_ids, tokens, count", trace=False)
    t.set_defaults(func=cmd_tokenize)

    sv = sub.add_parser(
        "serve",
        help="serve the model over gRPC (streaming)",
        description="Serve a model over gRPC: Generate (streamed), Tokenize, GetModelInfo, health, reflection. "
        "Binds 127.0.0.1 unless --host says otherwise. Model and engine flags are generate's.",
    )
    add_serve_arguments(sv)  # the model and engine groups, and the network's own flags
    add_progress_flags(sv)
    sv.set_defaults(func=cmd_serve)

    wu = sub.add_parser(
        "warmup",
        help="compile every program the engine can run into the program cache, or list them",
        description="Load the model and compile (or load from the program cache) every XLA program the engine can "
        "run with this engine configuration: one per padded shape (batch rows x prefill chunk, batch rows for "
        "decode); sampling settings, logprobs and context lengths are data and add none. Later starts (generate, "
        "serve, bench) with the same model and engine flags then load them from ~/.cache/jaxinfer/programs in a "
        "fraction of a second each. With --list, print the list and each program's state instead.",
    )
    wu.add_argument("--list", action="store_true",
                    help="print the program list (ready / cached on disk / to compile) and compile nothing")
    add_model_flags(wu)
    add_engine_flags(wu)
    add_progress_flags(wu)
    wu.set_defaults(func=cmd_warmup)

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
    add_progress_flags(cv)
    cv.set_defaults(func=cmd_convert)

    b = sub.add_parser(
        "bench",
        help="measure serving throughput and latency under a synthetic or dataset load",
        description="Send many requests to the engine, paced by a request rate and capped by a concurrency "
        "limit, and report request and token throughput with the mean, median, p90 and p99 of time to "
        "first token (TTFT), time per output token (TPOT), inter-token latency (ITL) and end-to-end latency, "
        "as vLLM's 'bench serve' does. Prompts are random token ids of the given lengths, or the prompts of "
        "--dataset; every request produces exactly its output length (end-of-sequence is ignored). Model and "
        "engine flags are generate's.",
    )
    add_model_flags(b)
    w = b.add_argument_group(
        "workload", "bench samples by its own rules: greedy unless --temperature says otherwise, and --seed also "
        "seeds the prompts, lengths and arrivals, so a run repeats exactly.")
    w.add_argument("--num-prompts", type=positive_int, metavar="N",
                   help="how many requests to measure (default: 100, or every prompt of --dataset)")
    w.add_argument("--input-len", type=positive_int, metavar="N", help="prompt length in tokens (default: 128)")
    w.add_argument("--output-len", type=positive_int, metavar="N", help="output length in tokens (default: 64)")
    w.add_argument("--input-len-range", metavar="LO:HI",
                   help="random prompt lengths, uniform in [LO, HI] (instead of --input-len)")
    w.add_argument("--output-len-range", metavar="LO:HI",
                   help="random output lengths, uniform in [LO, HI] (instead of --output-len)")
    w.add_argument("--dataset", metavar="FILE",
                   help='a JSON list of prompts: strings, or {"prompt": TEXT, "output_len": N} objects '
                   "(an entry without output_len gets --output-len)")
    w.add_argument("--temperature", type=number, default=0.0, metavar="T", help="sampling temperature (default: 0)")
    w.add_argument("--seed", type=any_int, default=0, metavar="N",
                   help="seed for prompts, lengths, arrivals and sampling (request i samples with seed N+i; "
                   "default: 0)")
    a = b.add_argument_group("load")
    a.add_argument("--request-rate", type=number, default=float("inf"), metavar="R",
                   help="requests per second, sent as a Poisson process; inf sends all at once (default: inf)")
    a.add_argument("--burstiness", type=number, default=1.0, metavar="X",
                   help="shape of the gamma-distributed gaps between arrivals: 1 is Poisson, below 1 burstier, "
                   "above 1 more regular (default: 1)")
    a.add_argument("--max-concurrency", type=positive_int, metavar="C",
                   help="at most C requests in flight at once (default: no limit)")
    a.add_argument("--warmup-requests", type=any_int, default=0, metavar="K",
                   help="send K unmeasured requests first (default: 0)")
    add_engine_flags(b, warmup="before the run, so no measured request waits for a compile (default: on; "
                     "--no-warmup measures the first requests' compiles too)")
    o = b.add_argument_group("output")
    o.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="write every figure (and each request's) as JSON to FILE; with no FILE, print the "
                   "JSON to stdout instead of the table")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_client_flags(b, timeout=False,
                     server_help="benchmark a running 'jaxinfer serve' over gRPC instead of a model loaded here; "
                     "latencies are timed on the client as the streamed messages arrive, the server's own timings "
                     "are reported beside them (model and engine flags are refused: they are the server's)")
    h = b.add_argument_group(
        "OpenAI-compatible server", "benchmark any OpenAI-compatible HTTP server (jaxinfer serve --http-port, "
        "vLLM, llama.cpp's server...) with the same prompts, arrivals and report; --model names the served model "
        "(default: the first of its /v1/models) and engine flags are refused")
    h.add_argument("--base-url", metavar="URL",
                   help="the server's address, http://HOST:PORT (a trailing /v1 is allowed); requests stream "
                   "--endpoint with stream_options.include_usage and ignore_eos")
    h.add_argument("--endpoint", choices=("/v1/completions", "/v1/chat/completions"),
                   help="where requests go (default: /v1/completions, the prompt as token ids; the chat endpoint "
                   "takes each prompt as the text of one user message, chat template added by the server)")
    h.add_argument("--api-key", metavar="KEY",
                   help="the bearer key (default: $OPENAI_API_KEY, else --auth-token-file / $JAXINFER_AUTH_TOKEN)")
    h.add_argument("--tokenizer", metavar="MODEL",
                   help="a local copy of the served model's tokenizer (a model name, GGUF file or directory, as "
                   "--model takes): its vocabulary for random prompts and its text where the server takes text "
                   "(default: the server's own: the vocabulary size from /v1/models or, for jaxinfer, "
                   "/detokenize; llama.cpp's server reports it, vLLM does not; its /tokenize and /detokenize)")
    h.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="send prompts as token ids or as their text; auto: token ids unless a probe request shows "
                   "that the server refuses them (default: auto)")
    add_progress_flags(b)
    b.set_defaults(func=cmd_bench)
    parser.commands = dict(sub.choices)
    return parser


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def _write(stream, text: str) -> None:
    stream.write(text)
    stream.flush()


# --------------------------------------------------------------------------- #
# Commands
# --------------------------------------------------------------------------- #


def cmd_generate(args: argparse.Namespace) -> int:
    if getattr(args, "server", None):
        return generate_via_server(args)
    # Everything that can be checked without the model is checked first.
    prompt, overrides = check_generate_args(args)
    check_engine_flags(args)

    llm = load_llm(args)
    from jaxinfer.engine import distributed  # lazy: JAX (see the module docstring)

    if distributed.run_as_follower(llm):  # a multi-process run: process 0 generates and prints
        return 0
    try:
        code = _generate(args, llm, prompt, overrides)
    except (KeyboardInterrupt, BrokenPipeError):
        raise  # the process leaves without teardown (see _stop_early)
    except BaseException:
        llm.close()
        raise
    llm.close()
    return code


def _generate(args: argparse.Namespace, llm, prompt: str, overrides: dict) -> int:
    params = llm.get_default_sampling_params().clone(
        **generate_sampling(overrides, llm.generation_defaults.temperature)
    )
    chat = chat_mode(args, llm.processor.has_chat_template, f"model {llm.model_name!r}")
    messages = chat_messages(prompt, args.system) if chat else None
    # the front door: template, tokenize, check; the default --max-tokens shrinks to fit the context
    req = llm.make_request(None if chat else prompt, params, messages=messages, fit_max_tokens=args.max_tokens is None,
                           chat_template_kwargs=args.chat_template_kwargs)
    # compile (or load) just this request's programs, with progress; that time is not the request's
    t0 = time.perf_counter()
    llm.engine.runner.warmup(llm.engine.request_program_keys(len(req.prompt_ids), req.max_tokens), complete=False)
    req.metrics.arrival_time += time.perf_counter() - t0
    progress.ready(_T_START)
    stream = llm.submit(req)

    out = sys.stdout
    final = None
    printed = False
    with StopOnInterrupt() as interrupt:
        pump = PiecePump(stream)  # read on its own thread: a Ctrl-C is seen at once, even during the prefill
        try:
            for d in pump.pieces(interrupt):  # none after a Ctrl-C
                if d.text and not args.json:
                    _write(out, d.text)
                    printed = True
                if d.output is not None:
                    final = d.output
        finally:
            if not pump.finished:
                stream.abort()  # stopped: the request ends at the engine's next step and frees its KV pages
            pump.close()
    if interrupt.requested:
        if printed:
            _write(out, "\n")
        raise KeyboardInterrupt

    error = getattr(final.outputs[0], "error", None) if final is not None else None
    if args.json:
        comp, tok = final.outputs[0], llm.tokenizer
        result = generate_result(
            llm.model_name, chat, prompt, token_ids=comp.token_ids, text=comp.text,
            finish_reason=comp.finish_reason, stop_reason=comp.stop_reason, usage=final.usage,
            timings=final.metrics.summary(), logprobs=(comp.logprobs or []) if params.logprobs is not None else None,
            token_text=lambda i: tok.decode([i], skip_special_tokens=False) if tok is not None else None,
            **({"error": error} if error else {}),
        )
        _write(out, json.dumps(result, ensure_ascii=False) + "\n")
    else:
        _write(out, "\n")
        if params.logprobs is not None and final is not None:  # the table after the text, on stderr
            tok = llm.tokenizer
            print_logprobs(lambda i: tok.decode([i], skip_special_tokens=False) if tok is not None else None,
                           final.outputs[0].logprobs or [])
    if args.trace and final is not None:
        _write(sys.stderr, final.metrics.trace() + "\n")
    if final is not None and final.outputs[0].finish_reason == "error":
        return _fail(error or "the request failed", EXIT_REQUEST_FAILED)
    if final is not None and final.outputs[0].finish_reason == "length":
        return _stopped_at_limit(args, req, llm.max_model_len)
    return 0




def _stopped_at_limit(args: argparse.Namespace, req, max_model_len: int) -> int:
    """A request that ended by length: one line on stderr; status 3 when a constraint's output is thereby
    incomplete (its grammar had not reached an end; an output complete at the very last token is not)."""
    flag = constraint_flag(args)
    constraint = getattr(req, "constraint", None)
    incomplete = flag is not None and not (constraint is not None and constraint.complete)
    _write(sys.stderr, length_notice(req.max_tokens, len(req.prompt_ids), max_model_len,
                                     flag if incomplete else None, getattr(args, "max_tokens", None)) + "\n")
    return EXIT_INCOMPLETE if incomplete else 0


def cmd_chat(args: argparse.Namespace) -> int:
    from jaxinfer.cli import repl  # here: generate and serve never import the chat loop

    return repl.run(args, t_start=_T_START)


def cmd_tokenize(args: argparse.Namespace) -> int:
    from jaxinfer.engine.processor import InputProcessor  # lazy, as the next two: see the module docstring
    from jaxinfer.loading import model_cache
    from jaxinfer.loading.weights import resolve_model

    text = read_prompt(args.text, "text")
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat.")
    if args.chat_template_kwargs and not args.chat:
        raise UsageError("--chat-template-kwargs needs --chat.")
    # the model cache's tokenizer when the model was loaded before, else the source's (no weights either way)
    name = model_name(args)
    processor = InputProcessor(model_cache.load_tokenizer(resolve_model(name), use_cache=not args.no_model_cache))
    if args.chat and not processor.has_chat_template:
        raise UsageError(f"the tokenizer of {name!r} has no chat template; drop --chat.")
    # what generate sends the model: the same rendering and tokenizing code, with no context to fit
    if args.chat:
        ids = processor.tokenize(messages=chat_messages(text, args.system), fit_context=False,
                                 chat_template_kwargs=args.chat_template_kwargs).ids
    else:
        ids = processor.tokenize(text, fit_context=False).ids
    tokens = processor.tokenizer.convert_ids_to_tokens(ids)
    if args.json:
        result = {"token_ids": ids, "tokens": tokens, "count": len(ids)}
        _write(sys.stdout, json.dumps(result, ensure_ascii=False) + "\n")
    else:
        width = max((len(str(i)) for i in ids), default=1)
        lines = [f"{i:>{width}}  {t!r}" for i, t in zip(ids, tokens)]
        lines.append(f"{len(ids)} tokens")
        _write(sys.stdout, "\n".join(lines) + "\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    return run_serve(args)


def cmd_warmup(args: argparse.Namespace) -> int:
    check_engine_flags(args)
    llm = load_llm(args)
    try:
        table = llm.engine.runner.programs
        keys = llm.engine.program_keys()
        attention = "CPU kernel" if table.kernels.cpu_attention else "pure JAX"
        if args.list:
            verify = sum(1 for k in keys if k.logits != k.batch)
            spec = (f", {verify} of them speculative decoding's verify programs (logits rows per draft token)"
                    if verify else "")
            lines = [f"{len(keys)} programs for {llm.model_name} ({llm.engine_config.name} preset, "
                     f"{llm.engine_config.dtype}, attention: {attention}){spec}; cache: {table.cache_dir() or 'off'}"]
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
    from jaxinfer.loading import model_cache  # lazy, as the next two: see the module docstring
    from jaxinfer.loading.weights import resolve_model
    from jaxinfer.ops.backend import engine_preset, resolve_dtype

    dtype = resolve_dtype(args.dtype or engine_preset().dtype)
    source = resolve_model(args.src)
    try:
        dst = model_cache.convert(source, args.dst, dtype, overwrite=args.force)
    except FileExistsError as e:  # checked before anything is converted: bad usage, not a failure
        raise UsageError(str(e)) from None
    _write(sys.stdout, f"{dst}\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    enable_compilation_cache()
    from jaxinfer.cli.bench import bench_command  # lazy: see the module docstring

    return bench_command(args, t_start=_T_START)


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
        if hasattr(args, "quiet"):  # the commands with the progress flags
            configure_progress(args)
        if os.environ.get("JAX_COORDINATOR_ADDRESS"):  # one of several processes (jaxinfer.engine.distributed)
            from jaxinfer.engine import distributed  # lazy: JAX (see the module docstring)

            distributed.initialize()
        return args.func(args)
    except ValueError as e:  # UsageError; SamplingParams / EngineConfig / LLM validation, ModelNotFoundError
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
