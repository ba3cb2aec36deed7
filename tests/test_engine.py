"""The continuous-batching engine: scheduling, chunked prefill, prefix cache, preemption, abort.

Most tests drive the engine step by step (``autostart=False``) so arrivals and
aborts land at exact steps; the threaded tests use the engine as callers do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxinfer
from conftest import TINY, TINY_ENGINE, tiny_params
from jaxinfer.text.detokenizer import NullDetokenizer
from jaxinfer.engine.core import Engine
from jaxinfer.engine.request import Request
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.sampling_params import SamplingParams

SP = SamplingParams
_RUNNERS: dict = {}
# TINY with a 6-position sliding window on every layer (Mistral-style): its engines give back
# the KV pages behind the window, so the workload tests run it too.
TINY_SW = dataclasses.replace(TINY, architecture="mistral", sliding_window=6, name="tiny-sw")
# TINY_ENGINE as `LLM` resolves it: the step-driven runners then have the program-cache fingerprint of every
# `tiny_llm` (this file's too), so they load those programs instead of compiling a set of their own.
ENGINE = TINY_ENGINE.resolved()


def runner(window: int = 0):
    """One runner (params + KV cache) per model shared by the step-driven tests: engines come and go over it."""
    if window not in _RUNNERS:
        cfg = dataclasses.replace(TINY_SW, sliding_window=window) if window else TINY
        _RUNNERS[window] = ModelRunner(cfg, ENGINE, tiny_params())
    return _RUNNERS[window]


def new_engine(num_pages=None, budget=None, prefix=True, policy="fcfs", window=0):
    r = runner(window)
    ecfg = ENGINE if num_pages is None else ENGINE.replace(num_pages=num_pages)
    r.ecfg = ecfg
    return Engine(r, max_num_batched_tokens=budget, enable_prefix_caching=prefix, policy=policy, autostart=False)


def make(prompt, max_tokens, params=None, rid=None, priority=0):
    params = params or SP(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(
        rid or f"r{id(prompt)}-{np.random.randint(1 << 30)}",
        prompt,
        params,
        seed=params.seed if params.seed is not None else 0,
        max_tokens=max_tokens,
        stop_token_ids=frozenset(),
        detokenizer=NullDetokenizer(),
        priority=priority,
    )


def run_until_done(engine, streams, max_steps=10_000):
    for _ in range(max_steps):
        if engine.is_idle():
            break
        engine.step()
    assert engine.is_idle(), "engine did not drain"
    return [s.output for s in streams]


_ALONE: dict = {}


def alone(prompt, max_tokens, params=None, window=0):
    """What a request produces with the engine to itself (large pool, no prefix cache)."""
    key = (tuple(prompt), max_tokens, repr(params), window)
    if key not in _ALONE:
        eng = new_engine(prefix=False, window=window)
        s = eng.submit(make(prompt, max_tokens, params))
        _ALONE[key] = run_until_done(eng, [s])[0].outputs[0].token_ids
    return _ALONE[key]


def rand_prompt(rng, lo=1, hi=40):
    return rng.integers(0, TINY.vocab_size, int(rng.integers(lo, hi))).tolist()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(2, 7),
    num_pages=st.sampled_from([14, 20, 40, 96]),
    budget=st.sampled_from([8, 16, 64]),
    prefix=st.booleans(),
    window=st.sampled_from([0, 6]),
)
def test_random_workload_matches_alone_and_frees_everything(seed, n, num_pages, budget, prefix, window):
    """Random arrivals, lengths, shared prefixes, groups of choices of one prompt (forked from
    each other) and aborts, on a full-attention model and on a sliding-window one whose pages
    behind the window are given back while it runs."""
    rng = np.random.default_rng(seed)
    shared = rand_prompt(rng, 8, 20)  # some requests share a prefix, so the prefix cache is used
    reqs = []
    for i in range(n):
        p = rand_prompt(rng, 1, 30)
        if rng.random() < 0.4:
            p = shared + p[:5]
        choices = int(rng.choice([1, 1, 1, 2, 3]))  # greedy: a group's choices all draw the tokens of one
        reqs.append((int(rng.integers(0, 6)), p, int(rng.integers(1, 12)), rng.random() < 0.2, choices))
    # the pool must at least hold the largest single request
    need = max((len(p) + m) // TINY_ENGINE.page_size + 1 for _, p, m, _, _ in reqs)
    eng = new_engine(num_pages=max(num_pages, need + 1), budget=budget, prefix=prefix, window=window)
    streams, abort_at = {}, {}
    step = 0
    pending = sorted(reqs, key=lambda x: x[0])
    while pending or not eng.is_idle():
        while pending and pending[0][0] <= step:
            at, p, m, ab, choices = pending.pop(0)
            members = [make(p, m) for _ in range(choices)]
            for r, s in zip(members, eng.submit_group(members)):
                streams[r.request_id] = (s, p, m)
            if ab:
                r = members[int(rng.integers(len(members)))]
                abort_at[r.request_id] = step + int(rng.integers(0, 4))
        for rid, when in list(abort_at.items()):
            if when <= step:
                eng.abort(rid)
                del abort_at[rid]
        eng.step()
        step += 1
        assert step < 5000
    for rid, (s, p, m) in streams.items():
        out = s.output.outputs[0]
        if out.finish_reason == "abort":
            assert out.token_ids == alone(p, m, window=window)[: len(out.token_ids)]
        else:
            assert out.token_ids == alone(p, m, window=window), (rid, s.output.metrics.summary())
    eng.allocator.check_all_free()
    assert sorted(eng.scheduler.free_slots) == list(range(TINY_ENGINE.max_num_seqs))


def test_preempted_requests_recompute_to_the_same_tokens():
    rng = np.random.default_rng(1)
    ps = [rand_prompt(rng, 10, 20) for _ in range(4)]
    eng = new_engine(num_pages=20, budget=64)  # 19 pages of 4 tokens for 4 requests of ~35 tokens
    streams = [eng.submit(make(p, 20)) for p in ps]
    outs = run_until_done(eng, streams)
    assert eng.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == alone(p, 20)
    eng.allocator.check_all_free()


def test_seeded_sampled_request_is_the_same_alone_and_in_a_busy_preempting_batch():
    rng = np.random.default_rng(2)
    p = rand_prompt(rng, 5, 15)
    sp = SP(max_tokens=16, temperature=1.0, top_k=20, seed=42, frequency_penalty=0.5, ignore_eos=True)
    solo = alone(p, 16, sp)
    eng = new_engine(num_pages=22, budget=16)
    others = [eng.submit(make(rand_prompt(rng, 10, 30), 18)) for _ in range(3)]
    mine = eng.submit(make(p, 16, sp))
    outs = run_until_done(eng, others + [mine])
    assert outs[-1].outputs[0].token_ids == solo
    assert eng.scheduler.num_preemptions > 0


def test_chunked_prefill_and_prefix_hits_give_the_plain_tokens():
    rng = np.random.default_rng(3)
    system = rand_prompt(rng, 30, 31)
    a, b = system + [1, 2, 3], system + [4, 5]
    eng = new_engine(budget=8)  # prompts of ~33 tokens go in 8-token chunks
    sa = eng.submit(make(a, 6))
    run_until_done(eng, [sa])
    sb = eng.submit(make(b, 6))
    ob = run_until_done(eng, [sb])[0]
    assert sa.output.outputs[0].token_ids == alone(a, 6)
    assert ob.outputs[0].token_ids == alone(b, 6)
    assert ob.metrics.cached_tokens == (len(b) - 1) // TINY_ENGINE.page_size * TINY_ENGINE.page_size
    assert ob.usage["cached_tokens"] == ob.metrics.cached_tokens > 0
    assert len(sa.output.metrics.prefill_chunks) == -(-len(a) // 8)
    assert eng.allocator.hit_rate() > 0


def test_a_request_with_penalties_draws_the_same_tokens_when_its_prefix_is_cached():
    """Penalties read a token history recorded from the tokens a request feeds: a prefix-cache hit
    would leave the cached prompt tokens out (and the slot's last history in), so such a request
    prefills its whole prompt (it used to draw other tokens here)."""
    rng = np.random.default_rng(0)
    sp = SP(max_tokens=12, temperature=0, repetition_penalty=3.0, ignore_eos=True)
    got, want = [], []
    for _ in range(6):
        system = rand_prompt(rng, 24, 25)
        eng = new_engine(prefix=True)
        run_until_done(eng, [eng.submit(make(system + [1, 2], 12, sp))])
        b = system + [3]
        out = run_until_done(eng, [eng.submit(make(b, 12, sp))])[0]
        got.append(out.outputs[0].token_ids)
        want.append(alone(b, 12, sp))
        assert out.metrics.cached_tokens == 0
        eng.allocator.check_all_free()
    assert got == want


def test_running_requests_keep_decoding_while_a_long_prompt_is_prefilled():
    rng = np.random.default_rng(4)
    eng = new_engine(budget=16)
    short = [eng.submit(make(rand_prompt(rng, 3, 5), 30)) for _ in range(2)]
    for _ in range(4):
        eng.step()
    long_req = make(rand_prompt(rng, 120, 121), 2)
    sl = eng.submit(long_req)
    tokens_during = []
    while not long_req.prefill_done:
        before = sum(len(s.output.outputs[0].token_ids) if s.output else 0 for s in short)
        eng.step()
        tokens_during.append(long_req.num_computed)
    # every step of the long prefill also decoded the running requests (one token each)
    assert all(r.num_sampled > 0 for r in eng.scheduler.running if r is not long_req)
    assert len(tokens_during) >= 120 // 16
    run_until_done(eng, short + [sl])
    del before


def test_priority_policy_admits_lower_values_first():
    eng = new_engine(budget=16, policy="priority")
    eng.scheduler.ecfg = TINY_ENGINE.replace(max_num_seqs=1)
    reqs = [make([1, 2, 3], 2, rid=f"p{i}", priority=pr) for i, pr in enumerate([5, 0, 3])]
    streams = [eng.submit(r) for r in reqs]
    order = []
    while not eng.is_idle():
        eng.step()
        for r in eng.scheduler.running:
            if r.request_id not in order:
                order.append(r.request_id)
    assert order == ["p1", "p2", "p0"]
    eng.scheduler.ecfg = TINY_ENGINE
    del streams


def test_abort_from_another_thread_frees_pages_within_a_step(tiny_llm):
    llm = tiny_llm
    p = list(range(1, 20))
    req = llm.make_request(p, SP(max_tokens=100, temperature=0, ignore_eos=True))
    stream = llm.submit(req)
    it = iter(stream)
    next(it)
    t = threading.Thread(target=llm.engine.abort, args=(req.request_id,))
    t.start()
    t.join()
    rest = list(it)
    assert rest[-1].finish_reason == "abort" and rest[-1].output.outputs[0].finish_reason == "abort"
    assert llm.wait_idle()
    llm.engine.allocator.check_all_free()


def test_async_streams_from_many_tasks(tiny_llm):
    async def one(i):
        req = tiny_llm.make_request([i + 1, 7, 9], SP(max_tokens=5, temperature=0, ignore_eos=True))
        toks = []
        async for d in tiny_llm.submit(req):
            toks += d.token_ids
        return toks

    async def main():
        return await asyncio.gather(*(one(i) for i in range(6)))

    got = asyncio.run(main())
    for i, toks in enumerate(got):
        assert toks == tiny_llm.generate([[i + 1, 7, 9]], SP(max_tokens=5, temperature=0, ignore_eos=True))[0].outputs[0].token_ids


def random_bias(rng):
    """No logit_bias (most requests), a few entries, or the full 300 (string keys, as JSON sends them)."""
    size = [0, 0, 0, 1, 5, 300][int(rng.integers(6))]
    ids = rng.choice(TINY.vocab_size, size, replace=False)
    return {str(t): float(rng.uniform(-100, 100)) for t in ids} if size else None


def random_params(rng, i: int) -> SamplingParams:
    """Any mix of the sampler's features: greedy or not, filters, penalties, logprobs, seeds, min_tokens,
    logit_bias."""
    pick = lambda *xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    return SP(
        logit_bias=random_bias(rng),
        max_tokens=int(rng.integers(2, 24)),
        temperature=pick(0.0, 0.0, 0.7, 1.3),
        top_p=pick(1.0, 0.9, 0.5),
        top_k=pick(0, 0, 5, 50),
        min_p=pick(0.0, 0.0, 0.1),
        presence_penalty=pick(0.0, 0.0, 0.5),
        frequency_penalty=pick(0.0, -0.5, 0.3),
        repetition_penalty=pick(1.0, 1.0, 1.3),
        logprobs=pick(None, None, 0, 1, 3, TINY_ENGINE.max_logprobs),
        min_tokens=pick(0, 0, 2),
        seed=pick(None, i),
        ignore_eos=True,
    )


def test_nothing_compiles_after_warmup_under_a_random_mixed_workload(tmp_path):
    """After warm-up, any mix of sampling settings (logit_bias, n and structured output included), logprobs counts,
    prompt lengths, batch sizes and aborts runs programs from the list: the guard counts every lowering in the process, so a
    stray eager op outside the steps would fail it too."""
    from jaxinfer.engine.compile_cache import compile_count

    from test_structured_output import CONSTRAINTS, sp_tokenizer

    tok = sp_tokenizer(tmp_path)  # a tokenizer, for the constrained requests' grammars
    llm = jaxinfer.LLM.from_params(TINY, tiny_params(), tokenizer=tok, engine_config=TINY_ENGINE)
    keys = llm.engine.program_keys()
    assert llm.engine.warmup() == len(keys)
    assert llm.runner.programs.num_ready == len(keys)
    before = compile_count()
    rng = np.random.default_rng(5)
    reqs, streams = [], []
    constraints = list(CONSTRAINTS.values())
    for i in range(24):
        prompt, sp = rand_prompt(rng, 1, 90), random_params(rng, i)
        if i % 8 == 5:  # some ask for 3 choices (without penalties, so the choices fork)
            sp = sp.clone(n=3, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
        if i % 3 == 1:  # some are constrained (structured output: a bitmask in the same programs)
            sp = sp.clone(structured_outputs=constraints[int(rng.integers(len(constraints)))], min_tokens=0)
        group = llm.make_requests(prompt, sp)
        reqs += group
        streams += llm.submit_group(group)
    assert any(r.params.logit_bias for r in reqs) and not all(r.params.logit_bias for r in reqs)
    assert any(r.constraint is not None for r in reqs) and not all(r.constraint is not None for r in reqs)
    for s in streams[::5]:  # abort some mid-stream
        next(iter(s))
        s.abort()
    outs = [s.result() for s in streams]
    assert llm.wait_idle()
    assert compile_count() == before, "something compiled after warm-up"
    assert llm.runner.programs.compiled_late == []
    assert llm.engine.scheduler.num_forks > 0
    llm.engine.allocator.check_all_free()
    assert llm.engine.stats.grammar_syncs > 0
    for r, o in zip(reqs, outs):
        comp = o.outputs[0]
        if comp.finish_reason == "stop" and r.constraint is not None:
            assert r.constraint.complete, comp.text  # a constrained output that stops is whole
        if comp.finish_reason == "length":
            assert len(comp.token_ids) == r.max_tokens
        if r.params.logprobs is not None and comp.logprobs:
            assert all(len(lp.top) == r.params.logprobs for lp in comp.logprobs)
            assert comp.logprobs[0].token_id == comp.token_ids[0]
        if r.params.logprobs is None:
            assert comp.logprobs is None
    llm.close()


@pytest.mark.parametrize("max_model_len", [None, 100])
def test_cpu_preset_program_list_is_short_and_covers_every_step_shape(max_model_len):
    """The cpu preset's whole program list stays small (at most 32 ragged step programs), and every
    padded shape a step can take is in it: any mix of decode rows and prompt chunks, from one token of
    one request up to the token budget over max_num_seqs requests, at any context up to max_model_len
    (the page table goes at full width, so the context is no key)."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.buckets import bucket_for, token_budget

    ecfg = EngineConfig.preset("cpu").replace(num_pages=64, dtype="float32", max_model_len=max_model_len)
    eng = Engine(ModelRunner(TINY, ecfg, tiny_params()), autostart=False)
    keys = set(eng.program_keys())
    table = eng.runner.programs
    limit = eng.runner.max_model_len
    assert limit == min(TINY.max_position_embeddings, max_model_len or 10**9, 63 * ecfg.page_size)
    assert len(keys) <= 32, len(keys)
    assert {k.kind for k in keys} == {"step"}
    assert {k.pages for k in keys} == {bucket_for(-(-limit // ecfg.page_size), ecfg.page_buckets)}
    budget = token_budget(ecfg)
    assert eng.scheduler.budget == budget == ecfg.max_num_batched_tokens
    rng = np.random.default_rng(0)
    for tokens in list(range(1, 70)) + sorted(rng.integers(70, budget + 1, 60).tolist()) + [budget]:
        for requests in {1, min(tokens, ecfg.max_num_seqs), int(rng.integers(1, min(tokens, ecfg.max_num_seqs) + 1))}:
            for ctx in (1, limit):
                key = table.step_key(tokens, requests, -(-ctx // ecfg.page_size))
                assert key in keys and key.tokens >= tokens and key.batch >= requests
    with pytest.raises(ValueError, match="step tokens"):
        table.step_key(budget + 1, 1, 1)


def test_stats_line_reads_like_vllm(tiny_llm):
    tiny_llm.generate([[1, 2, 3]] * 3, SP(max_tokens=4, temperature=0))
    line = tiny_llm.engine.stats.line()
    for part in ("Avg prompt throughput:", "Avg generation throughput:", "Running:", "Waiting:",
                 "KV cache usage:", "Prefix cache hit rate:"):
        assert part in line
    snap = tiny_llm.engine.stats.snapshot()
    assert snap["generation_tokens"] >= 12 and snap["finished"].get("length", 0) >= 3


def test_a_closed_event_loop_on_one_stream_does_not_fail_the_others(tiny_llm):
    """A consumer whose asyncio loop is gone is aborted; other requests are untouched."""
    p = [3, 4, 5]
    sp = SP(max_tokens=30, temperature=0, ignore_eos=True)
    other = tiny_llm.submit(tiny_llm.make_request(p, sp))
    orphan = tiny_llm.submit(tiny_llm.make_request(p, sp))

    async def read_one():
        async for _ in orphan:
            return

    loop = asyncio.new_event_loop()
    loop.run_until_complete(read_one())  # leaves the async iterator suspended, attached to this loop
    loop.close()
    out = other.result()
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 30
    assert tiny_llm.wait_idle()
    tiny_llm.engine.allocator.check_all_free()


def test_a_request_id_is_refused_while_live_and_free_again_as_soon_as_it_is_aborted(tiny_llm):
    """Ids are unique among unfinished requests; aborting frees the id at once, and the new
    request with that id is never mistaken for the old one (outputs, aborts, pages)."""
    long = SP(max_tokens=60, temperature=0, ignore_eos=True)
    short = SP(max_tokens=3, temperature=0, ignore_eos=True)
    for i in range(20):
        old = tiny_llm.submit(tiny_llm.make_request([1, 2, 3 + i], long, request_id="same"))
        with pytest.raises(ValueError, match="request_id 'same' is already in use"):
            tiny_llm.submit(tiny_llm.make_request([1, 2, 3], long, request_id="same"))
        if i % 2:
            next(iter(old))  # sometimes after the first token, sometimes before the engine saw it
        old.abort()
        new = tiny_llm.submit(tiny_llm.make_request([4, 5, i], short, request_id="same"))
        old.abort()  # a second abort of the old stream must not reach the new request
        out = new.result()
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
        assert old.result().outputs[0].finish_reason == "abort"
    assert tiny_llm.wait_idle()
    tiny_llm.engine.allocator.check_all_free()


def test_a_hand_built_request_longer_than_the_context_is_refused_at_submit(tiny_llm):
    """Requests made without the processor are checked too: one too long would fail a whole step."""
    limit = tiny_llm.max_model_len
    req = Request("too-long", [1] * 10, SamplingParams(), seed=0, max_tokens=limit, stop_token_ids=frozenset(),
                  detokenizer=NullDetokenizer())
    with pytest.raises(ValueError, match=rf"needs {limit + 10} tokens \(10 prompt \+ {limit} max_tokens\), more than "
                                         rf"max_model_len \({limit}\)"):
        tiny_llm.submit(req)
    ok = tiny_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(ok.outputs[0].token_ids) >= 1


def test_a_step_budget_below_the_padded_prefill_area_still_prefills_long_prompts():
    """Batch bucket 4 x chunk bucket 8 was a 32-token prefill shape that a 16-token step budget could
    never admit (the engine once spun forever on it, then refused the config). A ragged step pads only
    its token count, so a 30-token prompt goes in budget-sized chunks and draws what it draws alone
    on a roomy engine."""
    prompt = list(range(3, 33))
    r = runner()
    r.ecfg = ENGINE.replace(batch_buckets=(4,), chunk_buckets=(8,))
    try:
        eng = Engine(r, max_num_batched_tokens=16, autostart=False)
        assert eng.scheduler.budget == 8  # the largest token bucket bounds a step
        s = eng.submit(make(prompt, 5))
        got = run_until_done(eng, [s])[0].outputs[0].token_ids
    finally:
        r.ecfg = ENGINE
    assert got == alone(prompt, 5)


def test_pages_behind_a_sliding_window_are_given_back_without_changing_a_token():
    """Every layer attends 6 positions back, pages hold 4: a request of 60 tokens keeps about 3
    pages, not 15, and draws the same tokens as with every page kept (release off)."""
    rng = np.random.default_rng(7)
    prompts = [rand_prompt(rng, 20, 30) for _ in range(3)]
    outs, peaks = {}, {}
    for release in (True, False):
        eng = new_engine(budget=16, window=6)
        if not release:
            eng.scheduler.kv_window = 0
        streams = [eng.submit(make(p, 30)) for p in prompts]
        peak = 0
        while not eng.is_idle():
            eng.step()
            peak = max(peak, eng.allocator.num_used)
            for r in eng.scheduler.running:
                held = [p for p in r.pages if p]
                if release and r.num_computed > 12:
                    assert len(held) <= -(-6 // 4) + 2 + 16 // 4, (len(held), r.num_computed)
        outs[release] = [s.output.outputs[0].token_ids for s in streams]
        peaks[release] = peak
        eng.allocator.check_all_free()
    assert outs[True] == outs[False]
    assert peaks[True] < peaks[False] / 2, peaks


def test_window_model_recomputes_after_preemption_with_pages_given_back():
    rng = np.random.default_rng(8)
    ps = [rand_prompt(rng, 10, 20) for _ in range(4)]
    eng = new_engine(num_pages=10, budget=16, window=6)
    outs = run_until_done(eng, [eng.submit(make(p, 24)) for p in ps])
    assert eng.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == alone(p, 24, window=6)
    eng.allocator.check_all_free()


def test_runners_of_the_same_model_share_their_programs_in_a_process():
    """A second runner of the same model and engine config takes the first one's executables
    (no second compile, no deserializing its own copy from the program cache)."""
    a = ModelRunner(TINY, TINY_ENGINE, tiny_params())
    b = ModelRunner(TINY, TINY_ENGINE, tiny_params(seed=1))  # other values, same shapes
    key = a.programs.keys()[0]
    prog = a.programs.get(key)
    loaded = b.programs.loaded_from_disk
    assert b.programs.get(key) is prog and b.programs.loaded_from_disk == loaded
    other = ModelRunner(TINY_SW, TINY_ENGINE, tiny_params())  # another model: its own program
    assert other.programs.get(key) is not prog


def test_the_scheduler_is_host_code_that_imports_without_jax():
    """Scheduling is pure host bookkeeping: its module (and what it imports: requests, pages, the prefix
    cache, the config) loads in a process where importing JAX fails."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('jax', 'jaxlib'):\n"
        "            raise ImportError('JAX is blocked here: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import jaxinfer.engine.scheduler\n"
        "assert not any(m.split('.')[0] in ('jax', 'jaxlib') for m in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
