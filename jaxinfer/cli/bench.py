"""`jaxinfer bench`: the command's checks and its three targets — the library's engine in this
process, a jaxinfer server over gRPC (--server) and any OpenAI-compatible server (--base-url). The
parser is `jaxinfer.cli.main`'s; the measuring (workloads, backends, the run and its summary) is
`jaxinfer.tools.serving`'s. As in every command module, what loads JAX, grpc, httpx or a model
(the engine, the server's client, the tokenizer) is imported inside the command that needs it, so
`jaxinfer bench --help` and its usage errors come at once.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional

from jaxinfer import progress
from jaxinfer.cli.flags import ENGINE_OVERRIDES, check_engine_flags, llm_kwargs, refuse_local_flags
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tools.harness import write_json
from jaxinfer.tools.serving import (
    BenchConfig,
    CHAT_COMPLETIONS,
    COMPLETIONS,
    GrpcBackend,
    LibraryBackend,
    OpenAIBackend,
    OpenAIServerError,
    auth_headers,
    one_line_error,
    check_workload_fits,
    dataset_workload,
    detokenize_vocab_size,
    format_table,
    http_error_text,
    openai_base_url,
    openai_server_info,
    parse_range,
    read_dataset,
    run_benchmark,
    server_detokenize,
    server_tokenize,
    summarize,
    synthetic_workload,
    warmup_workload,
)


DEFAULT_NUM_PROMPTS = 100
DEFAULT_INPUT_LEN = 128
DEFAULT_OUTPUT_LEN = 64


def _check_args(args) -> tuple:
    """Everything that can be checked without loading the model; returns (input, output) length ranges."""
    if args.dataset is not None and (args.input_len is not None or args.input_len_range is not None):
        raise ValueError("--dataset gives the prompts; drop --input-len / --input-len-range.")
    if args.input_len is not None and args.input_len_range is not None:
        raise ValueError("give --input-len or --input-len-range, not both.")
    if args.output_len is not None and args.output_len_range is not None:
        raise ValueError("give --output-len or --output-len-range, not both.")
    if args.input_len_range is not None:
        in_range = parse_range(args.input_len_range, "--input-len-range")
    else:
        n = args.input_len if args.input_len is not None else DEFAULT_INPUT_LEN
        in_range = (n, n)
    if args.output_len_range is not None:
        out_range = parse_range(args.output_len_range, "--output-len-range")
    else:
        n = args.output_len if args.output_len is not None else DEFAULT_OUTPUT_LEN
        out_range = (n, n)
    if args.dataset is not None and args.output_len_range is not None:
        raise ValueError("--output-len-range is for synthetic prompts; with --dataset use --output-len.")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {args.request_rate}.")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}.")
    if args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests must be at least 0, got {args.warmup_requests}.")
    SamplingParams(temperature=args.temperature)  # vLLM's wording for a bad temperature
    base_url = getattr(args, "base_url", None)
    if base_url is not None and getattr(args, "server", None):
        raise ValueError("give --server HOST:PORT (gRPC) or --base-url URL (HTTP), not both.")
    if base_url is not None:
        openai_base_url(base_url)
        given = [f"--{name.replace('_', '-')}" for name in ("no_model_cache", "engine_config", *ENGINE_OVERRIDES,
                                                            "no_prefix_caching") if getattr(args, name, None)]
        if given:  # --model is allowed: it names the served model
            raise ValueError(f"{', '.join(given)} would configure an engine here; with --base-url the engine is "
                             "the server's.")
    else:
        given = [f for f, v in (("--api-key", getattr(args, "api_key", None)),
                                ("--endpoint", getattr(args, "endpoint", None)),
                                ("--tokenizer", getattr(args, "tokenizer", None)),
                                ("--prompt-format", getattr(args, "prompt_format", "auto") != "auto")) if v]
        if given:
            raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --base-url (an "
                             "OpenAI-compatible server).")
        if getattr(args, "server", None):
            refuse_local_flags(args)  # the model and the engine are the server's
        else:
            check_engine_flags(args)  # as generate, serve and warmup check them
    return in_range, out_range


def _bench_config(args) -> BenchConfig:
    return BenchConfig(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        warmup_requests=args.warmup_requests,
        temperature=args.temperature,
        seed=args.seed,
        progress=not args.no_progress,
    )


def _write_summary(summary: dict, args, out) -> int:
    if args.json == "-":
        out.write(json.dumps(summary) + "\n")
    else:
        out.write(format_table(summary) + "\n")
        if args.json is not None:
            write_json(args.json, summary)
    out.flush()
    return 0 if summary["completed"] else 1


def bench_server_command(args, entries, in_range, out_range, out) -> int:
    """``jaxinfer bench --server HOST:PORT``: the same workload and report, over gRPC."""
    from jaxinfer.server import read_auth_token
    from jaxinfer.server.client import Client, ServerError

    token = read_auth_token(getattr(args, "auth_token_file", None))
    tls_ca = getattr(args, "tls_ca", None)
    try:
        with Client(args.server, token=token, tls_ca=tls_ca, timeout=30.0) as client:
            info = client.model_info()
            if entries is not None:
                if not info["has_tokenizer"]:
                    raise ValueError(f"the server's model {info['name']!r} has no tokenizer, so --dataset prompts "
                                     "cannot be used.")
                entries = entries[: args.num_prompts] if args.num_prompts is not None else entries
                workload = dataset_workload(entries, lambda p: client.tokenize(p)["token_ids"], out_range[0])
    except ServerError as e:
        sys.stderr.write(f"jaxinfer: error: the server at {args.server} answered {e.code.name}: {e.details}\n")
        return 1
    vocab = info["vocab_size"]
    if entries is None:
        n = args.num_prompts if args.num_prompts is not None else DEFAULT_NUM_PROMPTS
        workload = synthetic_workload(n, in_range, out_range, vocab, args.seed)
    check_workload_fits(workload, info["max_model_len"])
    warm = warmup_workload(workload, args.warmup_requests, vocab, args.seed)
    backend = GrpcBackend(args.server, token=token, tls_ca=tls_ca)
    result = run_benchmark(backend, workload, _bench_config(args), warm)
    summary = summarize(result, {
        "backend": GrpcBackend.name,
        "server": args.server,
        "model": info["name"],
        "device": info["backend"],
        "dtype": info["dtype"],
        "max_num_seqs": info["max_num_seqs"],
        "max_num_batched_tokens": info["max_num_batched_tokens"],
        "server_version": info["version"],
        "dataset": args.dataset or "random",
    })
    return _write_summary(summary, args, out)


def load_local_tokenizer(name: str):
    """``--tokenizer``: a tokenizer from a path (a tokenizer directory, a GGUF file, a model directory) or any
    name ``--model`` takes (``smollm2-135m-instruct``, a Hub id); ValueError naming the flag."""
    from jaxinfer.text.tokenizer import load_tokenizer
    from jaxinfer.loading.weights import resolve_model

    try:
        if os.path.exists(os.path.expanduser(name)):
            return load_tokenizer(os.path.expanduser(name))
        return load_tokenizer(resolve_model(name).path)
    except ValueError as e:
        raise ValueError(f"--tokenizer {name}: {e}") from None


def _openai_api_key(args) -> Optional[str]:
    """--api-key, else $OPENAI_API_KEY, else jaxinfer's own token (--auth-token-file, $JAXINFER_AUTH_TOKEN)."""
    from jaxinfer.server.config import read_auth_token

    return args.api_key or os.environ.get("OPENAI_API_KEY", "").strip() or read_auth_token(
        getattr(args, "auth_token_file", None))


def _probe_token_ids(client, endpoint: str, model: str, ids: list) -> Optional[str]:
    """Send one 1-token request with a token-id prompt: None when the server takes it, else why not
    (a 400 or 422: the server wants text; or a 500 that names the prompt's type, as llama-cpp-python's
    server answers a token-id prompt). Any other refusal is an `OpenAIServerError`."""
    import httpx

    try:
        r = client.post(endpoint, json={"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0},
                        timeout=600.0)  # a server that compiles on first use answers late
    except httpx.HTTPError as e:
        raise OpenAIServerError(f"{endpoint} did not answer: {one_line_error(f'{type(e).__name__}: {e}')}") from None
    if r.status_code == 200:
        return None
    why = http_error_text(r.status_code, r.content)
    if r.status_code in (400, 422) or (r.status_code == 500 and "prompt" in why and "string" in why):
        return why
    raise OpenAIServerError(f"{endpoint} answered {why}")


def bench_openai_command(args, entries, in_range, out_range, out) -> int:
    """``jaxinfer bench --base-url URL``: the same workload and report, against any OpenAI-compatible server.

    The vocabulary for random prompts comes from ``--tokenizer`` (a local tokenizer), else from the
    server's ``/v1/models`` (a ``vocab_size`` field, or llama.cpp's ``meta.n_vocab``), else by bisection
    on its ``/detokenize`` (jaxinfer's refuses an id past the vocabulary); vLLM tells neither way, so
    against vLLM give ``--tokenizer`` (as vLLM's own ``bench serve`` needs one). ``--dataset``
    prompts are tokenized by that tokenizer, else by the server's ``/tokenize``. Prompts go as token
    ids unless the server refuses them (one probe request; ``--prompt-format``) or the endpoint is the
    chat one: then as text, detokenized locally or by the server's ``/detokenize``.
    """
    import httpx

    base = openai_base_url(args.base_url)
    endpoint = args.endpoint or COMPLETIONS
    fmt = "text" if endpoint == CHAT_COMPLETIONS else args.prompt_format
    if endpoint == CHAT_COMPLETIONS and args.prompt_format == "ids":
        raise ValueError(f"--prompt-format ids: {CHAT_COMPLETIONS} takes text (its messages).")
    api_key = _openai_api_key(args)
    tok = load_local_tokenizer(args.tokenizer) if args.tokenizer else None
    verify = args.tls_ca or True
    notes: list = []
    try:
        with httpx.Client(base_url=base, headers=auth_headers(api_key), timeout=30.0, verify=verify) as client:
            info = openai_server_info(client, base, args.model)
            model = info["model"]
            vocab, vocab_from = (tok.vocab_size, "--tokenizer") if tok is not None else (info["vocab_size"],
                                                                                          "/v1/models")
            if vocab is None and entries is None:
                vocab, vocab_from = detokenize_vocab_size(client, model), "/detokenize"
            if entries is not None:
                entries = entries[: args.num_prompts] if args.num_prompts is not None else entries
                encode = tok.encode if tok is not None else (lambda p: server_tokenize(client, model, p))
                workload = dataset_workload(entries, encode, out_range[0])
                if vocab is None:  # the warm-up's random prompts stay within the ids the dataset uses
                    vocab, vocab_from = max(i for r in workload for i in r.prompt_ids) + 1, "the dataset"
            else:
                if vocab is None:
                    raise ValueError(f"the server at {base} does not tell its vocabulary size (neither /v1/models "
                                     "nor /detokenize), so random prompts cannot be drawn: give --tokenizer (a local "
                                     "copy of the served model's tokenizer) or --dataset.")
                n = args.num_prompts if args.num_prompts is not None else DEFAULT_NUM_PROMPTS
                workload = synthetic_workload(n, in_range, out_range, vocab, args.seed)
            if info["max_model_len"]:
                check_workload_fits(workload, info["max_model_len"])
            warm = warmup_workload(workload, args.warmup_requests, vocab, args.seed)
            if fmt == "auto":
                why = _probe_token_ids(client, endpoint, model, workload[0].prompt_ids)
                fmt = "ids" if why is None else "text"
                if why is not None:
                    notes.append(f"the server refused a token-id prompt ({why}); prompts are sent as text")
            texts = None
            if fmt == "text":
                decode = (lambda ids: tok.decode(ids)) if tok is not None else (
                    lambda ids: server_detokenize(client, model, ids))
                texts = {}
                for r in workload + warm:
                    key = tuple(r.prompt_ids)
                    if key not in texts:
                        texts[key] = decode(r.prompt_ids)
    except OpenAIServerError as e:
        sys.stderr.write(f"jaxinfer: error: {e}\n")
        return 1
    for note in notes:
        sys.stderr.write(f"jaxinfer: {note}\n")
    backend = OpenAIBackend(base, model, api_key=api_key, endpoint=endpoint, texts=texts, verify=verify)
    result = run_benchmark(backend, workload, _bench_config(args), warm)
    summary = summarize(result, {
        "backend": OpenAIBackend.name,
        "server": base + endpoint,
        "model": model,
        "prompts": "token ids" if texts is None else "text (detokenized token ids)",
        "vocab_size": vocab,
        "vocab_from": vocab_from,
        "max_model_len": info["max_model_len"],
        "dataset": args.dataset or "random",
    })
    return _write_summary(summary, args, out)


def _say(text: str) -> None:
    """One plain line on stderr, in the start-up lines' form."""
    try:
        sys.stderr.write(f"jaxinfer: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stderr is no reason to fail a run
        pass


def warm_up_engine(llm, t_start: float, quiet: bool = False) -> int:
    """Compile (or load from the program cache) every program before the measured run; returns how many.

    Where the start-up stages are shown (a terminal, or --verbose) the compile stage shows itself and
    a closing ``ready in ...`` line follows. Elsewhere (a log, CI) the stage lines are off, so that a
    log does not sit silent through the compile: a plain line when it starts and one when it ends
    (unless --quiet).
    """
    plain = not quiet and not progress.showing()
    t0 = time.perf_counter()
    if plain:
        _say("compiling the engine's programs (or loading them from the program cache) ...")
    n = llm.engine.warmup()
    if plain:
        _say(f"{n} programs ready in {time.perf_counter() - t0:.1f}s")
        _say(f"ready in {time.perf_counter() - t_start:.1f}s")
    else:
        progress.ready(t_start)
    return n


def bench_command(args, out=None, t_start: Optional[float] = None) -> int:
    """Run ``jaxinfer bench`` from parsed arguments; returns the exit status.

    `t_start` is when the command started (``time.perf_counter()``), for the closing "ready in" line.
    """
    t_start = time.perf_counter() if t_start is None else t_start
    out = out if out is not None else sys.stdout
    in_range, out_range = _check_args(args)
    entries = read_dataset(args.dataset) if args.dataset is not None else None
    if entries is not None and args.num_prompts is not None and args.num_prompts > len(entries):
        raise ValueError(f"--num-prompts {args.num_prompts} is more than the {len(entries)} prompts in {args.dataset}.")
    if getattr(args, "base_url", None) is not None:
        return bench_openai_command(args, entries, in_range, out_range, out)
    if getattr(args, "server", None):
        return bench_server_command(args, entries, in_range, out_range, out)

    from jaxinfer.engine import distributed
    from jaxinfer.llm import LLM

    llm = LLM(**llm_kwargs(args))  # the model and engine flags as every command loads them
    if distributed.run_as_follower(llm):  # a multi-process run: process 0 measures
        return 0
    try:
        vocab = llm.model_config.vocab_size
        if entries is not None:
            if llm.tokenizer is None:
                raise ValueError(f"model {llm.model_name!r} has no tokenizer, so --dataset prompts cannot be used.")
            entries = entries[: args.num_prompts] if args.num_prompts is not None else entries
            workload = dataset_workload(entries, llm.tokenizer.encode, out_range[0])
        else:
            n = args.num_prompts if args.num_prompts is not None else DEFAULT_NUM_PROMPTS
            workload = synthetic_workload(n, in_range, out_range, vocab, args.seed)
        check_workload_fits(workload, llm.max_model_len)
        if args.warmup:
            warm_up_engine(llm, t_start, quiet=getattr(args, "quiet", False))
        cfg = _bench_config(args)
        warm = warmup_workload(workload, args.warmup_requests, vocab, args.seed)
        result = run_benchmark(LibraryBackend(llm), workload, cfg, warm)
    finally:
        llm.close()

    import jax

    engine = llm.engine_config
    info = {
        "backend": LibraryBackend.name,
        "model": llm.model_name,
        "device": jax.default_backend(),
        "engine_config": engine.name,
        "dtype": engine.dtype,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": llm.engine.scheduler.budget,  # as a server reports it
        "prefix_caching": not args.no_prefix_caching,
        "dataset": args.dataset or "random",
    }
    return _write_summary(summarize(result, info), args, out)
