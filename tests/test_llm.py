"""The library API and generation loop on a tiny random-weight model (token-id prompts)."""

from __future__ import annotations

import numpy as np
import pytest

import jaxinfer
from conftest import TINY, TINY_ENGINE
from jaxinfer.engine.compile_cache import compile_count

SP = jaxinfer.SamplingParams


def prompts(n, seed=0, lo=1, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def ids(out):
    return out.outputs[0].token_ids


def test_each_request_in_a_mixed_batch_produces_what_it_produces_alone(tiny_llm):
    ps = prompts(6, seed=1, lo=1, hi=40)  # spans several chunks and pages
    sp = SP(max_tokens=12, temperature=0, ignore_eos=True)
    together = tiny_llm.generate(ps, sp)
    for p, out in zip(ps, together):
        alone = tiny_llm.generate([p], sp)[0]
        assert ids(out) == ids(alone)
        assert len(ids(out)) == 12 and out.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    p = prompts(1, seed=2)[0]
    sp = SP(max_tokens=10, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True)
    alone = ids(tiny_llm.generate([p], sp)[0])
    assert alone == ids(tiny_llm.generate([p], sp)[0])
    mixed = tiny_llm.generate(
        prompts(2, seed=3) + [p], [SP(max_tokens=5, temperature=0.5), SP(max_tokens=14, temperature=0), sp]
    )
    assert ids(mixed[2]) == alone
    other_seed = ids(tiny_llm.generate([p], SP(max_tokens=10, temperature=1.0, top_p=0.9, seed=78, ignore_eos=True))[0])
    assert other_seed != alone


def test_stream_yields_every_token_once_and_ends_with_the_output(tiny_llm):
    p = prompts(1, seed=4)[0]
    sp = SP(max_tokens=9, temperature=0, ignore_eos=True)
    deltas = list(tiny_llm.stream(p, sp))
    assert [t for d in deltas for t in d.token_ids] == ids(tiny_llm.generate([p], sp)[0])
    assert all(d.finish_reason is None for d in deltas[:-1])
    final = deltas[-1]
    assert final.finish_reason == "length" and final.output is not None
    m = final.output.metrics
    assert m.ttft_s > 0 and m.e2e_s >= m.ttft_s and len(m.itl_s) == 8 and m.decode_steps == 8


def test_stop_token_ids_end_the_request_and_min_tokens_suppresses_them(tiny_llm):
    p = prompts(1, seed=5)[0]
    free = ids(tiny_llm.generate([p], SP(max_tokens=10, temperature=0, ignore_eos=True))[0])
    stop_tok = free[3]
    first = free.index(stop_tok)
    out = tiny_llm.generate([p], SP(max_tokens=10, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert ids(out) == free[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    out = tiny_llm.generate([p], SP(max_tokens=10, temperature=0, stop_token_ids=[stop_tok], min_tokens=first + 2))[0]
    assert stop_tok not in ids(out)[: first + 2]


def test_pages_and_slots_return_after_every_run_even_when_a_stream_is_abandoned(tiny_llm):
    alloc = tiny_llm.engine.allocator
    total = alloc.num_free
    tiny_llm.generate(prompts(5, seed=6), SP(max_tokens=7, temperature=0))
    assert tiny_llm.wait_idle()
    alloc.check_all_free()
    stream = tiny_llm.stream(prompts(1, seed=7)[0], SP(max_tokens=20, temperature=0, ignore_eos=True))
    next(stream)
    next(stream)
    stream.close()  # the caller walks away mid-stream
    assert tiny_llm.wait_idle()
    alloc.check_all_free()
    assert alloc.num_free == total
    assert sorted(tiny_llm.engine.scheduler.free_slots) == list(range(TINY_ENGINE.max_num_seqs))


def test_more_requests_than_slots_all_complete(tiny_llm):
    ps = prompts(11, seed=8)
    outs = tiny_llm.generate(ps, SP(max_tokens=4, temperature=0, ignore_eos=True))
    assert [len(ids(o)) for o in outs] == [4] * 11
    assert [o.prompt_token_ids for o in outs] == ps


def test_logprobs_and_penalties_through_the_engine(tiny_llm):
    p = prompts(1, seed=9)[0]
    out = tiny_llm.generate([p], SP(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 6 and all(len(lp.top) == 3 for lp in lps)
    for tok, lp in zip(ids(out), lps):
        assert lp.token_id == tok and lp.logprob == pytest.approx(max(lp.top.values()), abs=1e-5)
    plain = ids(tiny_llm.generate([p], SP(max_tokens=16, temperature=0, ignore_eos=True))[0])
    pen = ids(tiny_llm.generate([p], SP(max_tokens=16, temperature=0, frequency_penalty=2.0, ignore_eos=True))[0])
    assert len(set(pen)) >= len(set(plain))
    assert max(np.bincount(pen)) <= max(np.bincount(plain))


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SP(), "the prompt is empty"),
        ([1, 2, TINY.vocab_size], SP(), f"token ids must be integers in [0, {TINY.vocab_size})"),
        ([1] * 400, SP(max_tokens=1), "context length (max_model_len) is"),
        ([1] * 10, SP(max_tokens=300), "you requested 310 tokens (10 in the prompt, 300 for max_tokens)"),
        ([1, 2], SP(top_k=10_000), "top_k must be at most the vocabulary size"),
        ([1, 2], SP(logprobs=50), "greater than max allowed: 5"),
        ("text", SP(), "no tokenizer"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(tiny_llm, prompt, params, message):
    with pytest.raises(ValueError) as e:
        tiny_llm.generate([prompt], params)
    assert message in str(e.value)
    assert tiny_llm.wait_idle()
    tiny_llm.engine.allocator.check_all_free()
    assert len(ids(tiny_llm.generate([[1, 2, 3]], SP(max_tokens=2, temperature=0))[0])) >= 1


def test_compilations_depend_only_on_bucketed_shapes_not_on_values(tiny_llm):
    sp = SP(max_tokens=5, temperature=0, ignore_eos=True)
    lengths = [3, 17, 9, 30]
    rng = np.random.default_rng(10)

    def workload():
        return [rng.integers(0, TINY.vocab_size, n).tolist() for n in rng.permutation(lengths)]

    tiny_llm.generate(workload(), sp)  # compiles the shapes this workload uses
    before = compile_count()
    for _ in range(3):  # new token values, new order, other seeds and temperatures: same programs
        tiny_llm.generate(workload(), SP(max_tokens=5, temperature=0, ignore_eos=True, seed=int(rng.integers(1000))))
    assert compile_count() == before
