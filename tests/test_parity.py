"""Parity with Hugging Face transformers on SmolLM2-135M-Instruct (same dequantized weights).

The reference numbers were recorded by scripts/make_reference_fixtures.py
(transformers + torch, float32, eager attention); this suite needs no torch.
The float32 engine must match them to 1e-3 of the logit scale and token for
token. The bfloat16, int8 and int4 weights are checked against the same
numbers in tests/test_parity_low_precision.py (a file of its own, so the two
halves run on different test workers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from conftest import requires_smollm2
from jaxinfer.ops import kv_cache
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.config import EngineConfig
from jaxinfer.models import llama

pytestmark = [requires_smollm2, pytest.mark.model]

GREEDY = jaxinfer.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, skip_special_tokens=True)
_fwd = jax.jit(llama.forward, static_argnums=1)


def _case_ids(reference):
    return [c["name"] for c in reference[0]["generation"]]


PAGE = 16
BUCKET = 64  # a chunk is padded to a multiple of this: every short prompt shares one program, the long one has its own
CACHE_PAGES = 80  # page 0 takes the padding's writes; pages 1..76 hold the longest prompt's bucket (1,216 slots)


def _bucket(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


def fresh_cache(llm, **engine):
    """An empty KV cache of one size for every case (a new size would compile the forward again)."""
    return kv_cache.init_cache(llm.model_config, EngineConfig(page_size=PAGE, num_pages=CACHE_PAGES, **engine))


def prompt_pages(ids) -> list:
    return list(range(1, len(ids) // PAGE + 2))


def last_logits(llm, ids, cache, pages, start):
    """Run tokens `ids` at positions start.. over `pages`; returns (the last token's logits [V], cache).

    A chunk of several tokens is padded to a bucket of 64 (padding tokens have position -1: the
    attention skips them and they write only the dummy page 0) and the page table to the pages
    the bucket spans, so prompts of different lengths run one compiled program; causal attention
    makes the real tokens' rows independent of what comes after them. Only the last row goes
    through the LM head.
    """
    n = len(ids)
    t = _bucket(n) if n > 1 else 1
    pos = np.full((1, t), -1, np.int32)
    pos[0, :n] = np.arange(start, start + n)
    table = np.zeros((1, max(_bucket(start + n) // PAGE, len(pages))), np.int32)
    table[0, : len(pages)] = pages
    slots = np.zeros((1, t), np.int32)
    slots[:, :n] = kv_cache.slots_for(table, pos[:, :n], PAGE)
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :n] = ids
    attn = AttentionMetadata(pos, slots, table, np.array([start + n], np.int32))
    h, cache = _fwd(llm.runner.params, llm.model_config, jnp.asarray(tokens), cache, attn)
    return np.asarray(llama.logits(llm.runner.params, llm.model_config, h[0, n - 1 : n]))[0], cache


def test_prompt_tokens_match_the_reference_tokenizer(smollm2_llm, reference):
    for case in reference[0]["generation"]:
        if case["kind"] == "text":
            got = smollm2_llm.tokenizer.encode(case["prompt"])
        else:
            text = smollm2_llm.tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True)
            got = smollm2_llm.tokenizer.encode(text, add_special_tokens=False)
        assert got == case["prompt_ids"], case["name"]


def test_last_position_logits_agree_in_float32(smollm2_llm, reference):
    ref, logits = reference
    for case in ref["generation"]:
        ids = case["prompt_ids"]
        got, _ = last_logits(smollm2_llm, ids, fresh_cache(smollm2_llm), prompt_pages(ids), 0)
        want = logits[case["logits_file_key"]]
        err = np.abs(got - want).max()
        assert err < 1e-3 * max(1.0, case["max_abs_logit"]), (case["name"], err)
        assert int(got.argmax()) == int(want.argmax())


def test_decode_step_logits_agree_at_each_step(smollm2_llm, reference):
    ref, logits = reference
    sw = ref["stepwise"]
    want = logits[sw["logits_file_key"]]
    case = next(c for c in ref["generation"] if c["name"] == sw["case"])
    pages = [5, 2, 7]  # scattered pages, as the allocator would hand out
    got, cache = last_logits(smollm2_llm, case["prompt_ids"], fresh_cache(smollm2_llm), pages, 0)
    rows = [got]
    pos = len(case["prompt_ids"])
    for tok in case["greedy_ids"][: sw["num_steps"] - 1]:
        got, cache = last_logits(smollm2_llm, [tok], cache, pages, pos)
        rows.append(got)
        pos += 1
    err = np.abs(np.stack(rows) - want).max(axis=-1)
    assert np.all(err < 1e-3 * np.asarray(sw["max_abs_logit_per_step"])), err


@pytest.fixture(scope="module")
def greedy_outputs(smollm2_llm, reference):
    """Every case's greedy continuation, the text prompts in one batch and the chats in another: 96
    decode steps instead of 288. On the CPU kernels a row's numbers do not depend on the batch
    (tests/test_batch_invariance.py), so each is what it would be alone, as transformers ran it."""
    cases = reference[0]["generation"]
    texts = [c for c in cases if c["kind"] == "text"]
    chats = [c for c in cases if c["kind"] != "text"]
    outs = smollm2_llm.generate([c["prompt"] for c in texts], GREEDY)
    outs += smollm2_llm.chat([c["messages"] for c in chats], GREEDY)
    return {c["name"]: o for c, o in zip(texts + chats, outs)}


@pytest.mark.parametrize("name", ["english", "chinese", "emoji", "chat", "chat_system", "long"])
def test_greedy_continuation_is_identical_to_transformers(greedy_outputs, reference, name):
    case = next(c for c in reference[0]["generation"] if c["name"] == name)
    out = greedy_outputs[name]
    assert out.prompt_token_ids == case["prompt_ids"]
    assert out.outputs[0].token_ids == case["greedy_ids"]
    assert out.outputs[0].text == case["greedy_text"]
