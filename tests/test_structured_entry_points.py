"""Structured output through the gRPC API and the CLI (issue 21, point 4), on a tiny random-weight model.

The model has a byte-level BPE tokenizer with an end-of-sequence token (what llguidance needs), so every
text can be spelled and the constraint, not the vocabulary, decides the output. One model directory
serves every test: a gRPC server on loopback over it, and ``jaxinfer generate`` (run in-process, local and
``--server``) loading the same directory with the same engine flags, so all three give the same tokens
for the same seed. Outputs are sampled at temperature 1.0, where an unconstrained random model writes
noise: an output that parses is the constraint's doing.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest

import jaxinfer
from conftest import TINY, tiny_params
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams
from jaxinfer.server import ServerConfig, ServerThread
from jaxinfer.server import jaxinfer_pb2 as pb
from jaxinfer.server import jaxinfer_pb2_grpc as pb_grpc
from jaxinfer.server.client import Client, InvalidArgument, generate_request, sampling_options
from jaxinfer.server.servicer import structured_outputs_from_proto

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra (pip install -e .[test])")

PROMPT = "Q: "
SEEDS = (0, 1, 2)
MAX_TOKENS = 80
MODEL_FLAGS = ["--engine-config", "cpu", "--max-model-len", "128", "--num-pages", "40", "--max-num-seqs", "2"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y z"]}, "minItems": 1, "maxItems": 3},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
                "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}
CHOICES = ["red", "green, dark", "blue"]
REGEX = r"(yes|no)-[0-9]{1,3}"
LARK = 'start: greeting " " NAME\ngreeting: "hi" | "hello"\nNAME: /[a-z]{1,6}/\n'
GBNF = 'root ::= ("yes" | "no") "!" [0-9]\n'


def _valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


CASES = {
    "json_schema": (StructuredOutputsParams(json=SCHEMA), _valid_json),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
    "lark": (StructuredOutputsParams(grammar=LARK), lambda t: re.fullmatch(r"(hi|hello) [a-z]{1,6}", t) is not None),
    "gbnf": (StructuredOutputsParams(grammar=GBNF), lambda t: re.fullmatch(r"(yes|no)![0-9]", t) is not None),
}


def byte_level_tokenizer(path):
    """The 256 byte symbols, a few merges (so some tokens span several characters) and ``</s>``."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from jaxinfer.text.tokenizer import Tokenizer

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [('"', ":"), ("{", '"'), ("Ġ", "t"), ("y", "e"), ("ye", "s")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = byte_level_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    assert tok.vocab_size < TINY.vocab_size  # ids past the tokenizer's are the model's padding, never allowed
    return str(jaxinfer.save_model(tmp_path_factory.mktemp("models") / "tiny", TINY, tiny_params(), tokenizer=tok))


@pytest.fixture(scope="module")
def model_flags(model_dir):
    return ["--model", model_dir, *MODEL_FLAGS]


@pytest.fixture(scope="module")
def llm(model_flags):
    """The model as `jaxinfer serve` loads it from these flags (so local CLI runs get the same engine)."""
    import jaxinfer.cli.main as cli
    from jaxinfer.cli.flags import llm_kwargs

    llm = jaxinfer.LLM(**llm_kwargs(cli.build_parser().parse_args(["serve", *model_flags])))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(llm, ServerConfig(port=0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


def assert_all_free(llm, server):
    assert server.call(lambda: len(server.servicer.active)) == 0
    assert llm.wait_idle(10)
    llm.engine.allocator.check_all_free()


# --------------------------------------------------------------------------- #
# The mapping, without a server
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("sop", [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(json='{"type": "integer"}', disable_any_whitespace=False, whitespace_pattern=r"[ ]?"),
    StructuredOutputsParams(json_object=True, disable_any_whitespace=False),
    StructuredOutputsParams(regex=REGEX),
    StructuredOutputsParams(choice=CHOICES),
    StructuredOutputsParams(grammar=GBNF),
], ids=["json", "json-text-flexible", "json_object", "regex", "choice", "grammar"])
def test_structured_outputs_survive_the_trip_through_the_proto(sop):
    opts = sampling_options(SamplingParams(max_tokens=4, structured_outputs=sop))
    wire = pb.SamplingOptions.FromString(opts.SerializeToString())
    back = structured_outputs_from_proto(wire)
    assert back.kind == sop.kind
    if sop.kind == "json":  # the schema travels as its JSON text
        want = sop.json if isinstance(sop.json, dict) else json.loads(sop.json)
        assert json.loads(back.json) == want
    else:
        assert getattr(back, sop.kind) == getattr(sop, sop.kind)
    assert (back.disable_any_whitespace, back.whitespace_pattern) == (sop.disable_any_whitespace,
                                                                      sop.whitespace_pattern)
    # the keyword form, a dict of the same fields, sends the same constraint
    assert structured_outputs_from_proto(sampling_options(structured_outputs=dataclass_dict(sop))) == back


def dataclass_dict(sop) -> dict:
    import dataclasses

    return {f.name: getattr(sop, f.name) for f in dataclasses.fields(sop) if getattr(sop, f.name) is not None}


def test_unset_and_refused_structured_options():
    assert structured_outputs_from_proto(sampling_options(SamplingParams(max_tokens=4))) is None
    with pytest.raises(ValueError, match=r"sampling\.json_object is false"):
        structured_outputs_from_proto(pb.SamplingOptions(json_object=False))
    with pytest.raises(ValueError, match=r"sampling\.flexible_whitespace .* structured_output is unset"):
        structured_outputs_from_proto(pb.SamplingOptions(flexible_whitespace=True))
    with pytest.raises(TypeError, match=r"unknown sampling option\(s\): regex \(a constraint is structured_outputs="):
        sampling_options(regex="a+")
    with pytest.raises(ValueError, match="exactly one of"):
        sampling_options(structured_outputs={"regex": "a", "choice": ["b"]})


# --------------------------------------------------------------------------- #
# gRPC, end to end
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("case", list(CASES))
def test_constrained_output_over_grpc_validates_and_equals_the_library(llm, client, server, case):
    sop, valid = CASES[case]
    for seed in SEEDS:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, structured_outputs=sop)
        want = llm.generate([PROMPT], params)[0].outputs[0]
        got = client.complete(PROMPT, params)
        assert got.finish_reason == want.finish_reason == "stop", (case, seed, got.text, got.error)
        assert valid(got.text), (case, seed, got.text)
        assert got.error is None
        assert got.token_ids == want.token_ids and got.text == want.text
    assert_all_free(llm, server)


def test_json_object_and_flexible_whitespace_over_grpc(llm, client):
    sop = StructuredOutputsParams(json_object=True, disable_any_whitespace=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, structured_outputs=sop)
    want = llm.generate([PROMPT], params)[0].outputs[0]
    got = client.complete(PROMPT, params)
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    if got.finish_reason == "stop":
        assert isinstance(json.loads(got.text), dict)
    else:  # max_tokens: what there is is a JSON object's beginning
        assert got.finish_reason == "length" and got.text.startswith("{")


@pytest.mark.parametrize("structured, kind", [
    ({"json": {"type": "nope"}}, "json"),
    ({"json": "{not json"}, "json"),
    ({"regex": "[a-"}, "regex"),
    ({"grammar": "start: undefined_rule\n"}, "grammar"),
    ({"grammar": 'root ::= "a" | missing\n'}, "grammar"),
])
def test_a_constraint_that_does_not_compile_is_invalid_argument_naming_its_kind(llm, client, server, structured,
                                                                                  kind):
    with pytest.raises(InvalidArgument, match=rf"structured_outputs\.{kind}\b") as e:
        client.complete(PROMPT, max_tokens=4, structured_outputs=structured)
    # the library refuses it with the very same message
    with pytest.raises(ValueError) as lib:
        llm.make_request(PROMPT, SamplingParams(max_tokens=4, structured_outputs=structured))
    assert e.value.details == str(lib.value)
    # and the server keeps serving, with nothing held
    # room for the longest choice spelled a byte a token ("green, dark": 11)
    ok = client.complete(PROMPT, max_tokens=16, temperature=1.0, seed=1, structured_outputs={"choice": CHOICES})
    assert ok.finish_reason == "stop" and ok.text in CHOICES
    assert_all_free(llm, server)


def test_options_the_client_would_not_send_are_refused_by_the_server(server):
    """A client of another language can send json_object=false or flexible_whitespace alone: INVALID_ARGUMENT."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for sampling, needle in ((pb.SamplingOptions(max_tokens=4, json_object=False), "sampling.json_object"),
                                 (pb.SamplingOptions(max_tokens=4, whitespace_pattern=" "),
                                  "sampling.whitespace_pattern"),
                                 (pb.SamplingOptions(max_tokens=4, choice=pb.ChoiceList()), "structured_outputs.choice")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=sampling), timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_a_request_that_ends_with_an_error_carries_its_message_to_the_client(llm, client, server):
    """choice ["a"] is complete after one token, before min_tokens=3: the request ends with "error" and says why."""
    params = SamplingParams(max_tokens=8, min_tokens=3, temperature=1.0, seed=0,
                            structured_outputs=StructuredOutputsParams(choice=["a"]))
    want = llm.generate([PROMPT], params)[0].outputs[0]
    assert want.finish_reason == "error" and want.error
    pieces = list(client.generate(PROMPT, params))
    last = pieces[-1]
    assert last.finish_reason == "error" and last.error == want.error and "min_tokens" in last.error
    assert all(p.error is None for p in pieces[:-1])
    assert "".join(p.text for p in pieces) == want.text
    assert_all_free(llm, server)
    # a request that finishes well has no error on the wire
    req = generate_request(PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(server.address) as channel:
        final = list(pb_grpc.GenerationStub(channel).Generate(req, timeout=60))[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and final.error == ""


# --------------------------------------------------------------------------- #
# The CLI, in-process, local and --server
# --------------------------------------------------------------------------- #


def _generate(capsys, *argv) -> tuple:
    import jaxinfer.cli.main as cli

    code = cli.main(["generate", PROMPT, "--json", "--quiet", "--temperature", "1", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_cli_constraints_local_and_over_the_server(llm, server, model_flags, tmp_path, capsys):
    schema_file = tmp_path / "person.schema.json"
    schema_file.write_text(json.dumps(SCHEMA, indent=2))
    cases = [
        (["--choice", "red", "--choice", "green, dark", "--choice", "blue"], lambda t: t in CHOICES),
        (["--regex", REGEX], CASES["regex"][1]),
        (["--json-schema", str(schema_file)], _valid_json),
        (["--json-schema", json.dumps(SCHEMA)], _valid_json),
    ]
    for n, (flags, valid) in enumerate(cases):
        seed = ["--seed", str(10 + n), "--max-tokens", str(MAX_TOKENS)]
        code, local, err = _generate(capsys, *flags, *seed, *model_flags)
        assert code == 0, err
        assert local["finish_reason"] == "stop" and valid(local["text"]), (flags, local["text"])
        code, remote, err = _generate(capsys, *flags, *seed, "--server", server.address, "--timeout", "120")
        assert code == 0, err
        assert (remote["token_ids"], remote["text"], remote["finish_reason"]) == (
            local["token_ids"], local["text"], local["finish_reason"])
    assert_all_free(llm, server)


def test_cli_a_request_that_ends_with_an_error_exits_1_with_its_reason(model_flags, capsys):
    code, result, err = _generate(capsys, "--choice", "a", "--min-tokens", "3", "--max-tokens", "8", *model_flags)
    assert code == 1
    assert result["finish_reason"] == "error" and result["text"] == "a" and "min_tokens" in result["error"]
    assert err == f"jaxinfer: error: {result['error']}\n"


def _usage_error(capsys, *argv) -> str:
    import jaxinfer.cli.main as cli

    # a model that does not exist: these errors come before any model is looked for
    assert cli.main(["generate", PROMPT, "--model", "/nonexistent/model", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("jaxinfer: error: "), err
    return err


@pytest.mark.parametrize("argv, flags", [
    (["--regex", "a+", "--choice", "a"], ("--choice", "--regex")),
    (["--json-schema", '{"type": "object"}', "--grammar", __file__], ("--grammar", "--json-schema")),
    (["--choice", "a", "--choice", "b", "--json-object"], ("--json-object", "--choice")),
])
def test_cli_constraints_are_mutually_exclusive(capsys, argv, flags):
    err = _usage_error(capsys, *argv)
    assert "not allowed with" in err and all(f in err for f in flags), err


def test_cli_refuses_a_bad_grammar_schema_or_regex_before_loading_the_model(tmp_path, capsys):
    lark = tmp_path / "bad.lark"
    lark.write_text("start: undefined_rule\n")
    gbnf = tmp_path / "bad.gbnf"
    gbnf.write_text('root ::= "a" | missing\n')
    assert "--grammar: structured_outputs.grammar does not compile:" in _usage_error(capsys, "--grammar", str(lark))
    assert "--grammar: structured_outputs.grammar (GBNF)" in _usage_error(capsys, "--grammar", str(gbnf))
    assert "--grammar: no such file" in _usage_error(capsys, "--grammar", str(tmp_path / "none.lark"))
    assert "--regex: structured_outputs.regex does not compile" in _usage_error(capsys, "--regex", "[a-")
    assert "--json-schema: structured_outputs.json does not compile" in _usage_error(
        capsys, "--json-schema", '{"type": "nope"}')
    assert "--json-schema: the text is not valid JSON" in _usage_error(capsys, "--json-schema", "{nope")
    bad_file = tmp_path / "list.json"
    bad_file.write_text("[1, 2]")
    assert "must be a JSON Schema object" in _usage_error(capsys, "--json-schema", str(bad_file))
    assert "--json-schema: no such file" in _usage_error(capsys, "--json-schema", str(tmp_path / "none.json"))
    assert "--any-whitespace applies to a JSON constraint" in _usage_error(capsys, "--any-whitespace", "--regex", "a")
    assert "--any-whitespace applies to a JSON constraint" in _usage_error(capsys, "--any-whitespace")
