"""Several choices per request (`SamplingParams.n`): the prompt is prefilled once and the other
choices fork from it, sharing its KV pages; each choice is what a single request with its seed draws.

The engine tests drive the engine step by step (``autostart=False``) over the runners of
test_engine (one per model, shared), so forks, aborts and preemptions land at exact steps.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxinfer
from conftest import TINY, TINY_ENGINE, tiny_params
from jaxinfer.sampling_params import MAX_SEED
from test_engine import SP, alone, make, new_engine, rand_prompt, run_until_done

PS = TINY_ENGINE.page_size


def group(prompt, max_tokens, sp, n, prefix="g"):
    """n requests of one prompt, choice i seeded seed + i (what LLM.make_requests makes)."""
    return [make(prompt, max_tokens, sp.clone(seed=sp.seed + i), rid=f"{prefix}-{i}") for i in range(n)]


def shared_pages(prompt_len):
    """Full pages of the prompt a fork takes: all but at least its last token."""
    return (prompt_len - 1) // PS


@pytest.mark.parametrize("prefix, window", [(True, 0), (False, 0), (False, 6)])
def test_n_choices_compute_the_prompt_once_share_its_pages_and_equal_single_seeded_requests(prefix, window):
    """n = 4, a prompt of 5 full pages and 2 tokens: the engine computes 22 + 3 x 2 prompt tokens,
    the choices hold the same pages (refcount 4) while they run, and choice i draws exactly what a
    single request with seed s + i draws alone, with or without the prefix cache, and on a model
    with a sliding window (which shares only the pages inside the window)."""
    rng = np.random.default_rng(11)
    p = rand_prompt(rng, 22, 23)
    k = shared_pages(len(p))
    sp = SP(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    eng = new_engine(prefix=prefix, window=window)
    reqs = group(p, 8, sp, 4)
    streams = eng.submit_group(reqs)
    seen_shared = False
    while not eng.is_idle():
        eng.step()
        if not window and all(r.slot is not None for r in reqs):
            pages = reqs[0].pages[:k]
            assert all(r.pages[:k] == pages for r in reqs)
            assert all(eng.allocator.refcount[q] == 4 for q in pages)
            assert len({r.pages[k] for r in reqs}) == 4  # each computes its own tail page
            seen_shared = True
    assert seen_shared or window
    assert eng.stats.prompt_tokens == len(p) + 3 * (len(p) - k * PS)
    assert eng.scheduler.num_forks == 3
    outs = [s.output for s in streams]
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == alone(p, 8, sp.clone(seed=1234 + i), window=window), i
        assert o.outputs[0].index == 0 and o.request_id == f"g-{i}"
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1  # the seeds make them differ
    assert [o.metrics.cached_tokens for o in outs] == [0] + [k * PS] * 3
    eng.allocator.check_all_free()
    assert sorted(eng.scheduler.free_slots) == list(range(TINY_ENGINE.max_num_seqs))


def test_aborting_one_choice_leaves_the_others_untouched():
    rng = np.random.default_rng(12)
    p = rand_prompt(rng, 17, 18)
    sp = SP(max_tokens=12, temperature=0.8, seed=40, ignore_eos=True)
    eng = new_engine(prefix=False)
    reqs = group(p, 12, sp, 3)
    streams = eng.submit_group(reqs)
    while reqs[1].num_sampled < 3:
        eng.step()
    streams[1].abort()
    outs = run_until_done(eng, streams)
    assert outs[1].outputs[0].finish_reason == "abort"
    got = outs[1].outputs[0].token_ids
    assert got == alone(p, 12, sp.clone(seed=41))[: len(got)]
    for i in (0, 2):
        assert outs[i].outputs[0].finish_reason == "length"
        assert outs[i].outputs[0].token_ids == alone(p, 12, sp.clone(seed=40 + i))
    eng.allocator.check_all_free()


def test_choices_fork_from_whichever_member_runs_when_the_first_is_aborted_before_the_fork():
    """The first choice is aborted mid-prefill: the next prefills the prompt itself and the other
    two fork from it; every surviving choice still draws its single-request tokens."""
    rng = np.random.default_rng(13)
    p = rand_prompt(rng, 22, 23)
    k = shared_pages(len(p))
    sp = SP(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    eng = new_engine(prefix=False, budget=8)  # the prompt goes in chunks of 8
    reqs = group(p, 6, sp, 4)
    streams = eng.submit_group(reqs)
    eng.step()
    assert reqs[0].num_computed == 8 and all(r.slot is None for r in reqs[1:])  # the others wait
    eng.abort("g-0")
    outs = run_until_done(eng, streams)
    assert outs[0].outputs[0].finish_reason == "abort"
    for i in (1, 2, 3):
        assert outs[i].outputs[0].token_ids == alone(p, 6, sp.clone(seed=7 + i))
    assert eng.scheduler.num_forks == 2
    assert eng.stats.prompt_tokens == 8 + len(p) + 2 * (len(p) - k * PS)
    assert [o.metrics.cached_tokens for o in outs[1:]] == [0, k * PS, k * PS]
    eng.allocator.check_all_free()


@pytest.mark.parametrize("prefix", [True, False])
def test_preempted_choices_recompute_to_their_single_request_tokens(prefix):
    """15 usable pages for 4 choices of 22 + 20 tokens (5 shared pages, then ~6 pages each): the
    newest choices are preempted and recomputed (forking again from a running one), and every
    choice still draws its single-request tokens; no page leaks."""
    rng = np.random.default_rng(14)
    p = rand_prompt(rng, 22, 23)
    sp = SP(max_tokens=20, temperature=0.9, top_k=40, seed=99, ignore_eos=True)
    eng = new_engine(num_pages=16, budget=16, prefix=prefix)
    reqs = group(p, 20, sp, 4)
    outs = run_until_done(eng, eng.submit_group(reqs))
    assert eng.scheduler.num_preemptions > 0
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == alone(p, 20, sp.clone(seed=99 + i)), i
    eng.allocator.check_all_free()
    assert sorted(eng.scheduler.free_slots) == list(range(TINY_ENGINE.max_num_seqs))


def test_more_choices_than_batch_slots_all_complete_and_the_late_ones_fork_too():
    """n = 7 with 4 slots: the last three start as slots free up, forking from a choice still
    running (or, once none is, prefilling the prompt again); each draws its single-request tokens."""
    rng = np.random.default_rng(18)
    p = rand_prompt(rng, 14, 15)
    sp = SP(max_tokens=5, temperature=1.0, seed=60, ignore_eos=True)
    eng = new_engine(prefix=False)
    reqs = group(p, 5, sp, 7)
    reqs[0].max_tokens = 12  # the first runs longest: the late choices find it running
    outs = run_until_done(eng, eng.submit_group(reqs))
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == alone(p, reqs[i].max_tokens, sp.clone(seed=60 + i)), i
    assert eng.scheduler.num_forks == 6 and eng.stats.prompt_tokens == len(p) + 6 * (len(p) - 12)
    eng.allocator.check_all_free()


def test_choices_with_penalties_prefill_the_whole_prompt_each():
    """Penalties read a token history recorded from the tokens a request feeds, so such choices
    neither fork nor take prefix-cache hits: each computes the whole prompt, and draws what it
    draws alone."""
    rng = np.random.default_rng(15)
    p = rand_prompt(rng, 18, 19)
    sp = SP(max_tokens=10, temperature=0.7, seed=3, repetition_penalty=1.5, presence_penalty=0.5, ignore_eos=True)
    eng = new_engine(prefix=True)
    outs = run_until_done(eng, eng.submit_group(group(p, 10, sp, 3)))
    assert eng.scheduler.num_forks == 0 and eng.stats.prompt_tokens == 3 * len(p)
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == alone(p, 10, sp.clone(seed=3 + i))
        assert o.metrics.cached_tokens == 0
    eng.allocator.check_all_free()


def test_a_group_must_share_one_prompt_and_distinct_ids():
    eng = new_engine()
    sp = SP(max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="the requests of a group must have the same prompt: 'b' differs from 'a'"):
        eng.submit_group([make([1, 2, 3], 2, sp, rid="a"), make([1, 2, 4], 2, sp, rid="b")])
    with pytest.raises(ValueError, match="distinct request ids"):
        eng.submit_group([make([1, 2, 3], 2, sp, rid="a"), make([1, 2, 3], 2, sp, rid="a")])
    with pytest.raises(ValueError, match="at least one request"):
        eng.submit_group([])
    assert eng.is_idle()


# -- the library ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    m = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE)
    yield m
    m.close()


def test_generate_with_n_returns_one_output_per_prompt_with_n_indexed_choices(llm):
    ps = [rand_prompt(np.random.default_rng(16), 14, 15), [5, 6, 7]]
    sp = SP(max_tokens=6, temperature=1.0, seed=500, n=3, ignore_eos=True)
    outs = llm.generate(ps, sp)
    assert len(outs) == 2
    for p, out in zip(ps, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.prompt_token_ids == p and out.finished
        singles = llm.generate([p] * 3, [sp.clone(n=1, seed=500 + i) for i in range(3)])
        assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
        u = out.usage
        assert u["prompt_tokens"] == len(p) and u["completion_tokens"] == 18 and u["total_tokens"] == len(p) + 18
    assert llm.wait_idle()
    llm.engine.allocator.check_all_free()


def test_n_one_is_one_request_with_the_given_id(llm):
    p = [9, 8, 7, 6, 5]
    sp = SP(max_tokens=4, temperature=0, ignore_eos=True)
    [r] = llm.make_requests(p, sp, request_id="solo")
    assert r.request_id == r.group_id == "solo" and r.choice_index == 0
    out = llm.generate([p], sp)[0]
    assert len(out.outputs) == 1 and out.outputs[0].index == 0
    assert out.outputs[0].token_ids == llm.generate([p], SP(max_tokens=4, temperature=0, ignore_eos=True, n=2))[0] \
        .outputs[1].token_ids  # greedy choices are all the same


def test_make_requests_names_and_seeds_each_choice(llm):
    reqs = llm.make_requests([1, 2, 3], SP(max_tokens=3, seed=MAX_SEED - 1, n=4), request_id="abc", priority=2)
    assert [r.request_id for r in reqs] == ["abc-0", "abc-1", "abc-2", "abc-3"]
    assert [r.group_id for r in reqs] == ["abc"] * 4 and [r.choice_index for r in reqs] == [0, 1, 2, 3]
    assert [r.seed for r in reqs] == [MAX_SEED - 1, MAX_SEED, 0, 1]  # wraps at 2**32
    assert [r.params.seed for r in reqs] == [r.seed for r in reqs] and {r.priority for r in reqs} == {2}
    assert all(r.prompt_ids == [1, 2, 3] for r in reqs) and len({id(r.detokenizer) for r in reqs}) == 4
    unseeded = llm.make_requests([1, 2, 3], SP(max_tokens=3, n=8))
    assert len({r.seed for r in unseeded}) == 8  # independent random seeds
    assert len({r.group_id for r in unseeded}) == 1 and unseeded[0].request_id.endswith("-0")
    with pytest.raises(ValueError, match="use LLM.make_requests and LLM.submit_group"):
        llm.make_request([1, 2, 3], SP(n=2))
    with pytest.raises(ValueError, match="use LLM.make_requests and LLM.submit_group"):
        next(llm.stream([1, 2, 3], SP(n=2)))


def test_submit_group_streams_each_choice_and_aborting_one_stream_frees_only_it(llm):
    p = rand_prompt(np.random.default_rng(17), 13, 14)
    sp = SP(max_tokens=30, temperature=0.8, seed=21, n=3, ignore_eos=True)
    streams = llm.submit_group(llm.make_requests(p, sp, request_id="grp"))
    it = iter(streams[2])
    next(it)
    streams[2].abort()
    outs = [s.result() for s in streams]
    assert [o.request_id for o in outs] == ["grp-0", "grp-1", "grp-2"]
    assert [o.outputs[0].index for o in outs] == [0, 1, 2]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length", "abort"]
    assert outs[1].metrics.cached_tokens == shared_pages(len(p)) * PS  # forked, not computed
    assert llm.wait_idle()
    llm.engine.allocator.check_all_free()


def test_chat_with_n_returns_n_choices(tmp_path):
    from test_tokenizer import train_tiny_sentencepiece

    from jaxinfer.text.tokenizer import Tokenizer

    (tmp_path / "tokenizer.model").write_bytes(train_tiny_sentencepiece())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat_llm = jaxinfer.LLM.from_params(TINY, tiny_params(), tokenizer=Tokenizer.from_dir(tmp_path),
                                        engine_config=TINY_ENGINE)
    try:
        msgs = [{"role": "user", "content": "Say something about pages."}]
        sp = SP(max_tokens=5, temperature=1.0, seed=8, n=2, ignore_eos=True)
        [out] = chat_llm.chat(msgs, sp)
        assert [c.index for c in out.outputs] == [0, 1]
        for i, c in enumerate(out.outputs):
            assert c.token_ids == chat_llm.chat(msgs, sp.clone(n=1, seed=8 + i))[0].outputs[0].token_ids
        assert out.usage["completion_tokens"] == 10
    finally:
        chat_llm.close()
