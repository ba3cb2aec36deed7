"""The input processor (`jaxinfer.engine.processor`): one front door for the library, the CLI and the server.

Checked with the real SmolLM2 tokenizer (no model weights are needed: the
processor turns input into a `Request`, it runs nothing).
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import requires_smollm2
from jaxinfer.config import GenerationDefaults
from jaxinfer.engine.processor import InputProcessor
from jaxinfer.sampling_params import MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from jaxinfer.sampling_params import SamplingParams as SP

pytestmark = requires_smollm2
MAX_LEN = 2048


@pytest.fixture(scope="module")
def tok():
    from jaxinfer.loading import model_cache
    from jaxinfer.config import DEFAULT_MODEL
    from jaxinfer.loading.weights import resolve_model

    return model_cache.load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def proc(tok):
    return InputProcessor(
        tok, vocab_size=tok.vocab_size, max_model_len=MAX_LEN, max_logprobs=5,
        generation=GenerationDefaults(temperature=0.3, top_p=0.8, eos_token_ids=(2,)),
    )


# Text a token can cover the most of: long runs of one character, spaces, newlines, digits, mixed scripts.
_texts = st.one_of(
    st.text(min_size=1, max_size=400),
    st.builds(lambda c, n: c * n, st.sampled_from([" ", "\n", "#", "=", "-", "a", "\t", "é", "0"]),
              st.integers(1, 3000)),
    st.lists(st.sampled_from(["    ", "\n", "################", " ====", "hello", "<|im_start|>", "🙂", "\x16", "\U00050000"]),
             min_size=1, max_size=300).map("".join),
)


@given(text=_texts)
@settings(max_examples=150, deadline=None)
def test_min_tokens_is_a_lower_bound_of_the_token_count(tok, text):
    """The bound the early length check relies on (kept bytes / max_bytes_per_token) never exceeds the count."""
    assert len(tok.encode(text, add_special_tokens=False)) >= tok.min_tokens(text)


def test_a_prompt_too_long_in_bytes_is_refused_before_tokenizing_with_the_limits_named(proc, tok):
    huge = "x" * (5 * 1024 * 1024)
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        proc.process(huge, SP(max_tokens=4))
    assert time.perf_counter() - t0 < 0.5  # tokenizing 5 MB takes seconds on this kind of machine
    msg = str(e.value)
    assert f"{len(huge):,} bytes" in msg and f"{tok.max_bytes_per_token} bytes" in msg
    assert f"(max_model_len) is {MAX_LEN} tokens" in msg
    with pytest.raises(ValueError, match=r"conversation \(rendered with the chat template\) is 5,24\d,\d\d\d bytes"):
        proc.process(None, SP(max_tokens=4), messages=[{"role": "user", "content": huge}])


def test_a_prompt_just_over_the_context_in_tokens_is_refused_by_its_token_count(proc):
    text = "hello " * MAX_LEN  # few bytes per token: passes the byte check, fails the token count
    with pytest.raises(ValueError, match=rf"the prompt is \d+ tokens long, but the model's context length"):
        proc.process(text, SP(max_tokens=4))


def test_chat_counts_user_and_template_tokens_and_renders_the_models_template(proc, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    req = proc.process(None, SP(max_tokens=8), messages=messages)
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert req.prompt == text and req.prompt_ids == tok.encode(text, add_special_tokens=False)
    m = req.metrics
    user = sum(len(tok.encode(x["content"], add_special_tokens=False)) for x in messages)
    assert m.user_tokens == user and m.template_tokens == len(req.prompt_ids) - user > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(messages=[]), "messages must be a non-empty list"),
        (dict(messages=[{"content": "hi"}]), "messages[0].role must be a non-empty string"),
        (dict(messages=[{"role": "user", "content": "a"}, "hi"]), "messages[1] must be a dict"),
        (dict(messages=[{"role": "user", "content": "a"}], chat_template_kwargs={"messages": []}),
         "chat_template_kwargs may not set messages"),
        (dict(prompt=""), "the prompt is empty"),
        (dict(prompt=[]), "the prompt is empty: it must contain at least one token"),
        (dict(prompt=[1, -1]), "prompt token id -1 at position 1 is out of range"),
        (dict(prompt=[1, True]), "prompt token id True at position 1"),
        (dict(prompt=b"bytes"), "a prompt is a string or a list of token ids"),
        (dict(prompt="hi", params=SP(logprobs=6)), "greater than max allowed: 5"),
        (dict(prompt="hi", params=SP(max_tokens=MAX_LEN)), "However, you requested"),
        (dict(prompt="hi", request_id=""), "request_id must be a non-empty string"),
        (dict(prompt="hi", priority="high"), "priority must be an integer"),
        (dict(messages=[{"role": "user", "content": "a"}], chat_template_kwargs={"special_tokens": 1}),
         "chat_template_kwargs may not set special_tokens"),
    ],
)
def test_bad_input_names_the_field_and_the_limit(proc, kwargs, message):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", None)
    params = kwargs.pop("params", SP(max_tokens=4))
    with pytest.raises(ValueError) as e:
        proc.process(prompt, params, **kwargs)
    assert message in str(e.value)


def test_defaults_and_fitting_max_tokens(proc):
    req = proc.process("Hello", None)
    assert (req.params.temperature, req.params.top_p) == (0.3, 0.8)  # the model's generation defaults
    assert 2 in req.stop_token_ids  # its eos ids stop generation
    n = len(req.prompt_ids)
    fitted = proc.process("Hello", SP(max_tokens=10 * MAX_LEN), fit_max_tokens=True)
    assert fitted.max_tokens == MAX_LEN - n
    assert proc.process("Hello", SP(max_tokens=None)).max_tokens == MAX_LEN - n


def test_stop_conditions_are_bounded_in_count_and_size():
    SP(stop=["s"] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))  # at the limits: fine
    SP(stop=["é" * (MAX_STOP_STRING_BYTES // 2)])
    for kw, message in (
        (dict(stop=["s"] * (MAX_STOP_STRINGS + 1)), f"stop may hold at most {MAX_STOP_STRINGS} strings, got 33"),
        (dict(stop=["é" * (MAX_STOP_STRING_BYTES // 2 + 1)]), f"at most {MAX_STOP_STRING_BYTES} bytes"),
        (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), f"at most {MAX_STOP_TOKEN_IDS} ids"),
    ):
        with pytest.raises(ValueError) as e:
            SP(**kw)
        assert message in str(e.value)


def test_a_tokenizer_that_collapses_whitespace_has_no_byte_bound_and_long_blank_prompts_still_fit(tok):
    """SentencePiece's default normalizer removes runs of spaces: 100,000 spaces may be one token, so
    the byte pre-check must not apply (the prompt is tokenized and counted instead)."""
    import sentencepiece as spm

    from jaxinfer.text.tokenizer import Tokenizer, _SPBackend
    from test_tokenizer import train_tiny_sentencepiece

    exact = Tokenizer(_SPBackend(spm.SentencePieceProcessor(model_proto=train_tiny_sentencepiece())))
    assert exact.max_bytes_per_token is not None  # identity normalizer, whitespace kept: bounded
    model = train_tiny_sentencepiece(remove_extra_whitespaces=True)
    sp_tok = Tokenizer(_SPBackend(spm.SentencePieceProcessor(model_proto=model)))
    assert sp_tok.max_bytes_per_token is None
    text = "hello" + " " * 100_000 + "world"
    assert len(sp_tok.encode(text)) < 20
    proc = InputProcessor(sp_tok, vocab_size=sp_tok.vocab_size, max_model_len=64, max_logprobs=0)
    assert len(proc.process(text, SP(max_tokens=4)).prompt_ids) < 20
    assert tok.max_bytes_per_token == 82  # SmolLM2: byte-level BPE, no normalizer: the longest token is 81 bytes


def test_a_template_that_fails_on_a_callers_variable_is_a_value_error():
    """A client's template variable of the wrong type is bad input (INVALID_ARGUMENT), not a crash."""
    from jaxinfer.text.chat_template import ChatTemplateError, render_chat_template

    template = "{% for t in tools %}{{ t.name }}{% endfor %}{{ messages[0]['content'] }}"
    assert render_chat_template(template, [{"role": "user", "content": "hi"}], tools=[{"name": "f"}]) == "fhi"
    with pytest.raises(ChatTemplateError, match="chat template failed") as e:
        render_chat_template(template, [{"role": "user", "content": "hi"}], tools=5)
    assert isinstance(e.value, ValueError)
