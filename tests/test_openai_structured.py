"""Structured output over the OpenAI-compatible HTTP API, end to end: the real `openai` client against a real
server on loopback, on the tiny random model with a byte-level BPE tokenizer trained here on JSON and words (420
tokens: every byte, and pieces such as ``{"``, ``":"`` and ``","`` that cross JSON's own boundaries, as a real
model's do; ids 420-511 of the model's 512 logits are never allowed), and once on the SentencePiece one.

A random model sampled at temperature 1.0 is the hardest writer a grammar can have: every output that ends
with "stop" must parse and validate (`jsonschema`), match the regex, or be one of the choices; with bounded
schemas and a sensible max_tokens every output must end. tool_choice "required" and a named function give
tool calls whose arguments validate against the chosen tool's own schema. Streaming gives the same text and the
same calls as the whole response for the same seed. Every bad input is one 400 naming its field, and the server
keeps serving.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

import jaxinfer
from conftest import TINY, tiny_params
from jaxinfer.server import ServerConfig, ServerThread
from openai_models import CHAT_TEMPLATE, TOOLS_ENGINE, sp_llm

MSG = [{"role": "user", "content": "hello world"}]

# Bounded: a sampled request must reach its end well within MAX_TOKENS (strings are short, arrays capped).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["jax", "xla", "tpu"]}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer",
                                                                                         "minimum": 0,
                                                                                         "maximum": 4}},
                "required": ["kind"], "additionalProperties": False},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
MAX_TOKENS = 160
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string literal
SEEDS = 4  # n choices of one request: choice i samples with seed + i

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99,
                                                                         "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": -99,
                                                                         "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: takes none
TOOLS = [WEATHER, ADD, NOW]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for t in TOOLS}


def json_bpe_llm(path) -> "jaxinfer.LLM":
    """The tiny random model with a byte-level BPE tokenizer trained on compact and spaced JSON and words."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxinfer.text.tokenizer import Tokenizer as JTokenizer

    rng = random.Random(0)
    words = ["hello", "world", "jax", "cat", "dog", "name", "age", "city", "Paris", "celsius", "yes", "no"]
    corpus = []
    for _ in range(300):
        obj = {rng.choice(words): rng.choice([rng.randint(0, 200), rng.choice(words), [1, 2], {"a": True}])
               for _ in range(3)}
        corpus.append(json.dumps(obj, separators=(",", ":")) if rng.random() < 0.5 else json.dumps(obj))
        corpus.append(" ".join(rng.choice(words) for _ in range(8)))
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                            "chat_template": CHAT_TEMPLATE}))
    return jaxinfer.LLM.from_params(TINY, tiny_params(), tokenizer=JTokenizer.from_dir(path),
                                    engine_config=TOOLS_ENGINE, name="tiny-json")  # 512 positions


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = json_bpe_llm(tmp_path_factory.mktemp("bpe"))
    assert llm.tokenizer.vocab_size == 420 and llm.model_config.vocab_size == 512
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(llm, ServerConfig(port=0, http_port=0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(autouse=True)
def _nothing_left_behind(request):
    yield
    if "server" in request.fixturenames:
        from test_openai_server import assert_all_free

        srv = request.getfixturevalue("server")
        assert_all_free(srv.llm, srv)


def sampled(seed: int, n: int = SEEDS, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    return dict(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens, **extra)


def chat(oai, llm, **kw):
    return oai.chat.completions.create(model=llm.model_name, messages=MSG, **kw)


def chat_stream_texts(oai, llm, **kw) -> tuple:
    """(content per choice, finish_reason per choice) of a streamed chat completion."""
    texts, finish = [""] * kw["n"], [None] * kw["n"]
    for ch in oai.chat.completions.create(model=llm.model_name, messages=MSG, stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    return texts, finish


def streamed_calls(oai, llm, **kw) -> tuple:
    """(calls per choice as [(name, arguments)], finish_reason per choice, content per choice), streamed."""
    n = kw["n"]
    calls = [dict() for _ in range(n)]
    finish, content = [None] * n, [""] * n
    for ch in oai.chat.completions.create(model=llm.model_name, messages=MSG, stream=True, **kw):
        for c in ch.choices:
            content[c.index] += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                if tc.id is not None:  # the call's first piece: its id, type and name
                    assert tc.index not in calls[c.index] and tc.type == "function" and tc.function.name
                    calls[c.index][tc.index] = [tc.function.name, ""]
                calls[c.index][tc.index][1] += tc.function.arguments or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    return [[tuple(v) for _, v in sorted(d.items())] for d in calls], finish, content


# --------------------------------------------------------------------------- #
# response_format, structured_outputs and the guided_* aliases
# --------------------------------------------------------------------------- #


def test_json_schema_outputs_validate_and_end(oai, llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    outs = []
    for seed in (1, 100):
        outs += chat(oai, llm, response_format=fmt, **sampled(seed)).choices
    assert len(outs) == 2 * SEEDS
    for c in outs:
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)  # bounded: every output ends
        jsonschema.validate(json.loads(c.message.content), PERSON)
        assert not re.search(r"\s", STRING.sub('""', c.message.content))  # compact: no whitespace between tokens
    assert len({c.message.content for c in outs}) > 1  # sampled, not one forced answer


def test_json_schema_on_completions_and_streamed_equals_whole(oai, llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = oai.completions.create(model=llm.model_name, prompt="jax", extra_body={"response_format": fmt},
                                   **sampled(7))
    for c in whole.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PERSON)
    texts, finish = [""] * SEEDS, [None] * SEEDS
    for ch in oai.completions.create(model=llm.model_name, prompt="jax", extra_body={"response_format": fmt},
                                     stream=True, **sampled(7)):
        for c in ch.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in whole.choices] and finish == ["stop"] * SEEDS

    chat_whole = chat(oai, llm, response_format=fmt, **sampled(7))
    assert chat_stream_texts(oai, llm, response_format=fmt, **sampled(7)) == (
        [c.message.content for c in chat_whole.choices], [c.finish_reason for c in chat_whole.choices])


def test_json_object_gives_an_object(oai, llm):
    r = chat(oai, llm, response_format={"type": "json_object"}, **sampled(3, n=4, max_tokens=200))
    ended = [c for c in r.choices if c.finish_reason == "stop"]
    assert ended, [c.message.content for c in r.choices]  # an object may wander, but not every one of them
    for c in ended:
        assert isinstance(json.loads(c.message.content), dict)
    for c in r.choices:
        assert c.message.content.startswith("{")


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"regex": r"[a-c]{2,5}-[0-9]{1,3}"}},
    {"guided_regex": r"[a-c]{2,5}-[0-9]{1,3}"},
])
def test_regex_outputs_match(oai, llm, extra):
    r = chat(oai, llm, extra_body=extra, **sampled(5, max_tokens=24))
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", c.message.content), c
    s = oai.completions.create(model=llm.model_name, prompt="x", extra_body=extra, **sampled(5, max_tokens=24))
    assert all(re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", c.text) and c.finish_reason == "stop" for c in s.choices)
    assert chat_stream_texts(oai, llm, extra_body=extra, **sampled(5, max_tokens=24))[0] == [
        c.message.content for c in r.choices]


CHOICES = ["yes", "no", "maybe so", "日本"]


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}])
def test_choice_outputs_are_one_of_the_choices(oai, llm, extra):
    r = chat(oai, llm, extra_body=extra, **sampled(11, max_tokens=16))
    assert all(c.finish_reason == "stop" and c.message.content in CHOICES for c in r.choices), r.choices


@pytest.mark.parametrize("grammar, pattern", [
    ('start: greeting "!"\ngreeting: "hi" | "ho" | "hey"\n', r"(hi|ho|hey)!"),  # Lark
    ('root ::= "n" [0-9] [0-9]? ("a" | "b")\n', r"n[0-9][0-9]?[ab]"),  # GBNF
])
def test_guided_grammar_lark_and_gbnf(oai, llm, grammar, pattern):
    r = chat(oai, llm, extra_body={"guided_grammar": grammar}, **sampled(2, max_tokens=16))
    assert all(c.finish_reason == "stop" and re.fullmatch(pattern, c.message.content) for c in r.choices), r.choices
    r = chat(oai, llm, extra_body={"structured_outputs": {"grammar": grammar}}, **sampled(2, max_tokens=16))
    assert all(re.fullmatch(pattern, c.message.content) for c in r.choices)


def test_guided_json_and_whitespace(oai, llm):
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    r = chat(oai, llm, extra_body={"guided_json": json.dumps(schema)}, **sampled(4, max_tokens=40))
    for c in r.choices:
        assert c.finish_reason == "stop" and c.message.content == json.dumps(json.loads(c.message.content),
                                                                             separators=(",", ":"))
    # flexible whitespace on request: the pattern lets exactly one space or none between tokens
    flexible = {"json": schema, "disable_any_whitespace": False, "whitespace_pattern": " ?"}
    r = chat(oai, llm, extra_body={"structured_outputs": flexible}, **sampled(4, max_tokens=60))
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
        assert "\n" not in c.message.content and "  " not in c.message.content
    assert any(" " in c.message.content for c in r.choices)  # some whitespace was drawn


def test_text_response_format_is_unconstrained(oai, llm):
    plain = chat(oai, llm, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    text = chat(oai, llm, temperature=0, max_tokens=8, response_format={"type": "text"},
                extra_body={"ignore_eos": True})
    assert text.choices[0].message.content == plain.choices[0].message.content


# --------------------------------------------------------------------------- #
# tool_choice "required" and a named function
# --------------------------------------------------------------------------- #


def _check_calls(calls, *, name=None):
    assert calls
    for call_name, arguments in calls:
        assert call_name in SCHEMAS and (name is None or call_name == name)
        args = json.loads(arguments)
        jsonschema.validate(args, SCHEMAS[call_name])
        if call_name == "now":
            assert args == {}


def test_tool_choice_required_calls_offered_tools(oai, llm):
    # "required" is an array of calls with no upper bound: room for a random model's several calls
    r = chat(oai, llm, tools=TOOLS, tool_choice="required", **sampled(21, max_tokens=400))
    names = set()
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert all(tc.type == "function" and tc.id.startswith("call_") for tc in c.message.tool_calls)
        calls = [(tc.function.name, tc.function.arguments) for tc in c.message.tool_calls]
        _check_calls(calls)
        names |= {n for n, _ in calls}
    assert len(names) > 1  # the sampled calls pick different tools, each with its own arguments' schema

    got, finish, content = streamed_calls(oai, llm, tools=TOOLS, tool_choice="required",
                                          **sampled(21, max_tokens=400))
    assert got == [[(tc.function.name, tc.function.arguments) for tc in c.message.tool_calls] for c in r.choices]
    assert finish == ["tool_calls"] * SEEDS and content == [""] * SEEDS


def test_tool_choice_required_with_parallel_tool_calls_false_makes_one_call(oai, llm):
    r = chat(oai, llm, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **sampled(8, max_tokens=200))
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        _check_calls([(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)])


@pytest.mark.parametrize("name", ["add", "get_weather", "now"])
def test_named_tool_choice_calls_that_function(oai, llm, name):
    choice = {"type": "function", "function": {"name": name}}
    r = chat(oai, llm, tools=TOOLS, tool_choice=choice, **sampled(31, max_tokens=120))
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (tc,) = c.message.tool_calls
        _check_calls([(tc.function.name, tc.function.arguments)], name=name)
    got, finish, _ = streamed_calls(oai, llm, tools=TOOLS, tool_choice=choice, **sampled(31, max_tokens=120))
    assert got == [[(name, c.message.tool_calls[0].function.arguments)] for c in r.choices]
    assert finish == ["tool_calls"] * SEEDS


def test_forced_calls_cut_short_by_max_tokens(oai, llm):
    """No call whose arguments do not parse ever comes back: an output cut inside its first call is content
    with finish_reason "length" (as vLLM answers), streamed or not; a later call cut short is left out."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    cut_first = kept = 0
    for tool_choice, max_tokens, opening in ((named, 3, "{"), ("required", 1, "["), ("required", 9, "["),
                                             ("required", 20, "[")):
        kw = dict(tools=TOOLS, tool_choice=tool_choice, **sampled(4, max_tokens=max_tokens))
        r = chat(oai, llm, **kw)
        for c in r.choices:
            assert c.finish_reason == "length", c
            calls = [(tc.function.name, tc.function.arguments) for tc in c.message.tool_calls or ()]
            if calls:
                _check_calls(calls)  # whole, valid arguments only
                assert c.message.content is None
                kept += 1
            else:
                cut_first += 1
                assert c.message.content.startswith(opening) and len(c.message.content) > 0
        got, finish, content = streamed_calls(oai, llm, **kw)
        assert got == [[(tc.function.name, tc.function.arguments) for tc in c.message.tool_calls or ()]
                       for c in r.choices]
        assert finish == ["length"] * SEEDS and content == [c.message.content or "" for c in r.choices]
    assert cut_first >= 3 * SEEDS  # the first call cut: every choice of the first three requests at least
    assert kept  # and calls before a cut one (20 tokens: one whole call, the next cut)


# --------------------------------------------------------------------------- #
# A grammar that fails mid-generation; bad input
# --------------------------------------------------------------------------- #


def test_a_failed_grammar_ends_the_choice_with_error_and_its_reason(oai, llm, server):
    # the choice is complete after one word; min_tokens asks for more: the request ends with an error
    extra = {"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 8}
    r = chat(oai, llm, temperature=1.0, seed=1, max_tokens=16, extra_body=extra)
    c = r.choices[0]
    assert c.finish_reason == "error" and "min_tokens" in c.model_extra["error"], c
    assert c.message.content in ("yes", "no")  # the text so far stays
    events = []
    body = {"model": llm.model_name, "messages": MSG, "stream": True, "temperature": 1.0, "seed": 1,
            "max_tokens": 16, **extra}
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "error" and last["error"] == c.model_extra["error"]
    s = oai.completions.create(model=llm.model_name, prompt="x", temperature=1.0, seed=1, max_tokens=16,
                               extra_body=extra)
    assert s.choices[0].finish_reason == "error" and "min_tokens" in s.choices[0].model_extra["error"]


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}

_BAD_CHAT = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
      "guided_regex": "a+"}, "response_format", ["response_format and guided_regex"]),
    ({"structured_outputs": {"json": PERSON, "regex": "a+"}}, "structured_outputs", ["exactly one", "json, regex"]),
    ({"guided_choice": ["a"], "guided_json": PERSON}, "guided_json", ["guided_json and guided_choice"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": BAD_SCHEMA}}},
     "response_format", ["response_format.json_schema.schema", "does not compile"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format",
     ["response_format.json_schema.schema is required"]),
    ({"response_format": {"type": "xml"}}, "response_format", ["response_format.type", "xml"]),
    ({"guided_json": BAD_SCHEMA}, "guided_json", ["guided_json", "does not compile"]),
    ({"guided_regex": "a(b"}, "guided_regex", ["guided_regex", "regex does not compile"]),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs", ["structured_outputs.regex"]),
    ({"guided_grammar": "start: missing_rule\n"}, "guided_grammar", ["guided_grammar", "does not compile"]),
    ({"structured_outputs": {"jsn": PERSON}}, "structured_outputs", ["unknown field", "jsn"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", ["structured_outputs.choice"]),
    ({"structured_outputs": "a+"}, "structured_outputs", ["structured_outputs"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice",
     ['"fly"', "not among the tools"]),
    ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", ["needs tools"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", ["tool_choice must be"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}], "tool_choice": "required"},
     "tools", ["tools:", "does not compile"]),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", ["tools[0]"]),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     ['response_format and tool_choice "required"']),
]


@pytest.mark.parametrize("extra, param, words", _BAD_CHAT)
def test_bad_structured_requests_are_one_400_naming_the_field(server, oai, llm, extra, param, words):
    r = httpx.post(server.http_url + "/v1/chat/completions",
                   json={"model": llm.model_name, "messages": MSG, "max_tokens": 4, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]
    assert "\n" not in err["message"] and "Traceback" not in err["message"]
    with pytest.raises(openai.BadRequestError):  # the client raises its own exception
        oai.chat.completions.create(model=llm.model_name, messages=MSG, max_tokens=4, extra_body=extra)
    assert chat(oai, llm, max_tokens=2).choices[0].finish_reason in ("stop", "length")  # still serving


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": BAD_SCHEMA}}},
     "response_format", ["does not compile"]),
    ({"guided_regex": "a(b", "n": 2}, "guided_regex", ["does not compile"]),
    ({"structured_outputs": {"choice": ["a"], "grammar": "start: \"a\"\n"}}, "structured_outputs", ["exactly one"]),
])
def test_bad_structured_completions_are_400(server, llm, extra, param, words):
    r = httpx.post(server.http_url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 4, **extra},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert all(w in r.json()["error"]["message"] for w in words)


# --------------------------------------------------------------------------- #
# The SentencePiece tokenizer (byte fallback: every character JSON needs is some token)
# --------------------------------------------------------------------------- #


def test_sentencepiece_model_json_schema(tmp_path):
    # 340 pieces under the model's 512 logits (ids 340-511 are never allowed)
    sp = sp_llm(tmp_path, name="tiny-sp")
    try:
        with ServerThread(sp, ServerConfig(port=0, http_port=0)) as srv, \
                openai.OpenAI(base_url=srv.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
            r = c.chat.completions.create(model=sp.model_name, messages=MSG, response_format=fmt,
                                          **sampled(3, max_tokens=100))
            for choice in r.choices:
                assert choice.finish_reason == "stop"
                jsonschema.validate(json.loads(choice.message.content), PERSON)
    finally:
        sp.close()
