"""Speculative decoding (`jaxinfer.engine.speculative`, `jaxinfer.ops.sampler.Drafts`): drafts verified in the
ragged step, lossless for greedy and sampled requests.

The rule is checked as a pure function first (`sample` on synthetic distributions: acceptance with the
target's probability, the residual draw, the marginal); then through the engine on tiny random models,
where a proposer that knows the plain output (`Oracle`, with every few drafts spoiled) makes the drafts
partly right, so both acceptance and rejection are exercised on every request; then on the real SmolLM2
with prompt lookup, on prompts it copies from.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxinfer
from conftest import TINY, TINY_ENGINE, Oracle, requires_smollm2, tiny_params
from jaxinfer import SamplingParams, StructuredOutputsParams
from jaxinfer.config import EngineConfig, SpeculativeConfig
from jaxinfer.engine.roofline import CostModel, MachinePeaks, compute_bound_batch
from jaxinfer.engine.speculative import NgramProposer, max_drafts
from jaxinfer.ops.sampler import Drafts, init_sampler_state, sample
from jaxinfer.engine.sampling import RowSampling, build_metadata

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# -- the rule as a pure function ---------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.0, 0, 0.7)])
def test_rejection_rule_keeps_the_target_distribution(temperature, top_k, top_p):
    """Segments of two rows (draft d at row 0, the bonus at row 1), one seed each: a draft is accepted
    with probability p(d); after a rejection the token follows p without d, renormalised; so the first
    token's marginal is p itself; and each emitted row's token is the one plain sampling draws there."""
    v, m = 8, 6000
    base = jnp.asarray(np.log(np.array([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02])), jnp.float32)
    d = 1
    scaled = np.asarray(base, np.float64) / temperature
    if top_k:
        scaled = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    if top_p < 1.0:  # keep a token while the tokens likelier than it hold less than top_p
        likelier = np.array([p[p > x].sum() for x in p])
        p = np.where(likelier < top_p, p, 0.0)
        p /= p.sum()
    b = 2 * m
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    rows = [RowSampling(params, seed, 10 + j, 0, prior=(d,) if j else ()) for seed in range(m) for j in range(2)]
    md = build_metadata(rows, b, num_slots=1, max_logprobs=0, prior_width=1)
    drafts = Drafts(jnp.asarray(np.tile([d, -1], m), jnp.int32), jnp.asarray(np.repeat(np.arange(m), 2), jnp.int32), m)
    logits = jnp.broadcast_to(base, (b, v))
    out, _ = jax.jit(sample)(logits, md, init_sampler_state(1, v), drafts)
    tokens, emitted = np.asarray(out.tokens).reshape(m, 2), np.asarray(out.emitted).reshape(m, 2)
    accepted = emitted[:, 1]
    # every emitted row drew what plain decoding draws at its position (the same rows, no drafts)
    plain, _ = jax.jit(sample)(logits, md, init_sampler_state(1, v))
    assert (tokens == np.asarray(plain.tokens).reshape(m, 2))[emitted].all()
    assert (tokens[accepted, 0] == d).all() and (tokens[~accepted, 0] != d).all()
    # acceptance ~ Binomial(m, p(d)): within 4.5 standard deviations
    assert abs(accepted.sum() - m * p[d]) < 4.5 * np.sqrt(m * p[d] * (1 - p[d]))
    residual = np.delete(p, d) / (1 - p[d])
    got = np.bincount(np.delete(np.arange(v), d).searchsorted(tokens[~accepted, 0]), minlength=v - 1)
    keep = residual > 0
    assert chi2(got[keep], residual[keep]) > 1e-4
    first = np.bincount(tokens[:, 0], minlength=v)
    assert chi2(first[p > 0], p[p > 0]) > 1e-4
    assert (first[p == 0] == 0).all()


def chi2(counts, probs) -> float:
    """The p-value of ``counts`` drawn from ``probs`` (renormalised in float64)."""
    probs = np.asarray(probs, np.float64)
    return stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue


def test_greedy_rows_accept_exactly_while_the_draft_is_the_argmax():
    """One segment of four rows whose argmaxes are 5, 6, 7, 0 with drafts 5, 6, 2: the first two are
    accepted, the third rejected and replaced by the argmax; the row after is not an output."""
    v = 8
    logits = np.full((4, v), -1.0, np.float32)
    for i, t in enumerate([5, 6, 7, 0]):
        logits[i, t] = 3.0
    params = SamplingParams(temperature=0.0)
    drafts_of = [5, 6, 2]
    rows = [RowSampling(params, 0, 4 + j, 0, prior=tuple(drafts_of[:j])) for j in range(4)]
    md = build_metadata(rows, 4, num_slots=1, max_logprobs=2, prior_width=3)
    drafts = Drafts(jnp.asarray(drafts_of + [-1], jnp.int32), jnp.zeros(4, jnp.int32), 1)
    state = init_sampler_state(1, v)
    out, state = jax.jit(sample)(jnp.asarray(logits), md, state, drafts)
    assert np.asarray(out.emitted).tolist() == [True, True, True, False]
    assert np.asarray(out.tokens)[:3].tolist() == [5, 6, 7]
    assert int(state.last_tokens[0]) == 7  # the last emitted token feeds the next step


# -- the proposer --------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    prop = NgramProposer(1, 3)
    seq = np.array([9, 1, 2, 3, 4, 7, 1, 2, 3, 5, 6, 8, 1, 2, 3])
    assert prop.propose(seq, 2) == [5, 6]  # "1 2 3" last seen before "5 6"
    assert prop.propose(np.array([4, 4, 1, 2, 4, 9, 2]), 3) == [4, 9, 2]  # only "2" matches (n = 1)
    assert NgramProposer(2, 3).propose(np.array([4, 4, 1, 2, 4, 9, 2]), 3) == []  # no 2-gram repeats
    assert prop.propose(np.array([1, 2, 1, 2]), 5) == [1, 2]  # what there is, up to k


def test_may_propose_is_false_only_where_no_next_token_gives_a_proposal():
    """The engine skips reading a step early when prompt lookup cannot match whatever token it draws:
    over random short sequences of a small vocabulary, may_propose(known) is False only where
    propose(known + [x]) is empty for every x, and it is False for some."""
    rng = np.random.default_rng(0)
    falses = 0
    for n_min, n_max in ((1, 3), (2, 4), (3, 3)):
        prop = NgramProposer(n_min, n_max)
        for _ in range(300):
            known = rng.integers(0, 6, size=int(rng.integers(1, 12)))
            if not prop.may_propose(known):
                falses += 1
                assert all(prop.propose(np.append(known, x), 3) == [] for x in range(6)), (n_min, known)
    assert falses > 0


def test_max_drafts_leaves_every_running_request_room_for_a_full_segment():
    ecfg = TINY_ENGINE.replace(speculative_config=SPEC)
    assert max_drafts(ecfg, budget=64) == 3  # 4 requests x (1 + 3) <= 64
    assert max_drafts(ecfg, budget=12) == 2  # 4 x 3 = 12
    assert max_drafts(ecfg, budget=4) == 0


def test_the_compute_bound_batch_is_where_a_decode_steps_flops_floor_reaches_its_bytes_floor():
    """The default disable_by_batch_size: at that many decode rows the step's flops take at least as long
    as its bytes at the machine's peaks, at one fewer they take less; unknown peaks give no limit."""
    cost = CostModel(TINY, tiny_params(), np.float32)
    for bw, fl in ((20.0, 150.0), (5.0, 400.0), (100.0, 50.0)):
        peaks = MachinePeaks(bw, fl)
        n = compute_bound_batch(cost, peaks)

        def terms(rows):
            c = cost.step([1] * rows, [0] * rows)
            return c.flops / (fl * 1e9), c.bytes / (bw * 1e9)

        flops_s, bytes_s = terms(n)
        assert flops_s >= bytes_s
        flops_s, bytes_s = terms(n - 1) if n > 1 else (0.0, 1.0)
        assert flops_s < bytes_s
    assert compute_bound_batch(cost, MachinePeaks(20.0, 0.0)) is None


def test_config_errors_name_the_field_and_the_limit():
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min .3. exceeds prompt_lookup_max .2."):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match=r"unknown speculative_config keys \['lookahead'\]"):
        EngineConfig(speculative_config={"lookahead": 3})
    with pytest.raises(ValueError, match="disable_by_batch_size must be an integer >= 0 or null, got -1"):
        SpeculativeConfig(disable_by_batch_size=-1)
    with pytest.raises(ValueError, match="method must be one of ngram, draft_model"):
        SpeculativeConfig.of('{"method": "eagle"}')
    assert EngineConfig(speculative_config=json.dumps(SPEC)).num_speculative_tokens == K
    with pytest.raises(ValueError, match=r"token budget \(4 tokens\) over max_num_seqs \(4\) leaves none"):
        jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE.replace(
            speculative_config=SPEC, max_num_batched_tokens=4))


# -- through the engine, tiny random models --------------------------------------------------------------


def prompts_of(n, seed=0, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, TINY.vocab_size, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def engines():
    """The plain tiny engine and its speculating twin."""
    params = tiny_params()
    plain = jaxinfer.LLM.from_params(TINY, params, engine_config=TINY_ENGINE)
    spec = jaxinfer.LLM.from_params(TINY, params, engine_config=TINY_ENGINE.replace(speculative_config=SPEC))
    return plain, spec


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


GREEDY_CASES = {
    "plain": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
    "penalties": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                                presence_penalty=0.4, frequency_penalty=0.3),
    "min_tokens": SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, stop_token_ids=[7, 9, 11]),
}


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
def test_greedy_output_is_the_plain_output_with_drafts_accepted_and_rejected(engines, case):
    """Eight prompts of 3-30 tokens through four slots (chunked prefill, requests joining mid-run): each
    request's tokens and logprobs are the plain engine's; the drafts accepted are exactly those that
    match, counted per request."""
    plain, spec = engines
    sp = GREEDY_CASES[case]
    prompts = prompts_of(8, seed=len(case))
    want = plain.generate(prompts, sp)
    spec.engine.speculator.proposer = Oracle({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)})
    before = spec.engine.speculator.stats.num_accepted_tokens
    got = spec.generate(prompts, sp)
    assert ids(got) == ids(want)
    for g, w in zip(got, want):
        if sp.logprobs:
            assert [lp.logprob for lp in g.outputs[0].logprobs] == pytest.approx(
                [lp.logprob for lp in w.outputs[0].logprobs], abs=1e-5)
        m = g.metrics
        assert m.spec_drafts > 0 and 0 < m.spec_accepted_tokens < m.spec_draft_tokens
    st = spec.engine.speculator.stats
    assert st.num_accepted_tokens - before == sum(o.metrics.spec_accepted_tokens for o in got)
    assert spec.engine.allocator.num_used == 0  # every page given back (rejected positions' pages too)


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(engines):
    plain, spec = engines
    prompts = prompts_of(3, seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = plain.generate(prompts, sp)
    spec.engine.speculator.proposer = Oracle({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)})
    for p, w in zip(prompts, want):
        out = w.outputs[0].token_ids
        stop = out[6]
        cut = out.index(stop) + 1
        got = spec.generate([p], dataclasses.replace(sp, stop_token_ids=[stop]))[0].outputs[0]
        assert got.token_ids == out[:cut] and got.finish_reason == "stop"


def test_preemption_and_prefix_hits_keep_the_greedy_output(engines):
    """A KV cache too small for the batch (requests preempted and recomputed) and prompts sharing a
    prefix (prefix-cache hits): the same tokens as the plain engine with room for all."""
    plain, _ = engines
    params = tiny_params()
    small = TINY_ENGINE.replace(num_pages=24, speculative_config=SPEC)
    spec = jaxinfer.LLM.from_params(TINY, params, engine_config=small)
    shared = prompts_of(1, seed=9, lo=12, hi=13)[0]
    prompts = [shared + p for p in prompts_of(6, seed=10, lo=2, hi=6)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = plain.generate(prompts, sp)
    spec.engine.speculator.proposer = Oracle({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)})
    got = spec.generate(prompts, sp)
    assert ids(got) == ids(want)
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.allocator.hits > 0


def test_seeded_sampling_draws_the_plain_engines_tokens_alone_or_in_a_batch(engines):
    """A verify row draws what plain decoding draws at its position: seeded requests (top-p, logprobs) give
    the plain engine's tokens and logprobs, in a batch and alone, with drafts accepted and rejected."""
    plain, spec = engines
    prompts = prompts_of(4, seed=21)
    sp = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, ignore_eos=True, seed=1234, logprobs=2)
    want = plain.generate(prompts, sp)
    spec.engine.speculator.proposer = Oracle({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)})
    before = spec.engine.speculator.stats.snapshot()
    batch = spec.generate(prompts, sp)
    alone = [spec.generate([p], sp)[0] for p in prompts[:2]]
    assert ids(batch) == ids(want) and ids(alone) == ids(want)[:2]
    for g, w in zip(batch + alone, want + want[:2]):
        assert [lp.logprob for lp in g.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in w.outputs[0].logprobs], abs=1e-5)
    after = spec.engine.speculator.stats.snapshot()
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert 0 < accepted < after["num_draft_tokens"] - before["num_draft_tokens"]


def test_a_step_with_more_requests_decoding_than_disable_by_batch_size_drafts_nothing(engines):
    """disable_by_batch_size 2: while more than two of eight requests decode, no request proposes and the
    engine reads no step early for drafts; the last two (the longest) speculate; greedy and seeded tokens
    are the plain engine's either way."""
    plain, spec = engines
    prompts = prompts_of(8, seed=60)
    spec_engine = spec.engine.speculator
    assert spec_engine.batch_limit is None or spec_engine.batch_limit >= TINY_ENGINE.max_num_seqs
    for base in (SamplingParams(temperature=0.0, ignore_eos=True),
                 SamplingParams(temperature=1.0, ignore_eos=True, seed=7)):
        sp = [dataclasses.replace(base, max_tokens=8 + 4 * i) for i in range(len(prompts))]  # a tail of few
        want = plain.generate(prompts, sp)
        spec_engine.proposer = Oracle({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)})
        limit, spec_engine.batch_limit = spec_engine.batch_limit, 2
        before, syncs, steps = spec_engine.stats.snapshot(), spec.engine.stats.spec_syncs, spec.engine.stats.steps
        try:
            got = spec.generate(prompts, sp)
        finally:
            spec_engine.batch_limit = limit
        assert ids(got) == ids(want)
        after = spec_engine.stats.snapshot()
        unspeculated = after["unspeculated_steps"] - before["unspeculated_steps"]
        assert unspeculated > 0 and after["num_accepted_tokens"] > before["num_accepted_tokens"]
        # a step that does not speculate reads early only right after a verify (at most one per speculating step)
        speculating = spec.engine.stats.steps - steps - unspeculated
        assert spec.engine.stats.spec_syncs - syncs <= 2 * speculating < spec.engine.stats.steps - steps
    cfg = TINY_ENGINE.replace(speculative_config={**SPEC, "disable_by_batch_size": 2})
    llm = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=cfg)
    assert llm.engine.speculator.batch_limit == 2
    llm.close()


def test_sampled_speculation_draws_from_the_plain_distribution(engines):
    """1,000 requests with and without drafts (temperature 1, top-k 3: nine joint outcomes for the second
    and third tokens, both verified): the joint counts are one distribution (chi-square, contingency)."""
    plain, spec = engines
    prompt = prompts_of(1, seed=33, lo=6, hi=7)[0]
    greedy = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    g = greedy.outputs[0].token_ids

    class Likely:  # the greedy path's tokens: likely under top-k 3, so drafts are often accepted
        def propose(self, tokens, k):
            done = len(tokens) - len(prompt)
            return g[done:done + k]

    spec.engine.speculator.proposer = Likely()
    n = 1000
    counts = []
    for llm in (plain, spec):
        sps = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
        outs = llm.generate([prompt] * n, sps)
        pairs = [tuple(o.outputs[0].token_ids[1:3]) for o in outs]
        counts.append(pairs)
    cells = sorted(set(counts[0]) | set(counts[1]))
    table = np.array([[c.count(cell) for cell in cells] for c in counts])
    table = table[:, table.sum(axis=0) >= 10]
    assert stats.chi2_contingency(table).pvalue > 1e-3
    st = spec.engine.speculator.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_no_program_compiles_after_warm_up_with_speculation():
    """The verify programs are listed: each has the plain program of its shape as a twin (the list grows by
    the logits-row bucket only), and a workload after warm-up compiles nothing. (A lean bucket set: few
    programs.)"""
    lean = TINY_ENGINE.replace(batch_buckets=(4,), chunk_buckets=(16,), max_num_batched_tokens=16,
                               speculative_config=SPEC)
    spec = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=lean)
    keys = spec.engine.program_keys()
    verify = [k for k in keys if k.logits != k.batch]
    assert verify and all(dataclasses.replace(k, logits=k.batch) in keys for k in verify)
    spec.engine.warmup()
    spec.engine.speculator.proposer = NgramProposer(1, 3)
    spec.generate(prompts_of(6, seed=44), SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3))
    assert spec.engine.speculator.stats.num_draft_tokens > 0
    assert spec.runner.programs.compiled_late == []


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    same = jaxinfer.save_model(root / "same", TINY, tiny_params())
    other = jaxinfer.save_model(root / "other", TINY, tiny_params(seed=1))
    return str(same), str(other)


def test_a_draft_model_proposes_and_greedy_output_stays_the_plain_output(engines, draft_dirs):
    """The target itself as its draft (from a saved copy): every draft is accepted — the draft's cache,
    caught up over the target's pages chunk by chunk and then a token a step, gives the target's own
    argmax; another random model of the vocabulary as the draft: drafts rejected, output unchanged."""
    plain, _ = engines
    prompts = prompts_of(6, seed=50)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = ids(plain.generate(prompts, sp))
    for path, all_accepted in zip(draft_dirs, (True, False)):
        cfg = TINY_ENGINE.replace(speculative_config={"method": "draft_model", "model": path,
                                                      "num_speculative_tokens": K})
        llm = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=cfg)
        assert ids(llm.generate(prompts, sp)) == want
        st = llm.engine.speculator.stats
        assert st.num_draft_tokens > 0
        assert (st.num_accepted_tokens == st.num_draft_tokens) if all_accepted else (
            st.num_accepted_tokens < st.num_draft_tokens)
        llm.engine.allocator.check_all_free()
        llm.close()


# -- the real model ------------------------------------------------------------------------------------------

COPY_TASKS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Copy the list: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Fix the typo and repeat the rest unchanged: def add(a, b):\n    retrun a + b\n",
]


@requires_smollm2
def test_smollm2_greedy_with_prompt_lookup_equals_plain(smollm2_llm):
    """The real model in float32, prompts it copies from (high acceptance), as a batch, with a stop string
    and with structured output: token for token the plain engine's output (the session's SmolLM2, whose
    programs other test files compile too: the program cache shares them)."""
    plain = smollm2_llm
    spec = jaxinfer.LLM("smollm2-135m-instruct", engine_config=plain.engine_config.replace(
        speculative_config={"method": "ngram", "num_speculative_tokens": 4}))
    tok = plain.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in COPY_TASKS]
    people = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}
    chats.append(tok.apply_chat_template(
        [{"role": "user", "content": "List the people as JSON: Ann is 31, Bob is 42 and Cid is 27."}],
        add_generation_prompt=True))
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    sps = [greedy] * len(COPY_TASKS) + [SamplingParams(temperature=0.0, max_tokens=48,
                                                       structured_outputs=StructuredOutputsParams(json=people))]
    want = plain.generate(chats, sps)
    # the same batch again with a stop string cutting the first answer mid-run
    stop = want[0].outputs[0].text.split()[4]
    chats.append(chats[0])
    sps.append(dataclasses.replace(greedy, stop=[stop]))
    want.append(plain.generate(chats[-1:], sps[-1:])[0])
    got = spec.generate(chats, sps)
    assert ids(got) == ids(want)
    assert got[-1].outputs[0].text == want[-1].outputs[0].text and got[-1].outputs[0].finish_reason == "stop"
    st = spec.engine.speculator.stats
    assert st.acceptance_rate > 0.3, st.snapshot()
    assert got[3].metrics.spec_accepted_tokens > 0  # the JSON's repeated keys were drafted and accepted
