"""Chat-template features render exactly as Hugging Face transformers renders them.

``tests/fixtures/chat_template_renderings.json`` holds transformers' own
renderings (``apply_chat_template(..., tokenize=False)``) of small templates in
the style of the Qwen3, Gemma 3, Llama 3 and Mistral templates, made by
``scripts/make_chat_template_fixtures.py`` (its docstring says how). Each case
is rendered again here with `jaxinfer.text.chat_template` and must come out
identical, or fail with the same message. ``strftime_now`` reads a clock pinned
to the fixture's ``fixed_now`` in both renderings.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

import pytest

import jaxinfer.text.chat_template as chat_template
from jaxinfer.text.chat_template import ChatTemplateError, render_chat_template

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "chat_template_renderings.json")
with open(FIXTURE, encoding="utf-8") as _f:
    REF = json.load(_f)
CASES = {case["name"]: case for case in REF["cases"]}
FIXED_NOW = datetime.fromisoformat(REF["fixed_now"])

# The reference tokenizer sets bos/eos/unk only; ours reports unset tokens as None, which must stay undefined.
SPECIAL_TOKENS = {**REF["special_tokens"], "pad_token": None, "sep_token": None}


class _FixedDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW if tz is None else FIXED_NOW.replace(tzinfo=tz)


@pytest.fixture
def fixed_clock(monkeypatch):
    monkeypatch.setattr(chat_template, "datetime", _FixedDatetime)


def render_case(name: str, **overrides) -> str:
    case = CASES[name]
    kwargs = {**case["kwargs"], **overrides}
    return render_chat_template(REF["templates"][case["template"]], case["messages"],
                                special_tokens=SPECIAL_TOKENS, **kwargs)


def test_fixture_comes_from_transformers():
    assert REF["transformers_version"] == "5.23.0"
    assert REF["special_tokens"] == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert len(CASES) == len(REF["cases"]) >= 40


@pytest.mark.parametrize("name", sorted(CASES))
def test_renders_like_transformers(name, fixed_clock):
    case = CASES[name]
    if "expected" in case:
        assert render_case(name) == case["expected"]
    else:
        with pytest.raises(ChatTemplateError) as e:
            render_case(name)
        if case["error"]["type"] == "SecurityError":  # our own wording; the same refusal and attribute
            assert "namespace" in str(e.value) and "'_hidden'" in str(e.value)
        else:  # raise_exception's message, or Jinja's own, word for word
            assert str(e.value).endswith(case["error"]["message"])


def test_enable_thinking_false_adds_an_empty_think_block():
    default = render_case("thinking_default")
    enabled = render_case("thinking_enabled")
    disabled = render_case("thinking_disabled")
    assert default == enabled == CASES["thinking_enabled"]["expected"]
    assert disabled == enabled + "<think>\n\n</think>\n\n" == CASES["thinking_disabled"]["expected"]
    assert enabled.endswith("<|im_start|>assistant\n")
    # Only the generation prompt carries it: without one the variable changes nothing.
    no_prompt = render_case("thinking_disabled_no_prompt")
    assert no_prompt == render_case("thinking_disabled_no_prompt", enable_thinking=True)


def test_raise_exception_gives_the_templates_message_as_a_value_error():
    with pytest.raises(ChatTemplateError) as e:
        render_case("turns_not_alternating")
    assert isinstance(e.value, ValueError)  # the processor and server report ValueError as bad input
    assert "Turns must alternate user/assistant/user/assistant/..., got user at turn 1" in str(e.value)
    with pytest.raises(ValueError, match="Unknown message role: narrator"):
        render_case("thinking_unknown_role")


def test_strftime_now_reads_the_clock():
    template = "{{ strftime_now('%Y-%m-%d %H') }}"
    before = datetime.now().strftime("%Y-%m-%d %H")
    out = render_chat_template(template, [{"role": "user", "content": "x"}])
    after = datetime.now().strftime("%Y-%m-%d %H")
    assert out in (before, after)


def test_processor_passes_chat_template_kwargs_and_reports_template_errors(tmp_path):
    """End to end: tokenizer directory -> Tokenizer -> InputProcessor, as a request arrives."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    from jaxinfer.engine.processor import InputProcessor
    from jaxinfer.text.tokenizer import load_tokenizer

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    backend = Tokenizer(WordLevel({t: i for i, t in enumerate(specials + ["hi"])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(specials[1:])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False,
              "chat_template": REF["templates"]["thinking_chatml"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    proc = InputProcessor(tok, vocab_size=tok.vocab_size, max_model_len=256, max_logprobs=0)

    messages = CASES["thinking_disabled"]["messages"]
    off = proc.tokenize(messages=messages, chat_template_kwargs={"enable_thinking": False})
    on = proc.tokenize(messages=messages, chat_template_kwargs={"enable_thinking": True})
    assert off.text == CASES["thinking_disabled"]["expected"]
    assert on.text == CASES["thinking_enabled"]["expected"]
    assert off.ids[-2:] == [specials.index("<think>"), specials.index("</think>")]

    with pytest.raises(ValueError, match="Unknown message role: narrator"):
        proc.tokenize(messages=[{"role": "narrator", "content": "hi"}])
    # A template variable that shares a name with a render_chat_template parameter is just a variable.
    tok.chat_template = "{{ template }}|{{ messages[0].content }}"
    assert proc.tokenize(messages=[{"role": "user", "content": "hi"}],
                         chat_template_kwargs={"template": "t"}).text == "t|hi"


def test_continue_final_message_refuses_a_template_that_drops_the_text():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]
    with pytest.raises(ValueError, match="does not appear"):
        render_chat_template("{% for m in messages %}{{ m.role }}{% endfor %}{{ messages | length }}content", msgs,
                             add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="no 'reasoning_content' to continue"):
        render_chat_template("{{ messages[-1].reasoning_content }}", msgs, add_generation_prompt=False,
                             continue_final_message="reasoning_content")
    msgs[-1]["reasoning_content"] = "thinking so far"
    with pytest.raises(ValueError, match="never reads"):
        render_chat_template("{{ messages[-1].content }}", msgs, add_generation_prompt=False,
                             continue_final_message="reasoning_content")


def test_tools_and_documents_must_be_dicts():
    msgs = [{"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match=r"tools\[1\] must be a dict"):
        render_chat_template("{{ tools }}", msgs, tools=[{"name": "f"}, "g"])
    with pytest.raises(ValueError, match=r"documents\[0\] must be a dict"):
        render_chat_template("{{ documents }}", msgs, documents=["text"])


def test_template_sees_plain_data_only():
    class Opaque:
        def dangerous(self):
            raise AssertionError("a template must not reach this")

    out = render_chat_template("{{ x }}|{{ y }}|{{ t | tojson }}", [{"role": "user", "content": "q"}],
                               x=Opaque(), y=b"raw", t=(1, 2))
    assert out == "<Opaque>|<bytes>|[1, 2]"


def _word_tokenizer_dir(path, config):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    backend = Tokenizer(WordLevel({"<unk>": 0, "</s>": 1, "hi": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["</s>"])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>", **config}))


@pytest.mark.parametrize("layout", ["config list", "jinja files"])
def test_a_tool_use_template_renders_requests_with_tools(tmp_path, layout):
    """transformers' named templates: "tool_use" when tools are given, "default" otherwise, from the
    list form in tokenizer_config.json or from additional_chat_templates/*.jinja; they survive a save."""
    from jaxinfer.text.tokenizer import load_tokenizer

    default = "plain:{% for m in messages %}{{ m.content }}{% endfor %}"
    tool_use = "tools={{ tools | length }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    if layout == "config list":
        _word_tokenizer_dir(tmp_path, {"chat_template": [{"name": "default", "template": default},
                                                         {"name": "tool_use", "template": tool_use}]})
    else:
        _word_tokenizer_dir(tmp_path, {})
        (tmp_path / "chat_template.jinja").write_text(default)
        (tmp_path / "additional_chat_templates").mkdir()
        (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for tok in (load_tokenizer(tmp_path), None):
        if tok is None:  # round trip through the tokenizer's own save (what the model cache stores)
            saved = tmp_path / "saved"
            load_tokenizer(tmp_path).save(str(saved))
            tok = load_tokenizer(saved)
        assert tok.apply_chat_template(msgs) == "plain:hi"
        assert tok.apply_chat_template(msgs, tools=tools) == "tools=1:hi"
