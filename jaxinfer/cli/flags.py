"""The command line's flag groups, each defined once, and what the parsed flags turn into.

Every command takes a flag from here, with one spelling, one help text and one
default, so ``generate``, ``generate --server``, ``serve``, ``warmup`` and
``bench`` cannot drift apart:

    group          function                  flags                                            commands
    model          add_model_flags           --model --no-model-cache --generation-config     generate chat serve
                                                                                              warmup bench tokenize
    engine         add_engine_flags          --engine-config --max-model-len --dtype          generate chat serve
                                             --max-num-seqs --num-pages                       warmup bench
                                             --tensor-parallel-size
                                             --max-num-batched-tokens --no-prefix-caching
                                             --warmup/--no-warmup (serve, bench)
    sampling       add_sampling_flags        --max-tokens --min-tokens --temperature --top-p  generate chat (local
                                             --top-k --min-p --seed --stop --ignore-eos       and --server)
                                             --presence/frequency/repetition-penalty
                                             --logprobs
                   (structured=True)         --json-schema --json-object --regex --choice     generate (local
                                             --grammar (one of them) --any-whitespace         and --server)
    prompt format  add_prompt_format_flags   --chat/--no-chat --system                        generate tokenize
                                             --chat-template-kwargs JSON                      chat (no --chat)
    output         add_output_flags          --json --trace                                   generate (tokenize:
                                                                                              --json)
    client         add_client_flags          --server --auth-token-file --tls-ca --timeout    generate chat bench
                                                                                              (no --timeout)
    progress       add_progress_flags        --quiet --verbose                                generate chat serve
                                                                                              warmup bench convert

What they turn into, also once: `llm_kwargs` (the ``LLM(...)`` keywords of
every command that loads a model), `check_engine_flags` (the same engine
checked before the slow load), `sampling_overrides` / `generate_sampling`
(the SamplingParams fields of ``generate``, local or ``--server``, its
structured output included: `structured_outputs_from_args`, checked without
the model by `check_structured_outputs`),
`read_prompt`, `chat_mode` and `chat_messages` (the prompt a request is made
of), `refuse_local_flags` (``--server``: the model and engine are the
server's) and `configure_progress`.

``bench`` keeps its own workload flags: its ``--temperature`` (default 0,
greedy) and ``--seed`` (default 0, also seeding the prompts, lengths and
arrivals) mean something else than ``generate``'s, and its ``--json`` takes
a FILE.

Imports: this module is on the path of ``jaxinfer --help`` and of every usage error, so
it imports only light modules at the top; the engine (`jaxinfer.llm`, which imports JAX)
and structured output's grammar checker (`jaxinfer.engine.structured`, llguidance) are
imported inside the function that needs them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Optional

from jaxinfer import progress
from jaxinfer.cli.argtypes import DTYPE_CHOICES, DTYPE_HELP, int_in, non_negative_number, number, unescape
from jaxinfer.config import DEFAULT_MODEL, EngineConfig, SpeculativeConfig
from jaxinfer.engine.compile_cache import enable_compilation_cache
from jaxinfer.loading.generation_config import FALLBACK, read_generation_config
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams

# generate and chat without --max-tokens: the rest of the context (as the HTTP server's default), at most this
# many (a runaway answer of a model that never ends stops after about this many tokens)
DEFAULT_MAX_TOKENS = 4096
# generate's exit status when a constrained output (--json-schema, --json-object, --regex, --choice, --grammar)
# is cut by the length limit before its grammar reached an end
EXIT_INCOMPLETE = 3
CONSTRAINT_FLAGS = ("json_schema", "json_object", "regex", "choice", "grammar")
# --generation-config auto for a model that sets no temperature (jaxinfer.loading.generation_config), on every path
CLI_TEMPERATURE, CLI_TOP_P = FALLBACK["temperature"], FALLBACK["top_p"]

# Sampling flags that map one-to-one onto SamplingParams fields (given or not: None is "not given").
SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logprobs",
)

# Structured-output flags: dest -> the StructuredOutputsParams kind each gives (at most one of them).
STRUCTURED_FLAGS = {"json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}
# ... and the flag that gives each kind, to name it in errors
STRUCTURED_FLAG_OF = {kind: "--" + dest.replace("_", "-") for dest, kind in STRUCTURED_FLAGS.items()}

# Engine flags that override a field of the preset (None: not given), as LLM(...) keywords.
ENGINE_OVERRIDES = ("dtype", "max_model_len", "max_num_seqs", "num_pages", "kv_cache_memory_bytes",
                    "max_num_batched_tokens", "tensor_parallel_size", "quantization", "batch_invariant",
                    "speculative_config")

def speculative_config_arg(text: str):
    """--speculative-config: a JSON object of `jaxinfer.config.SpeculativeConfig` fields, checked here."""
    try:
        return SpeculativeConfig.of(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


positive_int = int_in(1)
non_negative_int = int_in(0)
any_int = int_in()
seconds = non_negative_number


class UsageError(ValueError):
    """Bad input from the user: reported as one ``jaxinfer: error: ...`` line, exit status 2."""


# --------------------------------------------------------------------------- #
# The flag groups
# --------------------------------------------------------------------------- #


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --no-model-cache."""
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="MODEL",
                   help=f"the model to load: the built-in name {DEFAULT_MODEL.lower()}, a .gguf file, a Hugging Face "
                   "model directory (config.json + *.safetensors) or Hub repo id (org/name), or a directory written "
                   f"by 'jaxinfer convert' (default: {DEFAULT_MODEL})")
    g.add_argument("--no-model-cache", action="store_true",
                   help="convert the model in memory instead of restoring it from (or saving it to) the model cache "
                   "($JAXINFER_MODEL_CACHE, else ~/.cache/jaxinfer/models; JAXINFER_MODEL_CACHE=0 also turns it off)")
    g.add_argument("--generation-config", type=generation_config_arg, metavar="auto|vllm|PATH",
                   help="the sampling defaults every request takes for the fields it leaves unset, on every path "
                   "(generate, chat, gRPC, HTTP), as vLLM's flag: auto, the model's generation_config.json "
                   f"(temperature {CLI_TEMPERATURE} and top-p {CLI_TOP_P} when it sets no temperature); vllm, "
                   "neutral (temperature 1.0, top-p 1.0, no top-k, min-p or penalty); PATH, a directory with a "
                   "generation_config.json or the file (default: auto)")


def generation_config_arg(text: str) -> str:
    """--generation-config: auto, vllm, or a path that holds a generation_config.json (read now: a usage error
    before the model loads)."""
    if text in ("auto", "vllm"):
        return text
    try:
        read_generation_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--generation-config: ")) from None
    return text


def add_engine_flags(p: argparse.ArgumentParser, *, warmup: Optional[str] = None):
    """The engine's preset and sizes; ``warmup`` (the end of its help) adds --warmup/--no-warmup, default on.

    Returns the group, so a command can add flags of its own engine (serve's scheduling).
    """
    g = p.add_argument_group("engine")
    g.add_argument("--engine-config", metavar="NAME",
                   help="engine preset: cpu, gpu or tpu (default: the one for JAX's backend)")
    g.add_argument("--max-model-len", type=positive_int, metavar="N",
                   help="cap the context length (prompt + output), in tokens (default: the model's, as far as the "
                   "KV cache holds it)")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    g.add_argument("--quantization", choices=("int8", "int4"),
                   help="weight-only quantization: int8 (per output channel; a GGUF's Q8_0 blocks are kept) or int4 "
                   "(groups of 32 with scale and offset; Q4_0/Q4_1 blocks are kept); default: weights in --dtype")
    g.add_argument("--max-num-seqs", type=positive_int, metavar="N",
                   help="most requests decoded together (default: the preset's)")
    g.add_argument("--num-pages", type=positive_int, metavar="N",
                   help="KV cache pages, page 0 reserved (default: the preset's)")
    g.add_argument("--kv-cache-memory-bytes", type=positive_int, metavar="BYTES",
                   help="the KV cache's bytes on each device: as many pages as fit (overrides --num-pages)")
    g.add_argument("--tensor-parallel-size", "--tp", type=positive_int, metavar="N",
                   help="split the model over N devices (tensor parallelism; default 1)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N",
                   help="token budget of one engine step (default: the preset's)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    g.add_argument("--batch-invariant", action="store_const", const=True, default=None,
                   help="batch-invariant mode for the pure-JAX path (GPU, TPU, CPU without native kernels): a "
                   "request's numbers do not depend on the rest of the batch, at some cost in speed (also "
                   "JAXINFER_BATCH_INVARIANT=1); CPU's native kernels are invariant without it")
    g.add_argument("--speculative-config", type=speculative_config_arg, metavar="JSON",
                   help='speculative decoding, as vLLM spells it: e.g. \'{"method": "ngram", "num_speculative_tokens": '
                   '4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup: drafts copied from the prompt '
                   'and output, verified in the same step; greedy output unchanged, sampled output the same '
                   'distribution)')
    if warmup is not None:
        g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help=f"compile (or load from the program cache) every program the engine can run {warmup}")
    return g


def add_sampling_flags(p: argparse.ArgumentParser, *, structured: bool = False) -> None:
    """--max-tokens, --min-tokens and the SamplingParams fields; not given: the model's defaults, else the CLI's.

    ``structured``: also the structured-output flags (`add_structured_output_flags`), in the same group.
    """
    s = p.add_argument_group(
        "sampling",
        "A flag not given takes the sampling default in force (--generation-config, default auto: the model's "
        f"generation_config.json; a model without a temperature gets temperature {CLI_TEMPERATURE} and top-p "
        f"{CLI_TOP_P}), the same over a server; the rest default to off (no top-k, min-p, penalties or stop "
        "strings).",
    )
    s.add_argument("--max-tokens", type=any_int, metavar="N",
                   help="most tokens to generate (default: the rest of the context, as the HTTP server's, at "
                   f"most {DEFAULT_MAX_TOKENS})")
    s.add_argument("--min-tokens", type=any_int, metavar="N",
                   help="generate at least N tokens before end-of-sequence or a stop string may end the output "
                   "(default: 0)")
    s.add_argument("--temperature", type=number, metavar="T",
                   help=f"0 is greedy (default: the model's, else {CLI_TEMPERATURE})")
    s.add_argument("--top-p", type=number, metavar="P",
                   help=f"nucleus sampling mass, in (0, 1] (default: the model's, else {CLI_TOP_P})")
    s.add_argument("--top-k", type=any_int, metavar="K", help="keep the K most likely tokens; 0 disables")
    s.add_argument("--min-p", type=number, metavar="P", help="drop tokens below P times the top probability")
    s.add_argument("--seed", type=any_int, metavar="N", help="seed for reproducible sampling (default: random)")
    s.add_argument("--stop", action="append", metavar="TEXT", type=unescape,
                   help=r"stop when TEXT is generated (not printed); repeatable; \n, \t, \r and \\ in TEXT "
                   r"stand for a newline, a tab, a carriage return and a backslash")
    s.add_argument("--presence-penalty", type=number, metavar="X", help="in [-2, 2]")
    s.add_argument("--frequency-penalty", type=number, metavar="X", help="in [-2, 2]")
    s.add_argument("--repetition-penalty", type=number, metavar="X", help="in (0, 100]; 1 disables")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    s.add_argument("--logprobs", type=any_int, metavar="N",
                   help="report the logprob of each token and the N most likely alternatives")
    if structured:
        add_structured_output_flags(s)


def add_structured_output_flags(group) -> None:
    """--json-schema, --json-object, --regex, --choice, --grammar (at most one; argparse names both flags
    of a clash) and --any-whitespace, added to ``group`` (the sampling group)."""
    x = group.add_mutually_exclusive_group()
    x.add_argument("--json-schema", type=json_schema_arg, metavar="FILE_OR_JSON",
                   help="constrain the output to one JSON value valid against this JSON Schema: a .json file, or "
                   "the schema's text ('{\"type\": \"object\", ...}'); compact JSON unless --any-whitespace")
    x.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    x.add_argument("--regex", metavar="RE", help="constrain the whole output to match the regular expression RE")
    x.add_argument("--choice", action="append", metavar="TEXT",
                   help="constrain the output to exactly one of the choices; repeat it, one choice each (a choice "
                   "may hold commas and spaces)")
    x.add_argument("--grammar", type=grammar_file_arg, metavar="FILE",
                   help="constrain the output to a grammar in FILE: Lark, or llama.cpp's GBNF (rules written "
                   "'name ::= ...')")
    group.add_argument("--any-whitespace", action="store_true",
                       help="with --json-schema or --json-object: let the JSON hold the whitespace JSON allows "
                       "between tokens (default: compact JSON, which a sampled request cannot pad with runs of "
                       "spaces and newlines)")


def add_prompt_format_flags(p: argparse.ArgumentParser, *, chat_default: Optional[bool] = None,
                            what: str = "PROMPT", chat_flag: bool = True) -> None:
    """--chat/--no-chat (default None: on when the model has a chat template; ``chat_flag=False``: none, the
    command always chats), --system and --chat-template-kwargs."""
    g = p.add_argument_group("prompt format")
    if chat_flag:
        if chat_default is None:
            help_ = f"wrap {what} in the model's chat template (default: on when the model has one)"
        else:
            help_ = (f"render {what} as a user message with the model's chat template and the generation prompt "
                     f"(default: {'on' if chat_default else 'off'})")
        g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=chat_default, help=help_)
    g.add_argument("--system", metavar="TEXT",
                   help="a system message (chat mode)" if chat_flag else
                   "the system prompt (default: none, or what the model's chat template adds; /system changes it)")
    g.add_argument("--chat-template-kwargs", type=json_object, metavar="JSON", default=None,
                   help='extra variables for the chat template, e.g. \'{"enable_thinking": false}\' (Qwen3)')


def add_output_flags(p: argparse.ArgumentParser, *, json_help: Optional[str] = None, trace: bool = True) -> None:
    """--json (one JSON object instead of streamed text) and --trace (the request's timeline on stderr)."""
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true",
                   help=json_help or "print nothing while generating, then one JSON object with the text, "
                   "token ids, usage and timings")
    if trace:
        g.add_argument("--trace", action="store_true",
                       help="after the text, print the request's timeline (tokenize, prefill, TTFT, decode) "
                       "to stderr")


def add_client_flags(p: argparse.ArgumentParser, *, server_help: Optional[str] = None, timeout: bool = True) -> None:
    """--server HOST:PORT and how to reach it: --auth-token-file, --tls-ca, --timeout."""
    g = p.add_argument_group("server")
    g.add_argument("--server", metavar="HOST:PORT",
                   help=server_help or "generate on a running 'jaxinfer serve' instead of loading the model here, "
                   "with the same flags, defaults and output (model and engine flags are refused: they are the "
                   "server's)")
    g.add_argument("--auth-token-file", metavar="FILE",
                   help="with --server: send the bearer token in FILE (default: $JAXINFER_AUTH_TOKEN if set)")
    g.add_argument("--tls-ca", metavar="FILE", help="with --server: connect with TLS, trusting this CA (PEM)")
    if timeout:
        g.add_argument("--timeout", type=seconds, metavar="SECONDS",
                       help="with --server: deadline for the whole request (default: none)")


def add_progress_flags(p: argparse.ArgumentParser) -> None:
    """--quiet / --verbose: the start-up progress lines on stderr (see `configure_progress`)."""
    g = p.add_argument_group("progress").add_mutually_exclusive_group()
    g.add_argument("--quiet", action="store_true", help="no start-up progress lines on stderr")
    g.add_argument("--verbose", action="store_true",
                   help="start-up progress lines (resolving, converting, restoring, compiling, ready) on stderr even "
                   "when it is not a terminal (default: only on a terminal)")


# --------------------------------------------------------------------------- #
# What the flags turn into
# --------------------------------------------------------------------------- #


def configure_progress(args: argparse.Namespace) -> None:
    """Start-up progress on stderr: on a terminal by default, always with --verbose, never with --quiet."""
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


def model_name(args: argparse.Namespace) -> str:
    """--model, else the default model."""
    return getattr(args, "model", None) or DEFAULT_MODEL


def engine_overrides(args: argparse.Namespace) -> dict:
    """The engine fields given on the command line."""
    return {k: getattr(args, k) for k in ENGINE_OVERRIDES if getattr(args, k, None) is not None}


def check_engine_flags(args: argparse.Namespace):
    """The preset with the engine flags over it, checked before any model is loaded; returns the EngineConfig."""
    name = getattr(args, "engine_config", None)
    # the backend's preset imports JAX: seconds on a cold start, shown as a stage if it happens here
    with progress.stage("loading JAX") if not name and "jax" not in sys.modules else contextlib.nullcontext():
        engine = EngineConfig.preset(name) if name else _backend_preset()
    engine = engine.replace(**engine_overrides(args))
    if engine.max_num_seqs > engine.batch_buckets[-1]:
        raise UsageError(
            f"--max-num-seqs {engine.max_num_seqs} exceeds the largest batch bucket ({engine.batch_buckets[-1]}) "
            f"of the {engine.name} engine config."
        )
    return engine


def llm_kwargs(args: argparse.Namespace) -> dict:
    """The ``LLM(**...)`` keywords of the model and engine flags: one translation for every command."""
    return {
        "model": model_name(args),
        "engine_config": getattr(args, "engine_config", None),
        "enable_prefix_caching": not getattr(args, "no_prefix_caching", False),
        "model_cache": not getattr(args, "no_model_cache", False),
        **engine_overrides(args),
        # --generation-config when given; else LLM's default, "auto"
        **({"generation_config": args.generation_config} if getattr(args, "generation_config", None) else {}),
    }


def refuse_local_flags(args: argparse.Namespace) -> None:
    """With --server the model and the engine are the server's: flags that would configure them are an error."""
    given = ["--model"] if getattr(args, "model", None) is not None else []
    local = ("no_model_cache", "generation_config", "engine_config", *ENGINE_OVERRIDES, "no_prefix_caching")
    given += [f"--{name.replace('_', '-')}" for name in local if getattr(args, name, None)]
    if given:
        raise UsageError(f"{', '.join(given)}: with --server the model and the engine are the server's; these flags "
                         "choose a model to load here (drop them, or drop --server).")


def read_prompt(value: str, what: str = "prompt") -> str:
    """The argument itself, or stdin for '-' (trailing newlines dropped, as ``$(...)`` does)."""
    if value == "-":
        value = sys.stdin.read().rstrip("\r\n")
    if value == "":
        raise UsageError(f"the {what} is empty: pass some text (or '-' to read it from stdin).")
    return value


def chat_messages(text: str, system: Optional[str] = None) -> list:
    """The conversation of a command-line prompt: an optional system message, then the user's text."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": text})
    return messages


def json_object(text: str) -> dict:
    """argparse type: a JSON object (``--chat-template-kwargs``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {text!r}")
    return value


def json_schema_arg(value: str) -> dict:
    """argparse type of --json-schema: the schema's JSON text (it starts with ``{``), else a file holding it."""
    text, where = value, "the text"
    if not value.lstrip().startswith("{"):
        if not os.path.isfile(value):
            raise argparse.ArgumentTypeError(
                f"no such file {value!r}: give a .json file or the schema's JSON text ({{...}})")
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read {value!r}: {e}") from None
        where = repr(value)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(
            f"{where} must be a JSON Schema object ({{...}}), got {type(schema).__name__}")
    return schema


def grammar_file_arg(path: str) -> str:
    """argparse type of --grammar: the text of a Lark or GBNF file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"no such file {path!r}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e}") from None


def structured_outputs_from_args(args: argparse.Namespace):
    """The `StructuredOutputsParams` of the structured-output flags, or None when none is given.

    ValueError (the library's message, after the flag that gave it) for a constraint the library
    refuses, and for --any-whitespace without a JSON constraint.
    """
    given = {kind: getattr(args, dest, None) for dest, kind in STRUCTURED_FLAGS.items()}
    given = {kind: v for kind, v in given.items() if v not in (None, False)}
    any_ws = bool(getattr(args, "any_whitespace", False))
    if not given:
        if any_ws:
            raise UsageError("--any-whitespace applies to a JSON constraint: give --json-schema or --json-object too.")
        return None
    if len(given) > 1:  # argparse refuses this already; a Namespace made by hand may not have been through it
        a, b = (STRUCTURED_FLAG_OF[k] for k in list(given)[:2])
        raise UsageError(f"{b}: not allowed with {a} (one structured-output constraint per request).")
    [(kind, value)] = given.items()
    if any_ws and kind not in ("json", "json_object"):
        raise UsageError(f"--any-whitespace applies to a JSON constraint, not to {STRUCTURED_FLAG_OF[kind]}.")
    try:
        return StructuredOutputsParams(**{kind: value}, disable_any_whitespace=not any_ws)
    except ValueError as e:
        raise UsageError(f"{STRUCTURED_FLAG_OF[kind]}: {e}") from None


def check_structured_outputs(sop) -> None:
    """Refuse a schema, regex or grammar that does not parse, before any model or server is reached.

    llguidance checks the grammar without a tokenizer (milliseconds); the model's tokenizer may still
    refuse a constraint when the request is made (the same message, from the library).
    """
    if sop is None:
        return
    import llguidance  # lazy (start-up, see the module docstring), as is the next

    from jaxinfer.engine.structured import GrammarCompiler

    flag = STRUCTURED_FLAG_OF[sop.kind]
    try:
        grammar = GrammarCompiler(None, 0).grammar(sop)  # the text llguidance compiles; no tokenizer needed
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    if error:
        raise UsageError(f"{flag}: structured_outputs.{sop.kind} does not compile: {' '.join(error.split())}")


def chat_mode(args: argparse.Namespace, has_template: bool, model: str) -> bool:
    """Whether the prompt goes through the chat template: --chat / --no-chat, else whether the model has one."""
    flag = getattr(args, "chat", None)
    chat = has_template if flag is None else bool(flag)
    if chat and not has_template:
        raise UsageError(f"{model} has no chat template; use --no-chat.")
    if getattr(args, "system", None) is not None and not chat:
        raise UsageError(f"--system needs chat mode, but {model} has no chat template.")
    if getattr(args, "chat_template_kwargs", None) and not chat:
        raise UsageError("--chat-template-kwargs needs chat mode (the prompt is not rendered with a template).")
    return chat


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The SamplingParams fields given on the command line, and max_tokens (default `DEFAULT_MAX_TOKENS`, which
    the request shrinks to the rest of the context: ``fit_max_tokens``)."""
    max_tokens = getattr(args, "max_tokens", None)
    kw: dict[str, Any] = {"max_tokens": max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS}
    for name in SAMPLING_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if getattr(args, "stop", None):
        kw["stop"] = list(args.stop)
    if getattr(args, "ignore_eos", False):
        kw["ignore_eos"] = True
    structured = structured_outputs_from_args(args)
    if structured is not None:
        kw["structured_outputs"] = structured
    return kw


def cli_sampling_defaults(model_temperature: Optional[float]) -> dict:
    """What ``generate`` (local and ``--server``) puts over the sampling defaults in force.

    Nothing for a model loaded with a ``--generation-config`` (every path then samples at the
    same defaults, which set a temperature); a model wrapped in memory (`LLM.from_params`)
    without one, or an older server that reports none, gets temperature 0.2 and top-p 0.9
    instead of the library's 1.0 / 1.0. Flags given on the command line override these in turn.
    """
    return {} if model_temperature is not None else {"temperature": CLI_TEMPERATURE, "top_p": CLI_TOP_P}


def generate_sampling(overrides: dict, model_temperature: Optional[float]) -> dict:
    """The fields ``generate`` sets over the model's defaults: the CLI's defaults, then the flags."""
    return {**cli_sampling_defaults(model_temperature), **overrides}


def check_generate_args(args: argparse.Namespace) -> tuple:
    """What ``generate`` (local or ``--server``) checks before a model or a server: returns (prompt, overrides)."""
    prompt = read_prompt(args.prompt)
    overrides = sampling_overrides(args)
    SamplingParams(**overrides)  # raises ValueError with vLLM's wording
    check_structured_outputs(overrides.get("structured_outputs"))
    if getattr(args, "system", None) is not None and getattr(args, "chat", None) is False:
        raise UsageError("--system needs chat mode; drop --no-chat.")
    return prompt, overrides


def generate_result(model: str, chat: bool, prompt: str, *, token_ids, text: str, finish_reason, stop_reason,
                    usage: dict, timings: dict, logprobs=None, token_text=None, **extra) -> dict:
    """The one JSON object of ``generate --json``, local or over a server (which adds ``server``).

    ``logprobs``: `Logprob`s when asked for; ``token_text(id)`` names their tokens.
    """
    result = {
        "model": model,
        "chat": bool(chat),
        "prompt": prompt,
        **extra,
        "prompt_token_count": usage["prompt_tokens"],
        "token_ids": [int(t) for t in token_ids],
        "text": text,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "usage": usage,
        "timings": timings,
    }
    if logprobs is not None:
        def entry(i: int, lp: float) -> dict:
            return {"token_id": int(i), "token": token_text(int(i)), "logprob": float(lp)}

        def top(lp) -> list:
            return [entry(i, v) for i, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]

        result["logprobs"] = [{**entry(lp.token_id, lp.logprob), "top": top(lp)} for lp in logprobs]
    return result


def format_logprobs(token_text, logprobs) -> str:
    """The table ``generate --logprobs N`` prints after the text (without --json), local or over a server.

    ``token_text(id)``: a token's text (None if unknown: shown as ``#id``); ``logprobs``: `Logprob`s, one
    per generated token. One line per token: its position, its text (quoted, so spaces and newlines
    show), its logprob and the N most likely tokens at that step with theirs, most likely first.
    """
    def name(i: int) -> str:
        text = token_text(int(i))
        if text is None:
            return f"#{int(i)}"
        shown = repr(text)
        return shown if len(shown) <= 18 else shown[:16] + "…" + shown[0]

    logprobs = list(logprobs or [])
    widest = max((len(lp.top) for lp in logprobs), default=0)
    rows = []
    for n, lp in enumerate(logprobs):
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])
        rows.append((str(n), name(lp.token_id), f"{lp.logprob:.4f}", "  ".join(f"{name(i)} {v:.4f}" for i, v in top)))
    head = ("#", "token", "logprob", f"top {widest}" if widest else "")
    w = [max(len(r[c]) for r in [head, *rows]) for c in range(3)]
    title = (f"logprobs of {len(rows)} token{'s' if len(rows) != 1 else ''}"
             + (f" (each with the {widest} most likely at its step)" if widest else ""))
    lines = [title] + [f"{r[0]:>{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]}".rstrip() for r in [head, *rows]]
    return "\n".join(lines)


def print_logprobs(token_text, logprobs, file=None) -> None:
    """Write `format_logprobs`'s table to ``file`` (default: stderr, like --trace: stdout keeps only the text)."""
    out = file if file is not None else sys.stderr
    out.write(format_logprobs(token_text, logprobs) + "\n")
    out.flush()


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


def load_llm(args: argparse.Namespace):
    """``LLM(**llm_kwargs(args))``: the model of every command that loads one.

    Importing the engine (and JAX) takes seconds on a cold start; when that has not happened yet
    (``import jaxinfer.cli.main`` alone does not do it unless the package imports it eagerly), it runs
    as a start-up stage of its own, so the terminal shows it instead of sitting silent.
    """
    first = "jaxinfer.llm" not in sys.modules
    with progress.stage("loading the engine") if first else contextlib.nullcontext():
        enable_compilation_cache()
        from jaxinfer.llm import LLM  # here, not at the top: importing JAX is the stage shown
    return LLM(**llm_kwargs(args))


def _backend_preset():
    """JAX's default backend's engine preset (`jaxinfer.ops.backend.engine_preset`)."""
    from jaxinfer.ops.backend import engine_preset  # imports JAX: the caller shows it as a stage

    return engine_preset()


# --------------------------------------------------------------------------- #
# an output that stopped at its length limit (generate, local or --server)
# --------------------------------------------------------------------------- #


def constraint_flag(args: argparse.Namespace) -> Optional[str]:
    """The structured-output flag generate was given (``--json-schema`` ...), or None."""
    return next((f"--{a.replace('_', '-')}" for a in CONSTRAINT_FLAGS if getattr(args, a, None)), None)


def length_notice(max_tokens: int, prompt_tokens: int, max_model_len: int, constraint_flag: Optional[str] = None,
                  given: Optional[int] = None) -> str:
    """The line for an output that stopped at its length limit: which limit (--max-tokens, or the end of the
    context when the output was given all the room the prompt left) and what to do about it."""
    if prompt_tokens + max_tokens >= max_model_len and (given is None or given > max_tokens):
        where = (f"output stopped at the end of the {max_model_len}-token context ({prompt_tokens} prompt + "
                 f"{max_tokens} generated; --max-model-len)")
        more = "a shorter prompt or a larger --max-model-len leaves more room"
    else:
        where = f"output stopped at the {max_tokens}-token limit (--max-tokens)"
        more = "raise --max-tokens for a longer answer"
    if constraint_flag:
        return f"jaxinfer: {where}; the {constraint_flag} output is incomplete (exit status {EXIT_INCOMPLETE}): {more}"
    return f"jaxinfer: {where}; {more}"
