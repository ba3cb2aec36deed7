"""End to end on the real bundled model: text in, streamed text out, stops, chat accounting."""

from __future__ import annotations

import pytest

import jaxinfer
from conftest import requires_smollm2

pytestmark = [requires_smollm2, pytest.mark.model]

SP = jaxinfer.SamplingParams


def test_streamed_pieces_are_whole_characters_and_add_up_to_the_text(smollm2_llm):
    sp = SP(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = "请用一句话解释什么是大型语言模型。"
    pieces = list(smollm2_llm.stream(prompt, sp))
    text = "".join(p.text for p in pieces)
    final = pieces[-1].output
    assert text == final.text
    assert text == smollm2_llm.tokenizer.decode(final.outputs[0].token_ids)
    assert all("\ufffd" not in p.text for p in pieces)


def test_stop_string_truncates_and_is_never_half_emitted(smollm2_llm):
    prompt = "The key-value cache in a transformer stores"
    full = smollm2_llm.generate(prompt, SP(max_tokens=48, temperature=0, ignore_eos=True))[0].text
    stop = "each tuple"  # spans several tokens in the greedy continuation
    assert stop in full
    pieces = list(smollm2_llm.stream(prompt, SP(max_tokens=48, temperature=0, ignore_eos=True, stop=[stop])))
    streamed = "".join(p.text for p in pieces)
    out = pieces[-1].output.outputs[0]
    assert streamed == out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = smollm2_llm.generate(prompt, SP(max_tokens=48, temperature=0, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].text == full[: full.index(stop) + len(stop)]


def test_chat_ends_at_end_of_turn_and_counts_template_tokens(smollm2_llm):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    out = smollm2_llm.chat(msgs, SP(max_tokens=64, temperature=0))[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == smollm2_llm.tokenizer.eos_token_id
    assert "Paris" in comp.text and "<|im_end|>" not in comp.text
    m = out.metrics
    user = len(smollm2_llm.tokenizer.encode(msgs[0]["content"], add_special_tokens=False))
    assert m.user_tokens == user and m.template_tokens == len(out.prompt_token_ids) - user > 0
    assert m.ttft_s is not None and m.tpot_s is not None and m.e2e_s >= m.ttft_s


def test_over_long_prompt_is_rejected_with_both_numbers(smollm2_llm):
    text = "word " * (smollm2_llm.max_model_len + 10)
    with pytest.raises(ValueError) as e:
        smollm2_llm.generate(text, SP(max_tokens=4))
    msg = str(e.value)
    assert str(smollm2_llm.max_model_len) in msg and "prompt is" in msg
