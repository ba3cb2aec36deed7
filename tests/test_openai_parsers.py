"""Tool-call and reasoning parsers of the OpenAI front door (server/openai_api), on fixed model outputs.

Every text is parsed whole and streamed: one character at a time, split in two at every boundary,
and cut at random (hypothesis). However it is cut, the stream must say what the whole parse says.
"""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.server.openai_api.reasoning import REASONING_PARSERS, get_reasoning_parser
from jaxinfer.server.openai_api.tool_parsers import (
    TOOL_PARSERS, DeltaMessage, chain, get_tool_parser, merge_deltas, parse_whole, tool_parser_for)

MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>")
OPENAI_ID = re.compile(r"call_[A-Za-z0-9]{24}\Z")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}\Z")


def canon(raw: str) -> str:
    """The arguments text a call must carry for arguments written as `raw` in the output."""
    return json.dumps(json.loads(raw), ensure_ascii=False)


WEATHER = '{"location": "San Francisco, CA", "unit": "fahrenheit"}'
TRICKY = json.dumps({"code": 'def f():\n    return {"a": [1, 2]}  # }', "q": 'a "quoted" {brace} \\ [x]',
                     "nested": {"deep": [{"k": "}]"}, [], {}], "n": -0.5e3, "t": True, "z": None}})
UNICODE_ESCAPED = json.dumps({"city": "Zürich", "emoji": "😀", "cjk": "東京"})  # \u00fc, \ud83d\ude00, ...
UNICODE_RAW = json.dumps({"city": "Zürich", "emoji": "😀"}, ensure_ascii=False)

# (parser, output text, content, [(name, arguments text the call must carry, model id or None)], well formed)
CASES = {
    # -- hermes: Qwen2.5 / Qwen3 ------------------------------------------------------------------
    "hermes_one": ("hermes", f'<tool_call>\n{{"name": "get_current_weather", "arguments": {WEATHER}}}\n</tool_call>',
                   None, [("get_current_weather", canon(WEATHER), None)], True),
    "hermes_several": ("hermes",
                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                       '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2.50,"c":1E2}}\n</tool_call>',
                       None, [("get_weather", '{"city": "Paris"}', None), ("get_time", "{}", None),
                              ("add", '{"a": 1, "b": 2.5, "c": 100.0}', None)], True),
    "hermes_content_first": ("hermes",
                             "I'll check the weather for you.\n\n<tool_call>\n"
                             f'{{"name": "get_current_weather", "arguments": {WEATHER}}}\n</tool_call>',
                             "I'll check the weather for you.\n\n", [("get_current_weather", canon(WEATHER), None)],
                             True),
    "hermes_tricky_args": ("hermes", f'<tool_call>\n{{"name": "run", "arguments": {TRICKY}}}\n</tool_call>',
                           None, [("run", canon(TRICKY), None)], True),
    "hermes_unicode": ("hermes",
                       f'<tool_call>\n{{"name": "a", "arguments": {UNICODE_ESCAPED}}}\n</tool_call>\n'
                       f'<tool_call>\n{{"name": "b", "arguments": {UNICODE_RAW}}}\n</tool_call>',
                       None, [("a", canon(UNICODE_ESCAPED), None), ("b", canon(UNICODE_RAW), None)], True),
    "hermes_raw_newline_in_string": ("hermes", '<tool_call>\n{"name": "write", "arguments": {"text": "line 1\nline 2'
                                     '\tend"}}\n</tool_call>',
                                     None, [("write", '{"text": "line 1\\nline 2\\tend"}', None)], True),
    "hermes_arguments_as_string": ("hermes",
                                   '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1, \\"b\\": \\"}\\"}"}\n'
                                   "</tool_call>",
                                   None, [("f", '{"a": 1, "b": "}"}', None)], True),
    "hermes_arguments_first_and_extra_keys": ("hermes",
                                              '<tool_call>\n{"type": "function", "arguments": {"x": [1, 2]}, '
                                              '"name": "f", "extra": {"ignored": true}}\n</tool_call>',
                                              None, [("f", '{"x": [1, 2]}', None)], True),
    "hermes_no_arguments": ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', None,
                            [("get_time", "{}", None)], True),
    "hermes_no_call": ("hermes", "The capital of France is Paris. Tags like <tool_calls> or <tool_c and a < b stay.",
                       "The capital of France is Paris. Tags like <tool_calls> or <tool_c and a < b stay.", [], True),
    "hermes_text_after": ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nDone <b>.',
                          "Done <b>.", [("f", "{}", None)], True),
    "hermes_single_quotes": ("hermes", "Sure.\n<tool_call>\n{'name': 'f', 'arguments': {'a': 1}}\n</tool_call>",
                             "Sure.\n<tool_call>\n{'name': 'f', 'arguments': {'a': 1}}\n</tool_call>", [], False),
    "hermes_python_call": ("hermes", '<tool_call>\nget_weather(city="Paris")\n</tool_call>',
                           '<tool_call>\nget_weather(city="Paris")\n</tool_call>', [], False),
    "hermes_python_dict_args": ("hermes", '<tool_call>\n{"name": "f", "arguments": {\'a\': 1}}\n</tool_call>',
                                '<tool_call>\n{"name": "f", "arguments": {\'a\': 1}}\n</tool_call>', [], False),
    "hermes_no_name": ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
                       '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', [], False),
    "hermes_good_then_bad": ("hermes",
                             '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                             '<tool_call>\n{"name": "g", "arguments": [oops]}\n</tool_call>',
                             '<tool_call>\n{"name": "g", "arguments": [oops]}\n</tool_call>',
                             [("f", '{"a": 1}', None)], False),
    "hermes_cut_inside_arguments": ("hermes",
                                    '<tool_call>\n{"name": "write", "arguments": {"path": "a.txt", "n": 12, '
                                    '"text": "hel\\u00',
                                    None, [("write", '{"path": "a.txt", "n": 12, "text": "hel"}', None)], False),
    "hermes_cut_before_arguments": ("hermes", 'Ok <tool_call>\n{"name": "wri', 'Ok <tool_call>\n{"name": "wri', [],
                                    False),
    "hermes_broken_after_commit": ("hermes",
                                   '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": tru}}\n</tool_call>',
                                   '}}\n', [("f", '{"a": 1}', None)], False),  # from where it broke
    "hermes_junk_after_object": ("hermes", '<tool_call>\n{"name": "f", "arguments": {}} oops\n</tool_call>',
                                 "oops\n", [("f", "{}", None)], False),
    # -- llama3_json: Llama 3.1 / 3.2 / 3.3 --------------------------------------------------------
    "llama_one": ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
                  [("get_weather", '{"city": "Paris", "days": 3}', None)], True),
    "llama_python_tag": ("llama3_json", '<|python_tag|>{"name": "search", "arguments": {"query": "jax pallas"}}', None,
                         [("search", '{"query": "jax pallas"}', None)], True),
    "llama_several": ("llama3_json",
                      '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [1, {"z": "};{"}]}}'
                      ';{"type": "function", "name": "c", "parameters": {}}',
                      None, [("a", '{"x": 1}', None), ("b", '{"y": [1, {"z": "};{"}]}', None), ("c", "{}", None)],
                      True),
    "llama_leading_blank": ("llama3_json", ' \n{"name": "f", "parameters": {"a": true, "b": null, "c": -0}}', None,
                            [("f", '{"a": true, "b": null, "c": 0}', None)], True),
    "llama_no_call": ("llama3_json", "The weather in Paris is sunny {mostly}.",
                      "The weather in Paris is sunny {mostly}.", [], True),
    "llama_json_answer": ("llama3_json", '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', [], True),
    "llama_json_person": ("llama3_json", '{"name": "Ada Lovelace", "born": 1815}',
                          '{"name": "Ada Lovelace", "born": 1815}', [], True),
    "llama_content_first": ("llama3_json", 'Here you go: {"name": "f", "parameters": {}}',
                            'Here you go: {"name": "f", "parameters": {}}', [], True),
    "llama_unquoted_key": ("llama3_json", '{"name": "f", "parameters": {a: 1}}', '{"name": "f", "parameters": {a: 1}}',
                           [], False),
    "llama_tag_then_python": ("llama3_json", '<|python_tag|>brave_search.call(query="jax")',
                              '<|python_tag|>brave_search.call(query="jax")', [], False),
    "llama_text_after": ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and some words',
                         "and some words", [("f", '{"a": 1}', None)], False),
    # -- mistral ----------------------------------------------------------------------------------
    "mistral_one": ("mistral",
                    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                    '"format": "celsius"}}]',
                    None, [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}', None)], True),
    "mistral_several": ("mistral",
                        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather",'
                        ' "arguments":{"city": "San Francisco", "state": "CA"}}]',
                        None, [("add", '{"a": 3.5, "b": 4}', None),
                               ("get_current_weather", '{"city": "San Francisco", "state": "CA"}', None)], True),
    "mistral_content_first": ("mistral", 'Let me add those.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]',
                              "Let me add those.", [("add", '{"a": 1}', None)], True),
    "mistral_model_id": ("mistral",
                         '[TOOL_CALLS] [{"id": "abcDEF123", "name": "f", "arguments": {}}, '
                         '{"id": "not-valid", "name": "g", "arguments": {}}]',
                         None, [("f", "{}", "abcDEF123"), ("g", "{}", None)], True),
    "mistral_v11": ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 6}',
                    None, [("add", '{"a": 3.5, "b": 4}', None), ("multiply", '{"a": 3, "b": 6}', None)], True),
    "mistral_v11_call_id": ("mistral", 'Checking.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}',
                            "Checking.", [("get_weather", '{"city": "Paris"}', "a1B2c3D4e")], True),
    "mistral_v11_args_token_skipped": ("mistral", '[TOOL_CALLS]add_this{"a": 1, "b": [2, "]"]}', None,
                                       [("add_this", '{"a": 1, "b": [2, "]"]}', None)], True),
    "mistral_no_call": ("mistral", "Paris is the capital [citation needed] of France.",
                        "Paris is the capital [citation needed] of France.", [], True),
    "mistral_not_json": ("mistral", "[TOOL_CALLS] not json at all", "[TOOL_CALLS] not json at all", [], False),
    "mistral_trailing_comma": ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1,}}]', "}}]",
                               [("add", '{"a": 1}', None)], False),
    "mistral_cut": ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": [1, {"b": "x', None,
                    [("add", '{"a": [1, {"b": "x"}]}', None)], False),
}


def run_stream(streamer, pieces):
    deltas = [streamer.feed(p) for p in pieces]
    deltas.append(streamer.finish())
    return deltas


def collect(deltas):
    """(content, [[id, name, arguments]]) of a stream, checking the shape of its tool-call deltas."""
    content = "".join(d.content or "" for d in deltas)
    calls: list[list[str]] = []
    for d in deltas:
        for c in d.tool_calls:
            if c.index == len(calls):
                assert c.id and c.name, f"call {c.index}'s first delta carries its id and name"
                calls.append([c.id, c.name, c.arguments])
            else:
                assert c.index == len(calls) - 1, "calls stream one after the other, in order"
                assert c.id is None and c.name is None, "only a call's first delta carries id and name"
                calls[-1][2] += c.arguments
    return content, calls


def check_calls(parser_name, got, expected):
    """`got` ([id, name, arguments] lists) carry the expected names, arguments and ids."""
    assert [(name, args) for _, name, args in got] == [(name, args) for name, args, _ in expected]
    ids = [i for i, _, _ in got]
    assert len(set(ids)) == len(ids)
    for call_id, (_, _, model_id) in zip(ids, expected):
        if model_id is not None:
            assert call_id == model_id
        else:
            assert (MISTRAL_ID if parser_name == "mistral" else OPENAI_ID).match(call_id), call_id


@pytest.mark.parametrize("case", sorted(CASES))
def test_extract(case):
    parser_name, text, content, calls, _ = CASES[case]
    found = get_tool_parser(parser_name).extract(text)
    assert found.content == content
    check_calls(parser_name, [[c.id, c.name, c.arguments] for c in found.tool_calls], calls)
    assert found.tools_called == bool(calls)
    for c in found.tool_calls:
        json.loads(c.arguments)  # always valid JSON, even when the output was cut short
    if not calls:
        assert found.content == text, "an output without calls is content, verbatim"


def check_stream_matches_whole(parser, text, pieces, well_formed):
    whole = parser.extract(text)
    s = parser.streamer()
    deltas = run_stream(s, pieces)
    content, calls = collect(deltas)
    assert content == (whole.content or "")
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert s.tools_called == bool(whole.tool_calls)
    assert all(d.reasoning is None for d in deltas)
    if well_formed:
        for d in deltas:
            assert not any(m in (d.content or "") for m in MARKERS), d.content


@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_every_boundary(case):
    parser_name, text, _, _, well_formed = CASES[case]
    parser = get_tool_parser(parser_name)
    check_stream_matches_whole(parser, text, list(text), well_formed)
    for i in range(len(text) + 1):
        check_stream_matches_whole(parser, text, [text[:i], text[i:]], well_formed)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.data())
def test_stream_random_chunks(case, data):
    parser_name, text, _, _, well_formed = CASES[case]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    check_stream_matches_whole(get_tool_parser(parser_name), text, pieces, well_formed)


def test_content_goes_out_at_once_and_arguments_stream():
    s = get_tool_parser("hermes").streamer()
    assert s.feed("Let me check a < b.").content == "Let me check a < b."
    assert s.feed("\n<tool").content == "\n"  # "<tool" may start a call: held
    assert s.feed("_call>\n").empty
    assert s.feed('{"name": "get_weather", ').empty  # the name alone does not make a call yet
    d = s.feed('"arguments": {"city": "Par')
    assert d.content is None and len(d.tool_calls) == 1 and s.tools_called
    first = d.tool_calls[0]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"city": "Par')
    assert OPENAI_ID.match(first.id)
    d = s.feed('is", "days": 1')  # the number may go on: held
    assert [(c.index, c.id, c.name, c.arguments) for c in d.tool_calls] == [(0, None, None, 'is"')]
    d = s.feed("0}}\n</tool_call>")
    assert [c.arguments for c in d.tool_calls] == [', "days": 10}']
    assert s.finish().empty
    # text that turns out not to be a marker is released as content
    s = get_tool_parser("hermes").streamer()
    assert s.feed("a <tool_c").content == "a "
    assert s.feed("all_me>").content == "<tool_call_me>"
    s = get_tool_parser("mistral").streamer()
    assert s.feed("Hi [TOOL_").content == "Hi "
    assert s.feed("CALLS]add[AR").empty
    d = s.feed('GS]{"a": "x')
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("add", '{"a": "x')]
    assert merge_deltas(s.feed('"'), s.finish()).tool_calls[0].arguments == '"}'


def test_llama_holds_json_until_it_is_a_call():
    s = get_tool_parser("llama3_json").streamer()
    assert s.feed(" ").empty and s.feed('{"name": "f"').empty
    d = s.feed(', "parameters": {"q": "x"')
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("f", '{"q": "x"')]
    s = get_tool_parser("llama3_json").streamer()
    assert s.feed("Hello").content == "Hello"
    assert s.feed(' {"name": "f", "parameters": {}}').content == ' {"name": "f", "parameters": {}}'


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12)
ARGS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5)
LAYOUTS = st.sampled_from([
    dict(), dict(ensure_ascii=False), dict(separators=(",", ":")), dict(indent=2), dict(indent=0, ensure_ascii=False)])
WRAPS = {
    "hermes": lambda name, args: f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
    "llama3_json": lambda name, args: f'{{"name": "{name}", "parameters": {args}}}',
    "mistral": lambda name, args: f'[TOOL_CALLS] [{{"name": "{name}", "arguments": {args}}}]',
    "mistral_v11": lambda name, args: f"[TOOL_CALLS]{name}[ARGS]{args}",
}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(WRAPS)), ARGS, LAYOUTS, st.data())
def test_any_json_arguments(form, args, layout, data):
    """Any arguments object, however the model lays it out, comes back as json.dumps writes it."""
    parser = get_tool_parser(form.split("_v11")[0])
    text = WRAPS[form]("do_it", json.dumps(args, **layout))
    found = parser.extract(text)
    assert found.content is None
    assert [(c.name, c.arguments) for c in found.tool_calls] == [("do_it", json.dumps(args, ensure_ascii=False))]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    check_stream_matches_whole(parser, text, pieces, True)
    # cut anywhere (max_tokens): either no call and every character is content, or one call whose
    # arguments are valid JSON and no content; a stream of the cut text says the same
    cut = text[:data.draw(st.integers(0, len(text)))]
    found = parser.extract(cut)
    if found.tool_calls:
        assert len(found.tool_calls) == 1 and found.content is None
        json.loads(found.tool_calls[0].arguments)
    else:
        assert (found.content or "") == cut
    check_stream_matches_whole(parser, cut, list(cut), False)


def test_get_tool_parser():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    for name in TOOL_PARSERS:
        assert get_tool_parser(name).name == name
    with pytest.raises(ValueError, match=r"'pythonic'.*hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")


def _fixture_templates():
    with open("tests/fixtures/chat_template_renderings.json") as f:
        return json.load(f)["templates"]


def test_tool_parser_for():
    templates = _fixture_templates()
    # the template decides where it shows a format
    assert tool_parser_for("Qwen3ForCausalLM", templates["thinking_chatml"]) == "hermes"
    assert tool_parser_for("LlamaForCausalLM", templates["headers_with_date"]) == "llama3_json"
    assert tool_parser_for("llama", "{{ '<|python_tag|>' + x }}") == "llama3_json"
    assert tool_parser_for("llama", "{%- if tools %}[AVAILABLE_TOOLS]...[TOOL_CALLS]{% endif %}") == "mistral"
    assert tool_parser_for("LlamaForCausalLM", "{{ '<tool_call>' }}") == "hermes"  # Hermes-3 on Llama
    # else the family
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "qwen2", "qwen3_moe", "qwen3moe"):
        assert tool_parser_for(arch, None) == "hermes"
    for arch in ("MistralForCausalLM", "MixtralForCausalLM", "mistral", "mixtral"):
        assert tool_parser_for(arch, templates["inst_blocks"]) == "mistral"
    # a Llama architecture alone says nothing (SmolLM2, Llama 2), nor does an unknown family
    assert tool_parser_for("LlamaForCausalLM", templates["chatml"]) is None
    assert tool_parser_for("llama", None) is None
    assert tool_parser_for("Gemma3ForCausalLM", None) is None


def _tokenizer(tmp_path):
    """A real jaxinfer Tokenizer from a small tokenizer.json: [TOOL_CALLS] special, <tool_call> not."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, decoders
    from tokenizers import AddedToken

    from jaxinfer.text.tokenizer import Tokenizer

    alphabet = sorted(set('abcdefghijklmnopqrstuvwxyz_ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]":,. '))
    vocab = {"<unk>": 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("</s>", special=True)])
    hf.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer.from_dir(tmp_path)


def test_special_token_markers(tmp_path):
    tok = _tokenizer(tmp_path)
    text = 'Hi[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.token_to_id("[TOOL_CALLS]") in ids
    mistral = get_tool_parser("mistral", tok)
    assert mistral.keeps_special_tokens()
    # why it matters: decoded the usual way, the marker is gone and the call is text
    assert mistral.extract(tok.decode(ids, skip_special_tokens=True)).tool_calls == []
    found = mistral.extract(tok.decode(ids, skip_special_tokens=not mistral.keeps_special_tokens()))
    assert [(c.name, c.arguments) for c in found.tool_calls] == [("add", '{"a": 1}')] and found.content == "Hi"
    hermes = get_tool_parser("hermes", tok)
    assert not hermes.keeps_special_tokens()  # <tool_call> is an ordinary added token here
    ids = tok.encode('<tool_call>{"name": "f", "arguments": {}}</tool_call>', add_special_tokens=False)
    assert [c.name for c in hermes.extract(tok.decode(ids)).tool_calls] == ["f"]
    assert not get_reasoning_parser("qwen3", tok).keeps_special_tokens()


# ---------------------------------------------------------------------------
# Reasoning.
# ---------------------------------------------------------------------------


def _renderings():
    with open("tests/fixtures/chat_template_renderings.json") as f:
        cases = json.load(f)["cases"]
    return {c["name"]: c["expected"] for c in cases if c["template"] == "thinking_chatml" and "expected" in c}


THINK = "<think>\nThe user asks 2+2.\n\nThat is 4.\n</think>\n\nThe answer is 4."
# (parser, output, prompt kind, reasoning, content); prompt kinds: None, "open" (the template opened
# <think>), "closed" (enable_thinking=false wrote an empty block), "plain" (a prompt without think tags)
REASONING_CASES = [
    ("qwen3", THINK, None, "The user asks 2+2.\n\nThat is 4.", "The answer is 4."),
    ("qwen3", THINK, "plain", "The user asks 2+2.\n\nThat is 4.", "The answer is 4."),
    ("qwen3", "Hello there!\n", "plain", None, "Hello there!\n"),
    ("qwen3", "<think>\n\n</think>\n\nHi", None, None, "Hi"),
    ("qwen3", "The answer is 4.", "closed", None, "The answer is 4."),
    ("qwen3", "\n\nThe answer is 4.", "closed", None, "The answer is 4."),
    ("qwen3", "I should add.\n</think>\n\n4", "open", "I should add.", "4"),
    ("qwen3", "<think>\nstill thinking when max_tokens hit", None, "still thinking when max_tokens hit", None),
    ("qwen3", "<think>\nx\n</think>", None, "x", None),
    ("qwen3", "a </think> b", None, None, "a </think> b"),  # no opening tag and no prompt: content
    ("qwen3", "<thinking> is a word</think>", None, None, "<thinking> is a word</think>"),
    ("qwen3", "", None, None, None),
    ("deepseek_r1", "Okay, 2+2.\n</think>\n\n**4**", None, "Okay, 2+2.", "**4**"),
    ("deepseek_r1", THINK, None, "The user asks 2+2.\n\nThat is 4.", "The answer is 4."),
    ("deepseek_r1", "no end tag at all", None, "no end tag at all", None),
    ("deepseek_r1", "plain answer", "closed", None, "plain answer"),
    ("deepseek_r1", "<think>\na\nb\n\n</think>\n\n\nc\nd\n", "open", "a\nb", "c\nd\n"),
]


def _prompt(kind):
    r = _renderings()
    return {None: None, "plain": r["thinking_enabled"], "closed": r["thinking_disabled"],
            "open": r["thinking_enabled"] + "<think>\n"}[kind]


def test_fixture_prompts_are_what_the_cases_say():
    assert _prompt("closed").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<think>" not in _prompt("plain")


@pytest.mark.parametrize("i", range(len(REASONING_CASES)))
def test_reasoning_split(i):
    name, text, kind, reasoning, content = REASONING_CASES[i]
    assert get_reasoning_parser(name).split(text, prompt_text=_prompt(kind)) == (reasoning, content)


def check_reasoning_stream(parser, text, prompt, pieces):
    whole = parser.split(text, prompt_text=prompt)
    deltas = run_stream(parser.streamer(prompt), pieces)
    reasoning = "".join(d.reasoning or "" for d in deltas) or None
    content = "".join(d.content or "" for d in deltas) or None
    assert (reasoning, content) == whole
    assert all(not d.tool_calls for d in deltas)
    return deltas


@pytest.mark.parametrize("i", range(len(REASONING_CASES)))
def test_reasoning_stream_every_boundary(i):
    name, text, kind, _, _ = REASONING_CASES[i]
    parser, prompt = get_reasoning_parser(name), _prompt(kind)
    deltas = check_reasoning_stream(parser, text, prompt, list(text))
    if "<think>" in text and "</think>" in text and kind != "closed":
        for d in deltas:
            assert "think>" not in (d.reasoning or "") and "think>" not in (d.content or "")
    for j in range(len(text) + 1):
        check_reasoning_stream(parser, text, prompt, [text[:j], text[j:]])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(REASONING_CASES) - 1), st.data())
def test_reasoning_stream_random_chunks(i, data):
    name, text, kind, _, _ = REASONING_CASES[i]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    check_reasoning_stream(get_reasoning_parser(name), text, _prompt(kind), pieces)


def test_reasoning_streams_before_the_end_tag():
    s = get_reasoning_parser("qwen3").streamer()
    assert s.feed("<thi").empty
    assert s.feed("nk>\nFirst").reasoning == "First"
    assert s.feed(" step.\n").reasoning == " step."  # the newline may end the reasoning: held
    assert s.feed("Second.\n</th").reasoning == "\nSecond."
    d = s.feed("ink>\n\nAnswer")
    assert (d.reasoning, d.content) == (None, "Answer")
    assert s.finish().empty
    s = get_reasoning_parser("qwen3").streamer()
    assert s.feed("Hi").content == "Hi"  # Qwen3 without <think>: content at once


def test_get_reasoning_parser():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match=r"'granite'.*deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


# ---------------------------------------------------------------------------
# Both, per choice.
# ---------------------------------------------------------------------------

QWEN3_TOOLS = ("<think>\nThe user wants the weather; call get_weather.\n</think>\n\n"
               "I'll look it up.\n<tool_call>\n"
               '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
CHAIN_CASES = [
    (QWEN3_TOOLS, "plain", "The user wants the weather; call get_weather.", "I'll look it up.\n",
     [("get_weather", '{"city": "Zürich", "unit": "c"}'), ("now", "{}")]),
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "closed", None, None, [("now", "{}")]),
    # a call written inside the reasoning is thought, not a call
    ('<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call></think>No call.', None,
     'maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>', "No call.", []),
]


@pytest.mark.parametrize("i", range(len(CHAIN_CASES)))
def test_chain(i):
    text, kind, reasoning, content, calls = CHAIN_CASES[i]
    rp, tp, prompt = get_reasoning_parser("qwen3"), get_tool_parser("hermes"), _prompt(kind)
    r, c, found = parse_whole(text, rp, tp, prompt_text=prompt)
    assert (r, c, [(t.name, t.arguments) for t in found]) == (reasoning, content, calls)
    splits = [list(text)] + [[text[:j], text[j:]] for j in range(len(text) + 1)]
    for pieces in splits:
        s = chain(rp.streamer(prompt), tp.streamer())
        deltas = run_stream(s, pieces)
        got_content, got_calls = collect(deltas)
        assert ("".join(d.reasoning or "" for d in deltas) or None) == reasoning
        assert (got_content or None) == content
        assert [(n, a) for _, n, a in got_calls] == calls
        assert s.tools_called == bool(calls)


def test_chain_without_one_side():
    rp, tp = get_reasoning_parser("qwen3"), get_tool_parser("hermes")
    s = chain(None, tp.streamer())
    d = merge_deltas(s.feed("<think>a</think>"), s.finish())
    assert (d.reasoning, d.content) == (None, "<think>a</think>")
    s = chain(rp.streamer(), None)
    d = merge_deltas(s.feed('<think>a</think><tool_call>{"name": "f"}</tool_call>'), s.finish())
    assert (d.reasoning, d.content, d.tool_calls) == ("a", '<tool_call>{"name": "f"}</tool_call>', [])
    assert not s.tools_called
    assert parse_whole("x", None, None) == (None, "x", [])
    assert chain(None, None).feed("y") == DeltaMessage(content="y")
