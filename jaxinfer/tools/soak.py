"""A soak test of the server (gRPC, the OpenAI-compatible HTTP API or both), run as a hostile client would run it.

    python -m jaxinfer.tools.soak --model DIR [--engine-config cpu --max-num-seqs 8 --num-pages 256
        --max-model-len 512 --max-waiting 8 --serve-arg=--no-prefix-caching ...] [--protocol grpc|http|both]
    python -m jaxinfer.tools.soak --server HOST:PORT [--server-pid PID] [--protocol http --http-url URL]
        [--requests 10000] [--concurrency 64] [--duration 1800] [--seed 0] [--json FILE]

It starts ``jaxinfer serve`` on loopback (``--port 0``; the port is read from its
"... - ready" line; its log goes to a temp file) or uses a running server, then:

1. runs a fixed set of greedy requests (temperature 0) and keeps their outputs;
2. runs ``--requests`` plan items at up to ``--concurrency`` at once, for at most
   ``--duration`` seconds, mixing these kinds (the plan is a function of ``--seed``):
     stream      a well-formed Generate: prompt, chat or token ids of random length, and every
                 sampling option (temperature, top_k/p, min_p, penalties, seeds, min_tokens,
                 ignore_eos, stop strings, stop_token_ids, logprobs None/0/1/max); the output is
                 checked (usage, logprobs, stop strings, min_tokens) and TTFT / gaps measured.
                 About one in six (CONSTRAINED_SHARE) is constrained (structured output; the
                 table's stream/<constraint> rows): a bounded JSON schema (a nested object, an enum
                 array with min/maxItems, an integer range, a short patterned string, no extra
                 properties; compact or " ?" whitespace), any JSON object, a regex, a choice list, a
                 Lark or a GBNF grammar, with the constraint's own max_tokens and no stop strings or
                 ids. finish_reason "stop": the text must validate (jsonschema), match, be one of
                 the choices; "length": allowed (incomplete); "error": only with its reason
     cancel      a stream cancelled after a few tokens, or by a timer before or after the first
     deadline    a stream with a 5-50 ms deadline
     invalid     out-of-range sampling options, empty / too long prompts, bad token ids, an empty
                 chat role, too many stop strings, a JSON schema, regex, Lark or GBNF grammar that
                 does not compile, schema text that is not JSON, an empty choice list, json_object
                 false, whitespace options without JSON, ...: must get INVALID_ARGUMENT (for a
                 constraint, with a message naming its field; a full server refuses a call before
                 reading it: such a call is sent again, as is a kill's)
     malformed   bytes that do not parse as a GenerateRequest, sent on a raw channel: INVALID_ARGUMENT
     garbage     raw bytes on the TCP port (random, HTTP/1.1, an HTTP/2 preface then junk, a reset)
     kill        a child process opens a stream and is SIGKILLed after its first token
     burst       2 x (max_num_seqs + max_waiting) + 4 streams at once (with --max-waiting):
                 some must get RESOURCE_EXHAUSTED
     tokenize, model_info, health
   With ``--protocol http`` (``serve --http-port 0`` when the soak starts the server) the kinds are
   their HTTP twins, and ``both`` mixes the two sets:
     http_stream      a well-formed /v1/chat/completions (chat prompts) or /v1/completions (text or
     http_complete    token ids), streamed or whole, with the same sampling options, logprobs in each
                      endpoint's form, n = 1-3 and stream_options.include_usage; the answer is checked
                      (every choice once, finish reasons, usage, logprob counts, stop strings, the role
                      first, the usage chunk last, data: [DONE] last). About one in six is constrained
                      as a stream is, by response_format (json_schema, json_object), structured_outputs
                      or guided_*, or (chat) by tools with tool_choice "required" or a named function:
                      finish_reason "tool_calls" and every call's arguments validate against its tool
     http_disconnect  a stream closed after a few chunks, on a timer (maybe before the headers), or by
                      an abortive close (RST) after the first data line
     http_invalid     bad values and shapes of every kind: must be a 400 (404 for an unknown model or
                      route) with an OpenAI error object {"error": {"message", "type", "param", "code"}};
                      constraints that do not compile, two at once, an empty choice list, a tool_choice
                      naming no offered tool or with no tools: a 400 whose param names the field
     http_malformed   bodies that are not JSON objects (truncated, not JSON, an array, NaN, bad UTF-8,
                      100,000 nested brackets, a text/plain body): a 400 with an error object
     http_garbage     raw bytes on the HTTP port: answered (never a 5xx), closed or ignored
     http_burst       as burst (streams of half the context): some must get 429
     http_misc        /v1/models, /health, /metrics, /tokenize, /detokenize
   A full server refuses before it reads (429); such invalid calls are sent again. The engine's numbers
   are read over gRPC whichever protocol is soaked.
3. runs the greedy set again (outputs must be byte-identical), waits for the engine to settle
   (0 running, 0 waiting, 0 KV pages in use, 0 calls in flight) and reads the server's RSS. Over HTTP
   the greedy set's answers must also be unchanged, and equal to gRPC's, and no call may get a 5xx.

It prints one table: calls by kind and status, client-side TTFT and inter-token gaps of
well-formed streams, RSS (at ready, after, peak sampled every second), the checks with
PASS/FAIL and the wall time. Exit status 0 when every check passes, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import struct
import sys
import tempfile
import time
from collections import Counter, defaultdict
from typing import Optional

import grpc

from jaxinfer.server import jaxinfer_pb2 as pb
from jaxinfer.server.client import AsyncClient, ServerError, generate_request
from jaxinfer.stats import percentile
from jaxinfer.tools.harness import machine, write_json

GENERATE = "/jaxinfer.v1.Generation/Generate"
WEIGHTS = {"stream": 50, "cancel": 10, "deadline": 6, "invalid": 12, "malformed": 3, "garbage": 2, "kill": 0.4,
           "burst": 0.3, "tokenize": 6, "model_info": 3, "health": 3}
INVALID = ["temperature<0", "temperature=nan", "top_p=0", "top_p>1", "top_k<-1", "top_k>vocab", "min_p>1",
           "presence_penalty>2", "frequency_penalty<-2", "repetition_penalty=0", "repetition_penalty>100",
           "seed<0", "seed>=2^32", "max_tokens=0", "min_tokens>max_tokens", "min_tokens<0", "logprobs>max",
           "logprobs<0", "empty_token_ids", "prompt_too_long", "prompt+max_tokens>max_model_len",
           "token_id=vocab", "token_id<0", "stop_token_id>=vocab", "empty_stop_string", "too_many_stop_strings",
           "stop_string_too_long", "too_many_stop_token_ids", "no_input", "empty_prompt", "empty_chat",
           "empty_chat_role", "reserved_template_kwarg"]
INVALID_CONSTRAINED = {  # variant -> a word its INVALID_ARGUMENT message must hold (the field)
    "json_schema_does_not_compile": "json", "json_schema_unsatisfiable": "json", "json_schema_not_json": "json",
    "regex_does_not_compile": "regex", "lark_does_not_compile": "grammar", "gbnf_does_not_compile": "grammar",
    "empty_choice_list": "choice", "json_object_false": "json_object", "whitespace_without_json": "flexible_whitespace",
}
INVALID += list(INVALID_CONSTRAINED)
MALFORMED = ["random_bytes", "truncated", "bad_utf8_prompt", "bad_utf8_chat_role", "bad_varint",
             "length_past_end", "stray_end_group"]
GARBAGE = ["random_bytes", "http1_get", "h2_preface_junk", "h2_huge_frame", "reset"]
ALLOWED = {  # statuses each kind may get; anything else fails the run
    "stream": {"OK", "RESOURCE_EXHAUSTED"}, "burst": {"OK", "RESOURCE_EXHAUSTED"},
    "cancel": {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"}, "deadline": {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"},
    "kill": {"KILLED", "RESOURCE_EXHAUSTED"}, "tokenize": {"OK"}, "model_info": {"OK"}, "health": {"OK"},
    "invalid": {"INVALID_ARGUMENT"}, "malformed": {"INVALID_ARGUMENT"},
    "garbage": {"REPLIED", "CLOSED", "SILENT", "RESET"},
}
# The same hostile mix over the OpenAI-compatible HTTP port (--protocol http or both).
HTTP_WEIGHTS = {"http_stream": 30, "http_complete": 15, "http_disconnect": 10, "http_invalid": 15, "http_malformed": 6,
                "http_garbage": 2, "http_burst": 0.3, "http_misc": 6}
HTTP_INVALID = ["temperature<0", "top_p>1", "top_k<-1", "min_p>1", "presence_penalty>2", "repetition_penalty=0",
                "seed<0", "max_tokens=0", "max_tokens<0", "n=0", "logprobs>max", "empty_prompt", "empty_token_ids",
                "prompt_too_long", "token_id=vocab", "token_id<0", "prompt+max_tokens>max_model_len",
                "too_many_stop_strings", "stop_string_too_long", "empty_stop_string", "logit_bias_too_many",
                "logit_bias_bad_id", "logit_bias_not_a_number", "prompt_logprobs>max", "max_tokens_wrong_type",
                "prompt_wrong_type", "stop_token_id>=vocab",
                "empty_messages", "messages_wrong_type", "message_without_role", "top_logprobs>max",
                "top_logprobs_without_logprobs", "missing_prompt", "missing_messages", "unknown_model", "unknown_route"]
HTTP_INVALID_CONSTRAINED = {  # variant -> the "param" of its 400's error object
    "response_format_bad_schema": "response_format", "response_format_bad_type": "response_format",
    "response_format_no_schema": "response_format", "guided_json_bad_schema_completions": "guided_json",
    "guided_regex_does_not_compile": "guided_regex", "structured_outputs_bad_regex": "structured_outputs",
    "lark_does_not_compile": "guided_grammar", "two_constraints": "response_format",
    "two_kinds_in_structured_outputs": "structured_outputs", "empty_choice_list": "structured_outputs",
    "tool_choice_unknown_tool": "tool_choice", "tool_choice_required_without_tools": "tool_choice",
    "tool_with_bad_schema": "tools",
}
HTTP_INVALID += list(HTTP_INVALID_CONSTRAINED)
HTTP_MALFORMED = ["not_json", "truncated", "empty_body", "json_array", "json_string", "json_null", "bad_utf8",
                  "nan_temperature", "deep_nesting", "random_bytes", "text_content_type"]
HTTP_GARBAGE = ["random_bytes", "bad_request_line", "huge_header", "bad_content_length", "short_body",
                "reset_mid_request"]
ALLOWED.update({  # HTTP statuses as strings; a 5xx is never allowed
    "http_stream": {"200", "429"}, "http_complete": {"200", "429"}, "http_burst": {"200", "429"},
    "http_disconnect": {"DISCONNECTED", "200", "429"}, "http_invalid": {"400", "404"}, "http_malformed": {"400"},
    "http_garbage": {"REPLIED", "CLOSED", "SILENT", "RESET"}, "http_misc": {"200"},
})
# Constrained requests (structured output): about one well-formed stream in CONSTRAINED_SHARE carries one of
# these bounded constraints (the variant of its stream / http_stream / http_complete item). Each name gives the
# structured_outputs fields and the max_tokens at which a sampled answer ends (at most half the context).
SOAK_SCHEMA = {  # a nested object, an enum array with min/maxItems, an integer range, a short patterned string
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "t": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
        "s": {"type": "string", "maxLength": 3, "pattern": "^[a-z]*$"},
        "o": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"],
              "additionalProperties": False},
    },
    "required": ["n", "t", "s", "o"],
    "additionalProperties": False,
}
SOAK_REGEX = r"(yes|no)-[0-9]{1,3}"
SOAK_CHOICES = ["red", "green, dark", "日本", "blue"]
SOAK_LARK = 'start: greeting " " NAME\ngreeting: "hi" | "hello"\nNAME: /[a-z]{1,6}/\n'
SOAK_GBNF = 'root ::= ("yes" | "no") "!" [0-9]\n'
CONSTRAINTS = {  # name -> (StructuredOutputsParams' fields, max_tokens that lets a sampled answer end)
    "json_schema": ({"json": SOAK_SCHEMA}, 64), "json_object": ({"json_object": True}, 48),
    "regex": ({"regex": SOAK_REGEX}, 16), "choice": ({"choice": SOAK_CHOICES}, 16),
    "lark": ({"grammar": SOAK_LARK}, 16), "gbnf": ({"grammar": SOAK_GBNF}, 12),
}
SOAK_TOOLS = [  # tool_choice "required" / a named function (HTTP chat): the arguments validate against these
    {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: takes none
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
                for t in SOAK_TOOLS}
TOOL_CONSTRAINTS = {"tool_required": 64, "tool_named": 40}  # name -> max_tokens
CONSTRAINED_SHARE = 6  # one well-formed stream in six carries a constraint
GRPC_CONSTRAINED = list(CONSTRAINTS)
HTTP_CONSTRAINED = list(CONSTRAINTS) + list(TOOL_CONSTRAINTS)
CONSTRAINED_KINDS = ("stream", "http_stream", "http_complete")
# Constraints that do not compile (or cannot be sent): INVALID_ARGUMENT / 400 whose message names the field.
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}
VARIANT_KINDS = ("invalid", "malformed", "garbage", "http_invalid", "http_malformed", "http_garbage", "http_misc",
                 "http_disconnect")
WORDS = ["hello", "world", "token", "jax", "page", "cache", "the", "KV", "naïve", "café", "日本", "語", "🙂",
         "stream", "\n", "  ", "<|im_end|>", "engine"]
KILL_CHILD = """
import sys, grpc
call = grpc.insecure_channel(sys.argv[1]).unary_stream(sys.argv[2])(bytes.fromhex(sys.argv[3]), timeout=600)
try:
    for _ in call:
        print("FIRST", flush=True)
        sys.stdin.read()  # hold the stream open until SIGKILLed
    print("END", flush=True)
except grpc.RpcError as e:
    print("ERR", e.code().name, flush=True)
"""


async def _sse_lines(response):
    """The lines of a Server-Sent Events body, ended by LF or CRLF only: httpx's ``aiter_lines`` also ends a line
    at U+2028, U+2029 and U+0085, which JSON leaves raw inside a string (a sampled token may spell one)."""
    rest = b""
    async for data in response.aiter_bytes():
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8")
    if rest:
        yield rest.rstrip(b"\r").decode("utf-8")


def _text(rng: random.Random, max_bytes: int) -> str:
    out = ""
    for _ in range(rng.randint(1, 60)):
        w = rng.choice(WORDS) + rng.choice(" ,.")
        if len((out + w).encode()) > max_bytes:
            break
        out += w
    return out or "hi"


_TEXT_CHECKS = {  # a finished answer's text under each constraint (JSON: `_json_bad`)
    "regex": lambda t: re.fullmatch(SOAK_REGEX, t) is not None, "choice": lambda t: t in SOAK_CHOICES,
    "lark": lambda t: re.fullmatch(r"(hi|hello) [a-z]{1,6}", t) is not None,
    "gbnf": lambda t: re.fullmatch(r"(yes|no)![0-9]", t) is not None,
}


def _json_bad(text: str, schema: Optional[dict]) -> Optional[str]:
    """What is wrong with `text` as one JSON value that `schema` validates (None: any object); None when fine.
    Without the jsonschema package (the test extra) the value is only parsed."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e}): {text!r}"
    if schema is None:
        return None if isinstance(value, dict) else f"not a JSON object: {text!r}"
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"{text!r} does not validate: {e.message}"
    return None


def constraint_bad(name: str, body: Optional[dict], text: str, finish, error, calls) -> Optional[str]:
    """What is wrong with one finished answer of a request under constraint `name` (None: nothing).

    "stop" (or "tool_calls" for a forced call): the text validates against the schema, matches the regex or
    the grammar, is one of the choices; a forced call's arguments validate against its tool's schema.
    "length": allowed, the answer may be incomplete. "error": allowed only with its reason. `body`/`calls`:
    the HTTP request and the choice's tool calls [(name, arguments)].
    """
    if finish == "error":
        return None if isinstance(error, str) and error.strip() else f"finish_reason error without a reason ({error!r})"
    if finish == "length":
        return None
    if name in TOOL_CONSTRAINTS:
        if finish != "tool_calls":
            return f"finish_reason {finish!r}: a forced call ends with tool_calls"
        if not calls or text:
            return f"{len(calls or ())} tool calls and content {text!r}"
        choice = (body or {}).get("tool_choice")
        named = choice["function"]["name"] if isinstance(choice, dict) else None
        if (named or (body or {}).get("parallel_tool_calls") is False) and len(calls) != 1:
            return f"{len(calls)} calls where one was forced: {calls}"
        for fn, arguments in calls:
            if fn not in TOOL_SCHEMAS or (named is not None and fn != named):
                return f"a call of {fn!r} (tool_choice {json.dumps(choice)})"
            bad = _json_bad(arguments, TOOL_SCHEMAS[fn])
            if bad:
                return f"{fn} arguments: {bad}"
        return None
    if finish != "stop":
        return f"finish_reason {finish!r}"
    if name in ("json_schema", "json_object"):
        return _json_bad(text, SOAK_SCHEMA if name == "json_schema" else None)
    return None if _TEXT_CHECKS[name](text) else f"{text!r} is not what the {name} allows"


class Soak:
    def __init__(self, args, address: str, pid, http_url=None):
        self.args, self.address, self.pid, self.http_url = args, address, pid, http_url
        self.protocol = getattr(args, "protocol", "grpc")
        self.http = None
        self.http_ttft: list = []
        self.http_gaps: list = []
        self.counts: dict = defaultdict(Counter)  # "kind" or "kind/variant" -> status -> n
        self.notes: list = []  # first few details of unexpected outcomes
        self.ttft: list = []
        self.gaps: list = []
        self.rss = {"ready": None, "before": None, "after": None, "peak": None}  # MiB; before: the load
        self.retries = 0  # invalid and kill calls refused by a full server before it read them, sent again
        self.stats: dict = {}  # the engine's live numbers after the run
        self.constrained_outcomes: Counter = Counter()  # finish reasons of constrained answers that passed

    # -- setup ----------------------------------------------------------------

    async def connect(self) -> None:
        self.clients = [AsyncClient(self.address) for _ in range(4)]
        self.raw = grpc.aio.insecure_channel(self.address).unary_stream(GENERATE)
        self.info = await self.clients[0].model_info(timeout=60)
        i = self.info
        self.vocab, self.room, self.max_lp = i["vocab_size"], i["max_model_len"], i["max_logprobs"]
        self.forms = ["token_ids"] + ["prompt"] * i["has_tokenizer"] + ["chat"] * i["has_chat_template"]
        self.prompt_base, self.chat_base = 0, {}
        if i["has_tokenizer"]:  # template overheads in tokens, so text prompts never overflow the context
            self.prompt_base = (await self.clients[0].tokenize("x"))["count"] + 2
        if i["has_chat_template"]:
            for n in (1, 2, 3):
                msgs = [{"role": "assistant", "content": ""}] * n
                self.chat_base[n] = (await self.clients[0].tokenize(msgs))["count"] + 2 * n + 2

    def plan(self) -> list:
        """(kind, variant, seed) per item: a function of --seed, --requests and the server's sizes."""
        rng = random.Random(self.args.seed)
        protocol = getattr(self.args, "protocol", "grpc")
        weights = {**(WEIGHTS if protocol in ("grpc", "both") else {}),
                   **(HTTP_WEIGHTS if protocol in ("http", "both") else {})}
        filler = "stream" if "stream" in weights else "http_stream"
        kinds = [k for k in weights if k not in ("burst", "http_burst") or self.info["max_waiting"] >= 0]
        items = rng.choices(kinds, [weights[k] for k in kinds], k=self.args.requests)
        for k in kinds:  # every kind at least once
            if k not in items and items.count(filler) > 1:
                items[rng.choice([j for j, x in enumerate(items) if x == filler])] = k
        seen: Counter = Counter()
        lists = {"invalid": INVALID, "malformed": MALFORMED, "garbage": GARBAGE, "cancel": ["after_tokens", "timer"],
                 "health": ["overall", "generation", "unknown_service"], "tokenize": self.forms[1:] or ["prompt"],
                 "http_invalid": HTTP_INVALID, "http_malformed": HTTP_MALFORMED, "http_garbage": HTTP_GARBAGE,
                 "http_disconnect": ["after_chunks", "timer", "reset"],
                 "http_misc": ["models", "health", "metrics", "tokenize", "detokenize"]}
        offset = {k: rng.randrange(len(v)) for k, v in lists.items()}
        # about one well-formed stream in CONSTRAINED_SHARE carries a constraint (its variant), each in turn;
        # none without a tokenizer (only token ids), no forced tool calls without a chat template
        constrained = {"stream": GRPC_CONSTRAINED, "http_stream": HTTP_CONSTRAINED, "http_complete": HTTP_CONSTRAINED}
        if len(self.forms) < 2:
            constrained = {}
        elif "chat" not in self.forms:
            constrained = {k: [c for c in v if c not in TOOL_CONSTRAINTS] for k, v in constrained.items()}
        c_offset, c_seen = {k: rng.randrange(len(v)) for k, v in constrained.items()}, Counter()
        out = []
        for k in items:
            if k in constrained and rng.random() < 1 / CONSTRAINED_SHARE:
                variant = constrained[k][(c_offset[k] + c_seen[k]) % len(constrained[k])]
                c_seen[k] += 1
            else:
                variant = lists[k][(offset[k] + seen[k]) % len(lists[k])] if k in lists else ""
                seen[k] += 1
            out.append((k, variant, rng.getrandbits(48)))
        return out

    # -- requests -------------------------------------------------------------

    def wellformed(self, rng: random.Random, long: bool = False, max_tokens: Optional[int] = None,
                   form: Optional[str] = None):
        """(prompt, sampling kwargs) of a valid request of random form and length (or the given ones)."""
        cap = self.args.max_tokens
        if max_tokens is None:
            max_tokens = min(cap, self.room // 2) if long else rng.randint(1, max(1, min(cap, self.room // 2)))
        budget = min(self.room - max_tokens, self.args.max_prompt_len)
        form = form or rng.choice(self.forms)
        n = rng.randint(1, 3)
        if form == "chat" and budget - self.chat_base[n] >= 4 * n:
            roles = (["system"] if rng.random() < 0.3 else []) + ["user", "assistant"] * 2
            each = (budget - self.chat_base[n]) // n
            prompt = [{"role": r, "content": _text(rng, each)} for r in roles[:n - 1] + ["user"]]
        elif form != "token_ids" and budget - self.prompt_base >= 4:
            prompt = _text(rng, budget - self.prompt_base)
        else:
            prompt = [rng.randrange(self.vocab) for _ in range(rng.randint(1, budget))]
        kw = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.5 or long}
        maybe = {
            "temperature": lambda: rng.choice([0.0, 0.3, 0.8, 1.0, 1.7]), "top_k": lambda: rng.choice(
                [0, -1, 1, 5, 50, self.vocab]), "top_p": lambda: rng.choice([0.05, 0.5, 0.9, 1.0]),
            "min_p": lambda: rng.choice([0.0, 0.05, 0.5, 1.0]), "presence_penalty": lambda: rng.uniform(-2, 2),
            "frequency_penalty": lambda: rng.uniform(-2, 2), "repetition_penalty": lambda: rng.choice(
                [0.5, 1.0, 1.2, 2.0, 100.0]), "seed": lambda: rng.choice([0, 2**32 - 1, rng.getrandbits(32)]),
            "min_tokens": lambda: rng.randint(0, max_tokens), "logprobs": lambda: rng.choice([0, 1, self.max_lp]),
            "stop_token_ids": lambda: [rng.randrange(self.vocab) for _ in range(rng.randint(1, 3))],
            "skip_special_tokens": lambda: rng.random() < 0.5, "include_stop_str_in_output": lambda: rng.random() < 0.5,
        }
        if self.info["has_tokenizer"]:
            maybe["stop"] = lambda: [rng.choice(WORDS + ["e", "o", "a "]) for _ in range(rng.randint(1, 4))]
        for name, value in maybe.items():
            if rng.random() < 0.4:
                kw[name] = value()
        return prompt, kw

    def constrained(self, rng: random.Random, name: str):
        """(prompt, sampling kwargs) of a well-formed request to run under constraint `name`: the constraint's own
        max_tokens (at most half the context), no stop strings or stop ids (they would cut the answer short of
        the grammar's end), and min_tokens only now and then (past the grammar's shortest end it makes the
        request end with finish_reason error). gRPC's structured_outputs is set here; HTTP's fields in
        `http_constraint`."""
        need = CONSTRAINTS[name][1] if name in CONSTRAINTS else TOOL_CONSTRAINTS[name]
        tools = name in TOOL_CONSTRAINTS
        prompt, kw = self.wellformed(rng, max_tokens=max(1, min(need, self.room // 2)), form="chat" if tools else None)
        if tools and not (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            prompt = [{"role": "user", "content": "hi"}]  # a context too small for a random chat
        for k in ("stop", "stop_token_ids"):
            kw.pop(k, None)
        if "min_tokens" in kw and rng.random() < 2 / 3:
            del kw["min_tokens"]
        if not tools:
            fields = dict(CONSTRAINTS[name][0])
            if name == "json_schema" and rng.random() < 0.25:  # whitespace on request: one space or none
                fields.update(disable_any_whitespace=False, whitespace_pattern=" ?")
            kw["structured_outputs"] = fields
        return prompt, kw

    async def stream(self, client, prompt, kw, timeout, stop_after=None, measure=False, constraint=None,
                     word=None) -> str:
        """One Generate stream's status ("OK", a gRPC code, "BAD_OUTPUT"); `constraint`: the CONSTRAINTS name
        its answer must satisfy; `word`: what an INVALID_ARGUMENT's message must name."""
        t0 = last = time.perf_counter()
        n, text, lps, tops, final = 0, "", 0, set(), None
        agen = client.generate(prompt, timeout=timeout, **kw)
        try:
            async for p in agen:
                if p.token_ids:
                    now = time.perf_counter()
                    if measure:
                        (self.gaps if n else self.ttft).append(now - (last if n else t0))
                    last, n = now, n + len(p.token_ids)
                text += p.text
                lps += len(p.logprobs or ())
                tops.update(len(lp.top) for lp in p.logprobs or ())
                final = p if p.finished else final
                if stop_after is not None and n >= stop_after and not p.finished:
                    return "CANCELLED"
        except ServerError as e:
            return self.named(e.code.name, e.details, word)
        finally:
            await agen.aclose()
        bad = self.bad_output(kw, n, text, lps, tops, final, constraint)
        if bad:
            self.notes.append(f"stream output{f' ({constraint})' if constraint else ''}: {bad} (request {kw})"[:600])
            return "BAD_OUTPUT"
        if constraint:
            self.constrained_outcomes[final.finish_reason] += 1
        return "OK"

    def named(self, status: str, details, word) -> str:
        """`status`, or INVALID_ARGUMENT_UNNAMED when an INVALID_ARGUMENT's message does not name `word`."""
        if word and status == "INVALID_ARGUMENT" and word not in (details or ""):
            self.notes.append(f"INVALID_ARGUMENT without {word!r} in its message: {details!r}"[:400])
            return "INVALID_ARGUMENT_UNNAMED"
        return status

    @staticmethod
    def bad_output(kw, n, text, lps, tops, final, constraint=None):
        if final is None or final.finish_reason not in ("stop", "length", "error"):
            return f"finish_reason {final and final.finish_reason}"
        if final.finish_reason == "error" and not constraint:
            return f"finish_reason error ({final.error!r}) without a constraint"
        why, stops = final.stop_reason, kw.get("stop", [])
        if final.usage["completion_tokens"] != n or n > kw["max_tokens"]:
            return f"{n} tokens streamed, usage {final.usage}, max_tokens {kw['max_tokens']}"
        if final.finish_reason == "length" and n != kw["max_tokens"]:
            return f"finished by length after {n} of {kw['max_tokens']} tokens"
        if kw.get("logprobs") is not None and (lps != n or tops - {kw["logprobs"]}):
            return f"logprobs={kw['logprobs']}: {lps} entries for {n} tokens, top sizes {sorted(tops)}"
        include = bool(kw.get("include_stop_str_in_output"))
        if isinstance(why, str) and (why not in stops or include != text.endswith(why)):
            return f"stop string {why!r}, text {text!r}"
        if not include and any(s in text for s in stops):
            return f"a stop string of {stops} is in the text {text!r}"
        if final.finish_reason == "stop" and not isinstance(why, str) and n < kw.get("min_tokens", 0):
            return f"stopped by a token after {n} < min_tokens={kw['min_tokens']} tokens"
        if constraint:
            return constraint_bad(constraint, None, text, final.finish_reason, final.error, None)
        return None

    def invalid(self, variant: str, rng: random.Random):
        prompt, kw = [rng.randrange(self.vocab) for _ in range(rng.randint(1, 8))], {"max_tokens": 4}
        big, too_long = self.room + rng.randint(1, 64), "x" * 257
        change = {
            "temperature<0": {"temperature": -rng.uniform(0.01, 5)}, "temperature=nan": {"temperature": float("nan")},
            "top_p=0": {"top_p": 0.0}, "top_p>1": {"top_p": 1.5}, "top_k<-1": {"top_k": -2},
            "top_k>vocab": {"top_k": self.vocab + 1}, "min_p>1": {"min_p": 1.5},
            "presence_penalty>2": {"presence_penalty": 2.5}, "frequency_penalty<-2": {"frequency_penalty": -2.5},
            "repetition_penalty=0": {"repetition_penalty": 0.0},
            "repetition_penalty>100": {"repetition_penalty": 101.0},
            "seed<0": {"seed": -1}, "seed>=2^32": {"seed": 2**32}, "max_tokens=0": {"max_tokens": 0},
            "min_tokens>max_tokens": {"min_tokens": 5}, "min_tokens<0": {"min_tokens": -1},
            "logprobs>max": {"logprobs": self.max_lp + 1}, "logprobs<0": {"logprobs": -1},
            "prompt+max_tokens>max_model_len": {"max_tokens": self.room},
            "stop_token_id>=vocab": {"stop_token_ids": [self.vocab]}, "empty_stop_string": {"stop": [""]},
            "too_many_stop_strings": {"stop": [f"s{i}" for i in range(rng.randint(64, 4096))]},
            "stop_string_too_long": {"stop": [too_long]},
            "too_many_stop_token_ids": {"stop_token_ids": [rng.randrange(self.vocab) for _ in range(256)]},
        }.get(variant, {})
        kw.update(change)
        prompt = {"empty_token_ids": [], "prompt_too_long": [1] * big, "token_id=vocab": prompt + [self.vocab],
                  "token_id<0": [-1] + prompt, "empty_prompt": "", "empty_chat": pb.ChatInput(),
                  "empty_chat_role": [{"role": "", "content": "hi"}], "reserved_template_kwarg": [
                      {"role": "user", "content": "hi"}]}.get(variant, prompt)
        if variant == "reserved_template_kwarg":
            kw["chat_template_kwargs"] = {"add_generation_prompt": False}
        if variant in INVALID_CONSTRAINED:  # a constraint that does not compile, or one the client will not send
            sop = {"json_schema_does_not_compile": {"json": BAD_SCHEMA},
                   "json_schema_unsatisfiable": {"json": {"type": "integer", "minimum": 5, "maximum": 1}},
                   "regex_does_not_compile": {"regex": rng.choice(["a(b", "[z-a]"])},
                   "lark_does_not_compile": {"grammar": "start: missing_rule\n"},
                   "gbnf_does_not_compile": {"grammar": "root ::= missing_rule\n"}}.get(variant)
            if sop is not None:
                return (prompt, dict(kw, structured_outputs=sop)), None
            req = generate_request(prompt, **kw)
            if variant == "json_schema_not_json":
                req.sampling.json_schema = "{not json"
            elif variant == "empty_choice_list":
                req.sampling.choice.SetInParent()
            elif variant == "json_object_false":
                req.sampling.json_object = False
            else:  # whitespace_without_json
                req.sampling.flexible_whitespace = True
            return None, req.SerializeToString()
        if variant == "no_input":
            return None, pb.GenerateRequest(sampling=pb.SamplingOptions(max_tokens=4)).SerializeToString()
        return (prompt, kw), None

    def malformed(self, variant: str, rng: random.Random) -> bytes:
        good = generate_request(list(range(1, 40)), max_tokens=4, stop=["abc"]).SerializeToString()
        for _ in range(1000):
            data = {
                "random_bytes": lambda: rng.randbytes(rng.randint(1, 64)),
                "truncated": lambda: good[:rng.randint(1, len(good) - 1)],
                "bad_utf8_prompt": lambda: b"\x0a\x03\xff" + rng.randbytes(2),
                "bad_utf8_chat_role": lambda: b"\x12\x05\x0a\x03\x0a\x01\xfe",
                "bad_varint": lambda: b"\x20" + b"\xff" * rng.randint(11, 20),
                "length_past_end": lambda: b"\x12\xff\xff\xff\xff\x0f" + rng.randbytes(4),
                "stray_end_group": lambda: good[:2] + b"\x0c",
            }[variant]()
            try:
                pb.GenerateRequest.FromString(data)
            except Exception:  # noqa: BLE001 - what we want: bytes that do not parse
                return data
        return b"\xff" * 11

    async def one(self, kind: str, variant: str, seed: int, i: int) -> None:
        rng = random.Random(seed)
        client = self.clients[i % len(self.clients)]
        try:
            if kind.startswith("http_"):
                status = await self.run_http(kind, variant, rng)
            else:
                status = await self.run_kind(kind, variant, rng, client)
        except ServerError as e:
            status = e.code.name
        except Exception as e:  # noqa: BLE001 - a failure of the soak itself is a result too
            status = "CLIENT_ERROR"
            self.notes.append(f"{kind}/{variant}: {type(e).__name__}: {e}")
        if status is not None:
            self.record(kind, variant, status)

    def record(self, kind: str, variant: str, status: str) -> None:
        key = f"{kind}/{variant}" if kind in VARIANT_KINDS or (variant and kind in CONSTRAINED_KINDS) else kind
        self.counts[key][status] += 1
        if status not in ALLOWED[kind] and len(self.notes) < 50:
            self.notes.append(f"{key}: got {status}")

    async def run_kind(self, kind, variant, rng, client) -> str:
        timeout = self.args.request_timeout
        if kind == "stream":
            prompt, kw = self.constrained(rng, variant) if variant else self.wellformed(rng)
            return await self.stream(client, prompt, kw, timeout, measure=True, constraint=variant or None)
        if kind == "cancel":
            prompt, kw = self.wellformed(rng, long=True)
            if variant == "after_tokens":
                return await self.stream(client, prompt, kw, timeout, stop_after=rng.randint(1, 4))
            task = asyncio.ensure_future(self.stream(client, prompt, kw, timeout))
            done, _ = await asyncio.wait({task}, timeout=rng.uniform(0, 0.05))
            if done:
                return task.result()
            task.cancel()
            try:
                return await task
            except asyncio.CancelledError:
                return "CANCELLED"
        if kind == "deadline":
            prompt, kw = self.wellformed(rng)
            return await self.stream(client, prompt, kw, rng.uniform(0.005, 0.05))
        if kind == "invalid":
            call, raw = self.invalid(variant, rng)
            word = INVALID_CONSTRAINED.get(variant)
            return await self.until_admitted(
                lambda: self.raw_call(raw, word) if raw is not None else self.stream(client, *call, timeout, word=word),
                0.02)
        if kind == "malformed":
            return await self.raw_call(self.malformed(variant, rng))
        if kind == "garbage":
            return await self.garbage(variant, rng)
        if kind == "kill":
            prompt = [rng.randrange(self.vocab) for _ in range(rng.randint(1, min(16, self.room - 1)))]
            kw = dict(self.wellformed(rng)[1], max_tokens=self.room - len(prompt), ignore_eos=True, min_tokens=0)
            return await self.until_admitted(lambda: self.kill(generate_request(prompt, **kw)), 0.1)
        if kind == "burst":
            n = 2 * (self.info["max_num_seqs"] + self.info["max_waiting"]) + 4
            calls = [self.stream(self.clients[j % 4], *self.wellformed(rng, long=True), timeout) for j in range(n)]
            for status in await asyncio.gather(*calls):
                self.record("burst", "", status)
            return None  # each call of the burst is recorded above
        if kind == "tokenize":
            if not self.info["has_tokenizer"]:
                try:
                    await client.tokenize("hello", timeout=timeout)
                except ServerError as e:
                    return "OK" if e.code.name == "FAILED_PRECONDITION" else e.code.name
            arg = _text(rng, 64) if variant == "prompt" else [{"role": "user", "content": _text(rng, 64)}]
            r = await client.tokenize(arg, timeout=timeout)
            return "OK" if r["count"] == len(r["token_ids"]) else "BAD_OUTPUT"
        if kind == "model_info":
            return "OK" if (await client.model_info(timeout=timeout))["max_model_len"] == self.room else "BAD_OUTPUT"
        service = {"overall": "", "generation": "jaxinfer.v1.Generation", "unknown_service": "no.such.Service"}
        try:
            serving = await client.health(service[variant], timeout=timeout)
        except ServerError as e:
            return "OK" if variant == "unknown_service" and e.code.name == "NOT_FOUND" else e.code.name
        return "OK" if serving == "SERVING" and variant != "unknown_service" else serving

    async def raw_call(self, data: bytes, word=None) -> str:
        try:
            async for _ in self.raw(data, timeout=self.args.request_timeout):
                pass
            return "OK"
        except grpc.RpcError as e:
            return self.named(e.code().name, e.details(), word)

    async def garbage(self, variant: str, rng: random.Random) -> str:
        host, port = self.address.rsplit(":", 1)
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        data = {"random_bytes": rng.randbytes(rng.randint(1, 4096)), "http1_get": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                "h2_preface_junk": preface + rng.randbytes(rng.randint(1, 512)),
                "h2_huge_frame": preface + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01" + rng.randbytes(64),
                "reset": preface}[variant]
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), 10)
        except OSError as e:
            return f"CONNECT_{type(e).__name__}"
        try:
            writer.write(data)
            await writer.drain()
            if variant == "reset":  # an abortive close: RST instead of FIN
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return "RESET"
            reply = await asyncio.wait_for(reader.read(65536), 2.0)
            return "REPLIED" if reply else "CLOSED"
        except asyncio.TimeoutError:
            return "SILENT"
        except ConnectionResetError:
            return "RESET"
        except ConnectionError:
            return "CLOSED"
        finally:
            writer.close()

    async def until_admitted(self, attempt, pause: float) -> str:
        """A full server refuses a call before reading it: send it again until the server reads it.

        Under a sustained overload a slot may take many seconds to free, so it keeps trying (backing
        off to half a second between tries) for up to --request-timeout seconds.
        """
        deadline = time.monotonic() + self.args.request_timeout
        while True:
            status = await attempt()
            if status not in ("RESOURCE_EXHAUSTED", "429") or time.monotonic() > deadline:
                return status
            self.retries += 1
            await asyncio.sleep(pause)
            pause = min(0.5, pause * 1.5)

    async def kill(self, req: pb.GenerateRequest) -> str:
        """A child process opens the stream and is SIGKILLed after its first message."""
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", KILL_CHILD, self.address, GENERATE, req.SerializeToString().hex(),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        try:
            line = (await asyncio.wait_for(child.stdout.readline(), self.args.request_timeout)).decode().split()
        except asyncio.TimeoutError:
            line = ["TIMEOUT"]
        try:
            child.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        await child.wait()
        return "KILLED" if line[:1] == ["FIRST"] else line[-1] if line else "CHILD_DIED"

    # -- HTTP (the OpenAI-compatible API) -------------------------------------

    async def connect_http(self) -> None:
        import httpx

        self.http = httpx.AsyncClient(
            base_url=self.http_url, timeout=httpx.Timeout(self.args.request_timeout, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        r = await self.http.get("/v1/models")
        r.raise_for_status()
        self.http_model = r.json()["data"][0]["id"]

    def http_body(self, prompt, kw: dict, stream: bool, rng: random.Random, n: int = 1) -> tuple:
        """(path, JSON body) of a gRPC-style (prompt, sampling kwargs): chat messages go to /v1/chat/completions,
        text and token ids to /v1/completions; logprobs in each endpoint's own form."""
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        body: dict = {"model": self.http_model, ("messages" if chat else "prompt"): prompt, "stream": stream}
        for name, value in kw.items():
            if name == "logprobs":
                if value is not None:
                    body.update({"logprobs": True, "top_logprobs": value} if chat else {"logprobs": value})
            else:
                body[name] = value
        if n != 1:
            body["n"] = n
        if stream and rng.random() < 0.7:
            body["stream_options"] = {"include_usage": True}
        return ("/v1/chat/completions" if chat else "/v1/completions"), body

    def http_constraint(self, name: str, body: dict, rng: random.Random) -> dict:
        """`body` with constraint `name` in one of the forms the API takes: response_format (json_schema,
        json_object), the structured_outputs extra (set from the sampling kwargs), vLLM's guided_* fields, or
        tools with tool_choice "required" / a named function."""
        if name in TOOL_CONSTRAINTS:
            body["tools"] = SOAK_TOOLS
            if name == "tool_named":
                body["tool_choice"] = {"type": "function", "function": {"name": rng.choice(list(TOOL_SCHEMAS))}}
            else:
                body["tool_choice"] = "required"
                if rng.random() < 0.75:  # else the array of calls may go on until max_tokens
                    body["parallel_tool_calls"] = False
            return body
        fields = body["structured_outputs"]
        (kind, value), = [(k, v) for k, v in fields.items() if k in ("json", "json_object", "regex", "choice",
                                                                      "grammar")]
        form = rng.choice(["structured_outputs", "guided", "response_format"])
        if len(fields) > 1 or form == "structured_outputs" or (form == "response_format" and kind not in (
                "json", "json_object")):
            return body  # structured_outputs: {...} as set from the sampling kwargs
        del body["structured_outputs"]
        if form == "response_format" and kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "soak", "schema": value, **({"strict": True} if rng.random() < 0.5 else {})}}
        elif form == "response_format" or kind == "json_object":
            body["response_format"] = {"type": "json_object"}
        else:
            body[f"guided_{kind}"] = json.dumps(value) if kind == "json" and rng.random() < 0.5 else value
        return body

    @staticmethod
    def _http_error_ok(r, expected: int, param: Optional[str] = None) -> str:
        """The status as a string when it is `expected` with an OpenAI error object (whose "param" is `param`,
        when given), else what is wrong."""
        try:
            err = r.json()["error"]
            shaped = isinstance(err.get("message"), str) and err["message"] and {"type", "param", "code"} <= set(err)
        except (ValueError, KeyError, TypeError, AttributeError):
            shaped = False
        if r.status_code == expected:
            if shaped and param is not None and err["param"] != param:
                return f"{expected}_PARAM_{err['param']}_NOT_{param}"
            return str(expected) if shaped else f"{expected}_NO_ERROR_OBJECT"
        return str(r.status_code) if r.status_code >= 500 or r.status_code in (200, 429) else \
            f"{r.status_code}_NOT_{expected}"

    async def http_call(self, prompt, kw: dict, stream: bool, rng: random.Random, n: int = 1,
                        stop_after=None, measure=False, constraint=None) -> str:
        """One well-formed call; its status ("200", "429", "DISCONNECTED"...), "BAD_OUTPUT" when the answer is wrong;
        `constraint`: the CONSTRAINTS / TOOL_CONSTRAINTS name its answer must satisfy."""
        path, body = self.http_body(prompt, kw, stream, rng, n)
        if constraint:
            body = self.http_constraint(constraint, body, rng)
        if not stream:
            r = await self.http.post(path, json=body)
            if r.status_code != 200:
                return str(r.status_code)
            bad = self.http_bad_whole(path, body, r.json(), constraint)
        else:
            t0 = last = time.perf_counter()
            chunks, done, got = [], False, 0
            async with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return str(r.status_code)
                async for line in _sse_lines(r):
                    if not line.startswith("data:"):
                        if line.strip() and not line.startswith(":"):
                            self.notes.append(f"{path}: a stream line that is not an SSE field: {line[:80]!r}")
                            return "BAD_OUTPUT"
                        continue
                    data = line[5:].strip()
                    if done:
                        self.notes.append(f"{path}: data after [DONE]: {data[:80]!r}")
                        return "BAD_OUTPUT"
                    if data == "[DONE]":
                        done = True
                        continue
                    chunk = json.loads(data)
                    chunks.append(chunk)
                    if any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices", ())):
                        now = time.perf_counter()
                        if measure:
                            (self.http_gaps if got else self.http_ttft).append(now - (last if got else t0))
                        last, got = now, got + 1
                        if stop_after is not None and got >= stop_after:
                            return "DISCONNECTED"  # leaving the block closes the connection mid-stream
            if not done:
                self.notes.append(f"{path}: the stream ended without data: [DONE]")
                return "BAD_OUTPUT"
            bad = self.http_bad_stream(path, body, chunks, constraint)
        if bad:
            self.notes.append(f"{path} {'stream' if stream else 'whole'}: {bad} (request {json.dumps(body)[:300]})")
            return "BAD_OUTPUT"
        return "200"

    def http_bad_choices(self, body: dict, choices: dict, usage, constraint=None) -> Optional[str]:
        """Checks shared by whole and streamed answers; `choices`: index -> (text, logprob entries or None,
        top sizes, finish_reason, stop_reason, tool calls [(name, arguments)], error)."""
        n, max_tokens, stops = body.get("n", 1), body["max_tokens"], body.get("stop", [])
        k = body.get("top_logprobs", body.get("logprobs")) if body.get("logprobs") is not None else None
        if sorted(choices) != list(range(n)):
            return f"choices {sorted(choices)} for n={n}"
        include = bool(body.get("include_stop_str_in_output"))
        counted = 0
        for i, (text, lps, tops, finish, why, calls, error) in choices.items():
            if finish not in ("stop", "length") and not (constraint and finish in ("error", "tool_calls")):
                return f"choice {i}: finish_reason {finish!r}" + (f" ({error})" if error else "")
            if calls and constraint not in TOOL_CONSTRAINTS:
                return f"choice {i}: tool calls {calls} without a forced call"
            if constraint:
                bad = constraint_bad(constraint, body, text, finish, error, calls)
                if bad:
                    return f"choice {i} ({constraint}): {bad}"
            if k is not None:
                counted += lps
                if lps > max_tokens or (finish == "length" and lps != max_tokens):
                    return f"choice {i}: {lps} logprob entries, finish {finish}, max_tokens {max_tokens}"
                chat_k = "top_logprobs" in body
                if tops and (tops != {k} if chat_k else (max(tops) > k or (k and min(tops) < 1))):
                    return f"choice {i}: top logprob sizes {sorted(tops)} for {k}"
            if isinstance(why, str) and (why not in stops or include != text.endswith(why)):
                return f"choice {i}: stop_reason {why!r}, text {text!r}"
            if not include and any(s in text for s in stops):
                return f"choice {i}: a stop string of {stops} is in the text {text!r}"
        if usage is not None:
            total = usage.get("completion_tokens")
            if usage.get("prompt_tokens", 0) + (total or 0) != usage.get("total_tokens") or total is None:
                return f"usage {usage}"
            if total > n * max_tokens or (k is not None and total != counted):
                return f"usage {usage} for n={n}, max_tokens {max_tokens}, {counted} logprob entries"
            if all(c[3] == "length" for c in choices.values()) and total != n * max_tokens:
                return f"usage {usage}: every choice finished by length, n={n}, max_tokens {max_tokens}"
        if constraint:
            self.constrained_outcomes.update(c[3] for c in choices.values())
        return None

    def http_bad_whole(self, path: str, body: dict, data: dict, constraint=None) -> Optional[str]:
        chat = path.endswith("chat/completions")
        if data.get("object") != ("chat.completion" if chat else "text_completion") or data.get("model") != \
                self.http_model:
            return f"object {data.get('object')!r}, model {data.get('model')!r}"
        choices = {}
        for c in data.get("choices", ()):
            text = (c.get("message") or {}).get("content") if chat else c.get("text")
            lp = c.get("logprobs")
            if chat:
                entries = (lp or {}).get("content") or []
                tops = {len(e["top_logprobs"]) for e in entries}
            else:
                entries = (lp or {}).get("tokens") or []
                tops = {len(t or {}) for t in (lp or {}).get("top_logprobs") or []}
            calls = [(tc["function"]["name"], tc["function"]["arguments"])
                     for tc in (c.get("message") or {}).get("tool_calls") or ()]
            choices[c["index"]] = (text or "", len(entries) if lp is not None else 0, tops, c.get("finish_reason"),
                                   c.get("stop_reason"), calls, c.get("error"))
            if body.get("logprobs") is not None and body.get("logprobs") is not False and lp is None:
                return f"choice {c['index']}: no logprobs"
        return self.http_bad_choices(body, choices, data.get("usage"), constraint)

    def http_bad_stream(self, path: str, body: dict, chunks: list, constraint=None) -> Optional[str]:
        chat = path.endswith("chat/completions")
        kind = "chat.completion.chunk" if chat else "text_completion"
        ids = {c.get("id") for c in chunks}
        if len(ids) != 1 or any(c.get("object") != kind or c.get("model") != self.http_model for c in chunks):
            return f"chunk ids {sorted(map(str, ids))[:3]}, objects {sorted({str(c.get('object')) for c in chunks})}"
        acc: dict = {}
        calls: dict = defaultdict(dict)  # choice -> call index -> [name, arguments so far]
        usage, want_usage = None, bool((body.get("stream_options") or {}).get("include_usage"))
        for j, c in enumerate(chunks):
            if c.get("usage") is not None:
                if c.get("choices") or j != len(chunks) - 1:
                    return "the usage chunk is not the last one, or has choices"
                usage = c["usage"]
            for ch in c.get("choices", ()):
                i = ch["index"]
                text, lps, tops, finish, why, _, error = acc.get(i, ("", 0, set(), None, None, None, None))
                if finish is not None:
                    return f"choice {i}: a chunk after its finish_reason"
                if chat:
                    delta = ch.get("delta") or {}
                    if i not in acc and delta.get("role") != "assistant":
                        return f"choice {i}: the first delta has no role: {delta}"
                    text += delta.get("content") or ""
                    for tc in delta.get("tool_calls") or ():  # the id and name first, then pieces of arguments
                        fn = tc.get("function") or {}
                        if tc["index"] not in calls[i]:
                            if not tc.get("id") or not fn.get("name"):
                                return f"choice {i}: a tool call opens without its id and name: {tc}"
                            calls[i][tc["index"]] = [fn["name"], ""]
                        calls[i][tc["index"]][1] += fn.get("arguments") or ""
                    entries = (ch.get("logprobs") or {}).get("content") or []
                    tops |= {len(e["top_logprobs"]) for e in entries}
                else:
                    text += ch.get("text") or ""
                    lp = ch.get("logprobs") or {}
                    entries = lp.get("tokens") or []
                    tops |= {len(t or {}) for t in lp.get("top_logprobs") or []}
                acc[i] = (text, lps + len(entries), tops, ch.get("finish_reason"), ch.get("stop_reason") or why,
                          [tuple(calls[i][j]) for j in sorted(calls[i])], ch.get("error") or error)
        if want_usage and usage is None:
            return "include_usage without a usage chunk"
        return self.http_bad_choices(body, acc, usage, constraint)

    def http_invalid(self, variant: str, rng: random.Random) -> tuple:
        """(path, raw body bytes, expected status) of a request that must be refused."""
        ids = [rng.randrange(self.vocab) for _ in range(rng.randint(1, 8))]
        comp = {"model": self.http_model, "prompt": ids, "max_tokens": 4}
        chat = {"model": self.http_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        big = self.room + rng.randint(1, 64)
        path, body, status = "/v1/completions", dict(comp), 400
        change = {
            "temperature<0": {"temperature": -rng.uniform(0.01, 5)}, "top_p>1": {"top_p": 1.5},
            "top_k<-1": {"top_k": -2}, "min_p>1": {"min_p": 1.5}, "presence_penalty>2": {"presence_penalty": 2.5},
            "repetition_penalty=0": {"repetition_penalty": 0.0}, "seed<0": {"seed": -1},
            "max_tokens=0": {"max_tokens": 0}, "max_tokens<0": {"max_tokens": -5}, "n=0": {"n": 0},
            "logprobs>max": {"logprobs": self.max_lp + 1}, "empty_prompt": {"prompt": ""},
            "empty_token_ids": {"prompt": []}, "prompt_too_long": {"prompt": [1] * big},
            "token_id=vocab": {"prompt": ids + [self.vocab]}, "token_id<0": {"prompt": [-1] + ids},
            "prompt+max_tokens>max_model_len": {"max_tokens": self.room},
            "too_many_stop_strings": {"stop": [f"s{i}" for i in range(rng.randint(64, 512))]},
            "stop_string_too_long": {"stop": ["x" * 257]}, "empty_stop_string": {"stop": [""]},
            "logit_bias_too_many": {"logit_bias": {str(i % self.vocab): 1.0 for i in range(301)}},
            "logit_bias_bad_id": {"logit_bias": {str(self.vocab): 1.0}},
            "logit_bias_not_a_number": {"logit_bias": {"x": 1.0}},
            "response_format_completions": {"response_format": {"type": "json_object"}},
            "prompt_logprobs>max": {"prompt_logprobs": self.max_lp + 1},
            "max_tokens_wrong_type": {"max_tokens": "ten"}, "prompt_wrong_type": {"prompt": {"text": "hi"}},
            "stop_token_id>=vocab": {"stop_token_ids": [self.vocab]},
            # constraints that do not compile, or clash (HTTP_INVALID_CONSTRAINED names the param of each)
            "guided_json_bad_schema_completions": {"guided_json": BAD_SCHEMA},
            "guided_regex_does_not_compile": {"guided_regex": rng.choice(["a(b", "[z-a]"])},
            "lark_does_not_compile": {"guided_grammar": "start: missing_rule\n"},
            "two_kinds_in_structured_outputs": {"structured_outputs": {"choice": ["a"], "grammar": 'start: "a"\n'}},
        }
        fly = {"type": "function", "function": {"name": "fly"}}
        chat_change = {
            "empty_messages": {"messages": []}, "messages_wrong_type": {"messages": "hi"},
            "message_without_role": {"messages": [{"content": "hi"}]},
            "top_logprobs>max": {"logprobs": True, "top_logprobs": self.max_lp + 1},
            "top_logprobs_without_logprobs": {"top_logprobs": 1},
            "response_format_bad_schema": {"response_format": {"type": "json_schema", "json_schema": {
                "name": "bad", "schema": BAD_SCHEMA}}},
            "response_format_bad_type": {"response_format": {"type": "xml"}},
            "response_format_no_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "structured_outputs_bad_regex": {"structured_outputs": {"regex": "[z-a]"}},
            "two_constraints": {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "empty_choice_list": {"structured_outputs": {"choice": []}},
            "tool_choice_unknown_tool": {"tools": SOAK_TOOLS, "tool_choice": fly},
            "tool_choice_required_without_tools": {"tool_choice": "required"},
            "tool_with_bad_schema": {"tool_choice": "required", "tools": [
                {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
        }
        if variant in change:
            body.update(change[variant])
        elif variant in chat_change:
            path, body = "/v1/chat/completions", dict(chat, **chat_change[variant])
        elif variant == "missing_prompt":
            body.pop("prompt")
        elif variant == "missing_messages":
            path, body = "/v1/chat/completions", {"model": self.http_model}
        elif variant == "unknown_model":
            body["model"], status = "no-such-model", 404
        elif variant == "unknown_route":
            path, status = "/v1/no-such-endpoint", 404
        if variant in ("empty_prompt",) and not self.info["has_tokenizer"]:
            body["prompt"] = []
        if rng.random() < 0.3 and variant not in ("unknown_route",):
            body["stream"] = True  # refused before the stream starts, all the same
        return path, json.dumps(body).encode(), status

    def http_malformed(self, variant: str, rng: random.Random) -> tuple:
        """(path, raw bytes, content type) of a body that is not a request at all: always a 400."""
        good = json.dumps({"model": self.http_model, "prompt": [1, 2, 3], "max_tokens": 2}).encode()
        data = {
            "not_json": lambda: b"{hello: " + rng.randbytes(rng.randint(0, 16)),
            "truncated": lambda: good[:rng.randint(1, len(good) - 1)],
            "empty_body": lambda: b"",
            "json_array": lambda: b"[1, 2, 3]",
            "json_string": lambda: b'"hello"',
            "json_null": lambda: b"null",
            "bad_utf8": lambda: b'{"model": "m", "prompt": "\xff\xfe", "max_tokens": 2}',
            "nan_temperature": lambda: good[:-1] + b', "temperature": NaN}',
            "deep_nesting": lambda: b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "random_bytes": lambda: rng.randbytes(rng.randint(1, 256)),
            "text_content_type": lambda: good,
        }[variant]()
        ctype = "text/plain" if variant == "text_content_type" else "application/json"
        return rng.choice(["/v1/completions", "/v1/chat/completions"]), data, ctype

    async def http_garbage(self, variant: str, rng: random.Random) -> str:
        """Raw bytes on the HTTP port: the server may answer (never a 5xx), close or ignore them."""
        from urllib.parse import urlsplit

        u = urlsplit(self.http_url)
        data = {"random_bytes": rng.randbytes(rng.randint(1, 4096)),
                "bad_request_line": b"HELLO WORLD\r\n\r\n",
                "huge_header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
                "bad_content_length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                "short_body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 1000\r\n\r\n{\"prompt\": ",
                "reset_mid_request": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"}[variant]
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port), 10)
        except OSError as e:
            return f"CONNECT_{type(e).__name__}"
        try:
            writer.write(data)
            await writer.drain()
            if variant == "reset_mid_request":
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return "RESET"
            if variant == "short_body":
                writer.write_eof()
            reply = await asyncio.wait_for(reader.read(65536), 2.0)
            if reply.startswith(b"HTTP/1.1 5") or reply.startswith(b"HTTP/1.0 5"):
                return "REPLIED_5xx"
            return "REPLIED" if reply else "CLOSED"
        except asyncio.TimeoutError:
            return "SILENT"
        except ConnectionResetError:
            return "RESET"
        except ConnectionError:
            return "CLOSED"
        finally:
            writer.close()

    async def http_reset_stream(self, prompt, kw, rng) -> str:
        """A stream read to its first data line over a raw socket, then an abortive close (RST)."""
        from urllib.parse import urlsplit

        u = urlsplit(self.http_url)
        path, body = self.http_body(prompt, kw, True, rng)
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port), 10)
        try:
            writer.write(head + payload)
            await writer.drain()
            status = (await asyncio.wait_for(reader.readline(), self.args.request_timeout)).split()
            if status[1:2] != [b"200"]:
                return status[1].decode() if len(status) > 1 else "CLOSED"
            while True:
                line = await asyncio.wait_for(reader.readline(), self.args.request_timeout)
                if not line:
                    return "CLOSED"
                if line.startswith(b"data:"):
                    break
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return "DISCONNECTED"
        finally:
            writer.close()

    async def run_http(self, kind: str, variant: str, rng: random.Random) -> Optional[str]:
        if kind in ("http_stream", "http_complete"):
            prompt, kw = self.constrained(rng, variant) if variant else self.wellformed(rng)
            n = rng.choice([1, 1, 1, 2, 3])
            return await self.http_call(prompt, kw, kind == "http_stream", rng, n, measure=n == 1,
                                        constraint=variant or None)
        if kind == "http_disconnect":
            prompt, kw = self.wellformed(rng, long=True)
            if variant == "after_chunks":
                return await self.http_call(prompt, kw, True, rng, rng.choice([1, 2]), stop_after=rng.randint(1, 4))
            if variant == "reset":
                return await self.until_admitted(lambda: self.http_reset_stream(prompt, kw, rng), 0.05)
            task = asyncio.ensure_future(self.http_call(prompt, kw, True, rng))  # timer: maybe before the headers
            done, _ = await asyncio.wait({task}, timeout=rng.uniform(0, 0.05))
            if done:
                return task.result()
            task.cancel()
            try:
                return await task
            except asyncio.CancelledError:
                return "DISCONNECTED"
        if kind == "http_invalid":
            path, data, status = self.http_invalid(variant, rng)

            async def attempt():
                r = await self.http.post(path, content=data, headers={"Content-Type": "application/json"})
                return self._http_error_ok(r, status, HTTP_INVALID_CONSTRAINED.get(variant))
            return await self.until_admitted(attempt, 0.02)
        if kind == "http_malformed":
            path, data, ctype = self.http_malformed(variant, rng)

            async def attempt():
                r = await self.http.post(path, content=data, headers={"Content-Type": ctype})
                return self._http_error_ok(r, 400)
            return await self.until_admitted(attempt, 0.02)
        if kind == "http_garbage":
            return await self.http_garbage(variant, rng)
        if kind == "http_burst":
            n = 2 * (self.info["max_num_seqs"] + self.info["max_waiting"]) + 4
            # half the context each (not --max-tokens), so the first admitted are still running when the last
            # arrive (HTTP admits more slowly than gRPC: with short streams every call could get a slot)
            long = max(1, self.room // 2)
            calls = [self.http_call(*self.wellformed(rng, long=True, max_tokens=long), True, rng) for _ in range(n)]
            for status in await asyncio.gather(*calls, return_exceptions=True):
                if not isinstance(status, str):
                    self.notes.append(f"http_burst: {type(status).__name__}: {status}"[:400])
                    status = f"CLIENT_{type(status).__name__}"
                self.record("http_burst", "", status)
            return None
        # http_misc: the small endpoints
        if variant == "models":
            r = await self.http.get("/v1/models")
            ok = r.status_code == 200 and r.json()["data"][0]["id"] == self.http_model
        elif variant == "health":
            r = await self.http.get("/health")
            ok = r.status_code == 200
        elif variant == "metrics":
            r = await self.http.get("/metrics")
            ok = r.status_code == 200 and "num_requests_running" in r.text
        elif variant == "tokenize":
            if not self.info["has_tokenizer"]:
                return "200"
            r = await self.http.post("/tokenize", json={"model": self.http_model, "prompt": _text(rng, 64)})
            ok = r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"])
        else:  # detokenize
            if not self.info["has_tokenizer"]:
                return "200"
            ids = [rng.randrange(self.vocab) for _ in range(rng.randint(1, 16))]
            r = await self.http.post("/detokenize", json={"model": self.http_model, "tokens": ids})
            ok = r.status_code == 200 and isinstance(r.json().get("prompt"), str)
        return "200" if ok else (str(r.status_code) if r.status_code != 200 else "BAD_OUTPUT")

    async def http_greedy(self) -> list:
        """Greedy answers over HTTP (chat and completions, with and without logprobs), as bytes to compare."""
        rng, out = random.Random(self.args.seed + 1), []  # the prompts of `greedy`, to compare the two
        for j in range(6):
            prompt, kw = self.wellformed(rng, long=True)
            kw = {"temperature": 0.0, "ignore_eos": True, "max_tokens": min(16, kw["max_tokens"]),
                  "logprobs": self.max_lp if j % 2 else None}
            path, body = self.http_body(prompt, kw, False, rng)
            r = await self.http.post(path, json=body)
            if r.status_code != 200:
                raise RuntimeError(f"greedy {path} answered {r.status_code}: {r.text[:200]}")
            c = r.json()["choices"][0]
            out.append(json.dumps([c.get("message", {}).get("content"), c.get("text"), c.get("logprobs"),
                                   c["finish_reason"]], ensure_ascii=False).encode())
        return out

    # -- phases ---------------------------------------------------------------

    async def greedy(self) -> list:
        rng, out = random.Random(self.args.seed + 1), []
        for j in range(6):
            prompt, kw = self.wellformed(rng, long=True)
            kw = {"temperature": 0.0, "ignore_eos": True, "max_tokens": min(16, kw["max_tokens"]),
                  "logprobs": self.max_lp if j % 2 else None}
            c = await self.clients[0].complete(prompt, timeout=self.args.request_timeout, **kw)
            lps = [(lp.token_id, lp.logprob, sorted(lp.top.items())) for lp in c.logprobs or ()]
            out.append(json.dumps([c.token_ids, c.text, lps, c.finish_reason], ensure_ascii=False).encode())
        return out

    async def load(self, plan: list) -> float:
        t0, slots, tasks = time.monotonic(), asyncio.Semaphore(self.args.concurrency), set()
        next_report = t0 + self.args.progress if self.args.progress else float("inf")
        for i, (kind, variant, seed) in enumerate(plan):
            await slots.acquire()
            if time.monotonic() - t0 > self.args.duration:
                slots.release()
                print(f"soak: --duration reached after {i} of {len(plan)} items", file=sys.stderr)
                break
            task = asyncio.ensure_future(self.one(kind, variant, seed, i))
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), slots.release()))
            if time.monotonic() > next_report:
                next_report += self.args.progress
                print(f"soak: {i + 1 - len(tasks)}/{len(plan)} done, {len(tasks)} in flight, "
                      f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
        await asyncio.gather(*tasks)
        return time.monotonic() - t0

    async def settle(self) -> tuple:
        """Wait up to --settle s for 0 running, 0 waiting, 0 KV pages, 0 calls; (settled, last stats)."""
        deadline, s = time.monotonic() + self.args.settle, {}
        while True:
            s = (await self.clients[0].model_info(timeout=30))["stats"]
            busy = (s["running"], s["waiting"], s["kv_usage"], s["server_active"])
            if busy == (0, 0, 0.0, 0) or time.monotonic() > deadline:
                return busy == (0, 0, 0.0, 0), s
            await asyncio.sleep(0.1)

    async def sample_rss(self) -> None:
        while True:
            rss = rss_mib(self.pid)
            if rss is not None:
                self.rss["peak"] = max(self.rss["peak"] or 0.0, rss)
            await asyncio.sleep(1.0)


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS:"))
    except (OSError, StopIteration, TypeError):
        return None


async def start_server(args, log):
    cmd = [sys.executable, "-m", "jaxinfer", "serve", "--host", "127.0.0.1", "--port", "0"]
    if args.protocol != "grpc":
        cmd += ["--http-port", "0"]
    for flag in ("model", "engine_config", "max_num_seqs", "num_pages", "max_model_len", "max_waiting"):
        if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    proc = await asyncio.create_subprocess_exec(*cmd, *args.serve_arg, stdout=asyncio.subprocess.PIPE, stderr=log)
    deadline = time.monotonic() + args.startup_timeout
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), max(1.0, deadline - time.monotonic()))
            if not line:
                raise RuntimeError(f"jaxinfer serve exited with status {await proc.wait()} before it was ready")
            text = line.decode(errors="replace")
            m = re.search(r" on (\S+) \(.*- ready", text)
            if m:
                h = re.search(r"OpenAI-compatible API at (\S+?)/v1\b", text)
                if args.protocol != "grpc" and h is None:
                    raise RuntimeError(f"jaxinfer serve gave no HTTP address in its ready line: {text.strip()}")
                break
    except BaseException:
        if proc.returncode is None:
            proc.kill()
        raise

    async def drain():
        while await proc.stdout.readline():
            pass

    return proc, m.group(1), h.group(1) if h else None, asyncio.ensure_future(drain())


def status_line(c: Counter) -> str:
    return " ".join(f"{s}={n}" for s, n in sorted(c.items(), key=lambda x: (x[0] != "OK", x[0])))


async def post_checks(soak: Soak, greedy_before: list, http_before: Optional[list] = None) -> list:
    """(name, passed, detail) of every check made after the load."""
    checks, totals, seen = [], {k: sum(c.values()) for k, c in soak.counts.items()}, Counter()
    for c in soak.counts.values():
        seen.update(c)
    try:
        greedy_after = await soak.greedy()
        diff = [j for j, (a, b) in enumerate(zip(greedy_before, greedy_after)) if a != b]
        checks.append(("greedy outputs byte-identical before and after", not diff,
                       f"requests {diff} differ" if diff else f"{len(greedy_after)} requests"))
        settled, s = await soak.settle()
        soak.stats = s
        checks.append(("engine settled: 0 running, 0 waiting, 0 KV pages, 0 calls", settled,
                       f"running {s['running']}, waiting {s['waiting']}, kv_usage {s['kv_usage']:.3f}, "
                       f"calls {s['server_active']}"))
        health = await soak.clients[0].health()
        checks.append(("health SERVING after the run", health == "SERVING", health))
        if soak.http is not None:
            http_after = await soak.http_greedy()
            diff = [j for j, (a, b) in enumerate(zip(http_before, http_after)) if a != b]
            checks.append(("HTTP greedy outputs byte-identical before and after", not diff,
                           f"requests {diff} differ" if diff else f"{len(http_after)} requests"))
            grpc_text = [json.loads(x)[1] for x in greedy_after]
            http_text = [(lambda v: v[0] if v[0] is not None else v[1])(json.loads(x)) for x in http_after]
            diff = [j for j, (a, b) in enumerate(zip(grpc_text, http_text)) if a != b]
            checks.append(("the same greedy requests give the same text over gRPC and HTTP", not diff,
                           f"requests {diff} differ" if diff else f"{len(http_text)} requests"))
    except Exception as e:  # noqa: BLE001 - a gRPC or HTTP error after the run is a failed check, not a crash
        checks.append(("the server answers after the run", False, f"{type(e).__name__}: {e}"))
    for name, kinds in (
            ("well-formed calls: OK/CANCELLED/DEADLINE_EXCEEDED/RESOURCE_EXHAUSTED only, outputs consistent",
             ("stream", "cancel", "deadline", "burst", "kill", "tokenize", "model_info", "health")),
            ("invalid inputs: INVALID_ARGUMENT", ("invalid",)),
            ("malformed request bytes: INVALID_ARGUMENT", ("malformed",)),
            ("garbage bytes on the port: answered, closed or ignored", ("garbage",)),
            ("HTTP well-formed calls: 200/429/disconnected only, outputs consistent",
             ("http_stream", "http_complete", "http_disconnect", "http_burst", "http_misc")),
            ("HTTP invalid bodies: 400 (404: unknown model or route) with an OpenAI error object", ("http_invalid",)),
            ("HTTP malformed bodies: 400 with an OpenAI error object", ("http_malformed",)),
            ("garbage bytes on the HTTP port: answered (never 5xx), closed or ignored", ("http_garbage",))):
        mine = {k: c for k, c in sorted(soak.counts.items()) if k.split("/")[0] in kinds}
        bad = [f"{k}: {s}={n}" for k, c in mine.items() for s, n in c.items() if s not in ALLOWED[k.split("/")[0]]]
        if mine:
            checks.append((name, not bad, "; ".join(bad[:12]) or f"{sum(totals[k] for k in mine)} calls"))
    mine = {k: c for k, c in soak.counts.items() if "/" in k and k.split("/")[0] in CONSTRAINED_KINDS}
    if mine:  # (also counted in the well-formed checks above)
        bad = [f"{k}: {s}={n}" for k, c in sorted(mine.items()) for s, n in c.items()
               if s not in ALLOWED[k.split("/")[0]]]
        o = soak.constrained_outcomes
        checks.append(("constrained calls: every answer that ended validates (JSON schema, regex, choice, grammar, "
                       "tool calls' arguments); cut by max_tokens allowed; error only with its reason", not bad,
                       "; ".join(bad[:12]) or f"{sum(totals[k] for k in mine)} calls; answers: {o['stop']} stop and "
                       f"{o['tool_calls']} tool_calls validated, {o['length']} length, {o['error']} error"))
    if soak.protocol != "http":
        checks.append(("no UNKNOWN or INTERNAL status", not (seen["UNKNOWN"] or seen["INTERNAL"]),
                       f"UNKNOWN={seen['UNKNOWN']} INTERNAL={seen['INTERNAL']}"))
    if soak.protocol != "http" and soak.info["max_waiting"] >= 0:
        checks.append(("bursts past max_waiting got RESOURCE_EXHAUSTED", soak.counts["burst"]["RESOURCE_EXHAUSTED"] > 0,
                       status_line(soak.counts["burst"])))
    if soak.http is not None:
        fives = {k: n for c in soak.counts.values() for k, n in c.items() if k[:1] == "5" or k.endswith("5xx")}
        checks.append(("no HTTP 5xx status", not fives, status_line(Counter(fives)) or "none"))
        if soak.info["max_waiting"] >= 0:
            checks.append(("HTTP bursts past max_waiting got 429", soak.counts["http_burst"]["429"] > 0,
                           status_line(soak.counts["http_burst"])))
    r = soak.rss
    r["after"] = rss_mib(soak.pid)
    if r["before"] is not None and r["after"] is not None:  # from before the load: ready still holds compiling's
        r["growth"] = r["after"] - r["before"]
        checks.append((f"server RSS growth over the load at most {soak.args.max_rss_growth_mb:g} MiB",
                       r["growth"] <= soak.args.max_rss_growth_mb, f"{r['growth']:+.1f} MiB"))
    return checks


def table(soak: Soak, checks: list, plan: list, load_s: float, wall: float) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f} ms"

    def mib(x, sign=""):
        return "-" if x is None else f"{x:{sign}.1f} MiB"

    totals = {k: sum(c.values()) for k, c in soak.counts.items()}
    order = {k: j for j, k in enumerate({**WEIGHTS, **HTTP_WEIGHTS})}
    where = soak.address if soak.http is None else f"{soak.address} + {soak.http_url}"
    lines = [f"jaxinfer soak: {where} ({soak.protocol}), seed {soak.args.seed}, {len(plan)} items, {sum(totals.values())} calls, "
             f"concurrency {soak.args.concurrency}, load {load_s:.1f} s", "", f"{'kind':<40} {'calls':>6}  statuses"]
    for k in sorted(soak.counts, key=lambda k: (order[k.split("/")[0]], k)):
        flag = "" if set(soak.counts[k]) <= ALLOWED[k.split("/")[0]] else "   <- unexpected"
        lines.append(f"{k:<40} {totals[k]:>6}  {status_line(soak.counts[k])}{flag}")
    lines += ["", f"{'client-side, well-formed streams':<40} {'p50':>10} {'p99':>10} {'n':>7}"]
    for name, xs in (("time to first token", soak.ttft), ("inter-token gap", soak.gaps),
                     ("HTTP: time to first text chunk", soak.http_ttft), ("HTTP: gap between text chunks",
                                                                           soak.http_gaps)):
        if not xs and name.startswith("HTTP"):
            continue
        lines.append(f"{name:<40} {ms(percentile(xs, 50)):>10} {ms(percentile(xs, 99)):>10} {len(xs):>7}")
    r, s = soak.rss, soak.stats
    lines += ["", f"server RSS (pid {soak.pid}): ready {mib(r['ready'])}, before the load {mib(r['before'])}, "
              f"after {mib(r['after'])}, peak {mib(r['peak'])}, growth over the load {mib(r.get('growth'), '+')}"]
    if s:
        rejected = s["server_rejected"] - soak.info["stats"]["server_rejected"]
        lines.append(f"engine: finished {dict(s['finished'])}, preemptions {s['preemptions']}, prefix hit rate "
                     f"{s['prefix_hit_rate']:.2f}, RESOURCE_EXHAUSTED sent {rejected} "
                     f"(seen {sum(c['RESOURCE_EXHAUSTED'] for c in soak.counts.values()) + soak.retries})")
    lines += [""] + [f"{'PASS' if ok else 'FAIL'}  {name}: {detail}" for name, ok, detail in checks]
    return "\n".join(lines + ["", f"wall time {wall:.1f} s"])


async def run(args) -> int:
    t0, proc, log, drain = time.monotonic(), None, None, None
    try:
        try:
            if args.server:
                address, pid, http_url = args.server, args.server_pid, args.http_url
            else:
                log = tempfile.NamedTemporaryFile(prefix="jaxinfer-soak-server-", suffix=".log", delete=False)
                print(f"soak: starting jaxinfer serve (log: {log.name})", file=sys.stderr)
                proc, address, http_url, drain = await start_server(args, log)
                pid = proc.pid
            soak = Soak(args, address, pid, http_url if args.protocol != "grpc" else None)
            soak.rss["ready"] = rss_mib(pid)
            await soak.connect()
            if soak.http_url:
                await soak.connect_http()
            plan = soak.plan()
            greedy_before = await soak.greedy()
            http_before = await soak.http_greedy() if soak.http is not None else None
            soak.rss["before"] = rss_mib(pid)
        except (RuntimeError, OSError, asyncio.TimeoutError, ServerError, ValueError) as e:
            print(f"soak: error: {type(e).__name__}: {e}", file=sys.stderr)
            if log is not None:
                print(open(log.name, errors="replace").read()[-4000:], file=sys.stderr)
            return 1
        sampler = asyncio.ensure_future(soak.sample_rss())
        print(f"soak: {address}, {len(plan)} items at concurrency {args.concurrency}", file=sys.stderr)
        load_s = await soak.load(plan)
        checks = await post_checks(soak, greedy_before, http_before)
        sampler.cancel()
        for c in soak.clients:
            await c.close()
        if soak.http is not None:
            await soak.http.aclose()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(proc.wait(), 60)
            except asyncio.TimeoutError:
                proc.kill()
                code = await proc.wait()
            await drain
            checks.append(("server stopped cleanly on SIGTERM (exit 0)", code == 0, f"exit {code}"))
        wall = time.monotonic() - t0
        print(table(soak, checks, plan, load_s, wall))
        if soak.notes:
            print("first unexpected outcomes:\n  " + "\n  ".join(soak.notes[:20]), file=sys.stderr)
        passed = all(ok for _, ok, _ in checks)
        if args.json:
            write_json(args.json, {"address": address, "seed": args.seed, "items": len(plan), "passed": passed, "wall_s": wall,
                           "load_s": load_s, "counts": {k: dict(c) for k, c in soak.counts.items()},
                           "ttft_s": {"p50": percentile(soak.ttft, 50), "p99": percentile(soak.ttft, 99)},
                           "itl_s": {"p50": percentile(soak.gaps, 50), "p99": percentile(soak.gaps, 99)},
                           "protocol": args.protocol, "http_url": soak.http_url,
                           "http_ttft_s": {"p50": percentile(soak.http_ttft, 50),
                                           "p99": percentile(soak.http_ttft, 99)},
                           "http_gap_s": {"p50": percentile(soak.http_gaps, 50),
                                          "p99": percentile(soak.http_gaps, 99)},
                           "rss_mib": soak.rss, "engine": soak.stats, "notes": soak.notes,
                           "constrained_outcomes": dict(soak.constrained_outcomes),
                           "checks": [{"name": n, "passed": ok, "detail": d} for n, ok, d in checks],
                           "machine": machine()}, indent=1)
        if log is not None and passed:
            os.unlink(log.name)  # kept when a check failed
        return 0 if passed else 1
    finally:  # however the soak ends (an error, Ctrl-C), the server it started goes with it
        if proc is not None and proc.returncode is None:
            proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.tools.soak", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("the server (started here unless --server)")
    s.add_argument("--server", metavar="HOST:PORT", help="soak a running server instead of starting one")
    s.add_argument("--server-pid", type=int, metavar="PID", help="its process id, for RSS")
    s.add_argument("--http-url", metavar="URL",
                   help="with --server and --protocol http/both: its OpenAI-compatible API, http://HOST:PORT")
    s.add_argument("--protocol", choices=("grpc", "http", "both"), default="grpc",
                   help="drive the gRPC port, the OpenAI-compatible HTTP port (serve --http-port), or both "
                   "(default: grpc). The engine's numbers are read over gRPC either way")
    s.add_argument("--model", help="--model of jaxinfer serve (default: serve's)")
    s.add_argument("--engine-config", metavar="NAME")
    for flag in ("--max-num-seqs", "--num-pages", "--max-model-len", "--max-waiting"):
        s.add_argument(flag, type=int, metavar="N")
    s.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for jaxinfer serve (repeat; --serve-arg=--no-warmup)")
    s.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS")
    r = p.add_argument_group("the load")
    r.add_argument("--requests", type=int, default=10_000, help="plan items (default: 10000)")
    r.add_argument("--concurrency", type=int, default=64, help="items in flight at once (default: 64)")
    r.add_argument("--duration", type=float, default=1800.0, metavar="SECONDS", help="stop launching after this")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-tokens", type=int, default=128, help="largest max_tokens of a well-formed request")
    r.add_argument("--max-prompt-len", type=int, default=1024, help="longest well-formed prompt, in tokens")
    r.add_argument("--request-timeout", type=float, default=300.0, metavar="SECONDS")
    r.add_argument("--settle", type=float, default=10.0, metavar="SECONDS", help="wait this long for the engine")
    r.add_argument("--max-rss-growth-mb", type=float, default=256.0)
    r.add_argument("--progress", type=float, default=10.0, metavar="SECONDS", help="progress on stderr (0: none)")
    r.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be at least 1")
    if args.server and args.protocol != "grpc" and not args.http_url:
        p.error(f"--protocol {args.protocol} with --server needs --http-url (the server's HTTP address)")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
