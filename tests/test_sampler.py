"""The on-device sampler: filters, penalties, seeds, logprobs."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxinfer.engine.compile_cache import compile_count
from jaxinfer.ops.sampler import init_sampler_state, record_prompt, sample
from jaxinfer.engine.sampling import RowSampling, build_metadata
from jaxinfer.sampling_params import SamplingParams

V = 64
sample_jit = jax.jit(sample)


def draw(logits, params_list, *, seeds=None, positions=None, state=None, slots=None, num_logprobs=0, banned=None):
    b = logits.shape[0]
    rows = [
        RowSampling(
            p,
            seed=(seeds[i] if seeds else i),
            sample_pos=(positions[i] if positions else 0),
            slot=(slots[i] if slots else i),
            banned=(banned[i] if banned else ()),
        )
        for i, p in enumerate(params_list)
    ]
    md = build_metadata(rows, b, num_slots=8, max_logprobs=num_logprobs)
    state = init_sampler_state(8, logits.shape[1]) if state is None else state
    out, state = sample_jit(np.asarray(logits, np.float32), md, state)
    return out, state


def rand_logits(b, seed=0):
    return np.random.default_rng(seed).normal(0, 2, (b, V)).astype(np.float32)


def test_greedy_is_argmax():
    lg = rand_logits(4)
    out, _ = draw(lg, [SamplingParams(temperature=0)] * 4)
    np.testing.assert_array_equal(np.asarray(out.tokens), lg.argmax(-1))


def test_seeded_row_draws_the_same_token_whatever_the_batch():
    lg = rand_logits(1, seed=3)
    sp = SamplingParams(temperature=1.0, seed=1234)
    alone = [int(draw(lg, [sp], seeds=[1234], positions=[p])[0].tokens[0]) for p in range(20)]
    others = rand_logits(3, seed=9)
    busy_logits = np.concatenate([others[:2], lg, others[2:]])
    busy = []
    for p in range(20):
        out, _ = draw(
            busy_logits,
            [SamplingParams(temperature=0.7), SamplingParams(temperature=0), sp, SamplingParams(top_k=5)],
            seeds=[7, 8, 1234, 9],
            positions=[p + 3, p, p, p + 1],
        )
        busy.append(int(out.tokens[2]))
    assert alone == busy
    assert len(set(alone)) > 1  # the draws really vary with position


def test_sampling_follows_the_distribution():
    """Frequencies over many seeds match softmax(logits / T) (chi-square-ish bound)."""
    lg = np.array([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)], np.float32)
    t = 0.8
    n = 2000
    batch = np.repeat(lg, n, axis=0)
    out, _ = draw(batch, [SamplingParams(temperature=t)] * n, seeds=list(range(n)))
    counts = np.bincount(np.asarray(out.tokens), minlength=V)[:4] / n
    p = np.exp(lg[0, :4] / t)
    p /= p.sum()
    np.testing.assert_allclose(counts, p, atol=0.04)


@settings(max_examples=40, deadline=None)
@given(
    top_k=st.integers(0, 10),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.5),
    temp=st.floats(0.3, 2.0),
    seed=st.integers(0, 2**31),
)
def test_drawn_token_is_always_in_the_allowed_set(top_k, top_p, min_p, temp, seed):
    lg = rand_logits(1, seed=seed % 1000)
    sp = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    n = 16
    out, _ = draw(np.repeat(lg, n, 0), [sp] * n, seeds=[seed + i for i in range(n)])
    scaled = lg[0] / temp
    order = np.argsort(-scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    allowed = set(range(V))
    if min_p > 0:
        allowed &= {i for i in range(V) if probs[i] >= min_p * probs.max() - 1e-7}
    if top_k > 0:
        allowed &= set(order[:top_k].tolist())
    # top-p over what min-p and top-k left
    kept = [i for i in order if i in allowed]
    kp = probs[kept] / probs[kept].sum()
    before = np.cumsum(kp) - kp
    allowed &= {i for i, b in zip(kept, before) if b < top_p + 1e-5}
    for tok in np.asarray(out.tokens):
        assert int(tok) in allowed


def test_top_k_one_and_tiny_top_p_are_greedy():
    lg = rand_logits(6, seed=5)
    out, _ = draw(lg, [SamplingParams(temperature=1.5, top_k=1)] * 3 + [SamplingParams(temperature=1.5, top_p=1e-6)] * 3)
    np.testing.assert_array_equal(np.asarray(out.tokens), lg.argmax(-1))


def test_banned_tokens_are_never_drawn():
    lg = rand_logits(2, seed=11)
    best = lg.argmax(-1)
    out, _ = draw(lg, [SamplingParams(temperature=0)] * 2, banned=[(int(best[0]),), ()])
    assert int(out.tokens[0]) != best[0]
    assert int(out.tokens[1]) == best[1]


def test_penalties_change_the_choice_and_history_accumulates():
    lg = np.zeros((1, V), np.float32)
    lg[0, 5], lg[0, 6] = 3.0, 2.5
    state = init_sampler_state(8, V)
    sp = SamplingParams(temperature=0, presence_penalty=1.0)
    out, state = draw(lg, [sp], state=state)
    assert int(out.tokens[0]) == 5
    out, state = draw(lg, [sp], state=state)  # 5 is now present: 3 - 1 < 2.5
    assert int(out.tokens[0]) == 6
    out, state = draw(lg, [sp], state=state)  # both present: 5 wins again
    assert int(out.tokens[0]) == 5
    counts = np.asarray(state.output_counts)
    assert counts[0, 5] == 2 and counts[0, 6] == 1 and counts[1:].sum() == 0


def test_repetition_penalty_applies_to_prompt_tokens_and_slots_reset():
    lg = np.zeros((1, V), np.float32)
    lg[0, 5], lg[0, 6] = 3.0, 2.0
    state = init_sampler_state(8, V)
    toks = np.array([[5, 1, 2, 0]], np.int32)
    valid = np.array([[True, True, True, False]])
    state = record_prompt(state, toks, np.array([[0, 1, 2, -1]]), valid, md_for(slot=2, prompt_len=3))
    sp = SamplingParams(temperature=0, repetition_penalty=2.0)
    out, state = draw(lg, [sp], state=state, slots=[2])
    assert int(out.tokens[0]) == 6  # 3 / 2 < 2
    mask = np.asarray(state.prompt_mask)
    assert mask[2, [5, 1, 2]].all() and not mask[2, 0]  # padding token 0 not recorded
    # a new request in the same slot (chunk starting at 0) starts from a clean history
    state = record_prompt(state, np.array([[7]], np.int32), np.array([[0]]), np.array([[True]]), md_for(2, 1))
    assert np.asarray(state.prompt_mask)[2].sum() == 1 and np.asarray(state.output_counts)[2].sum() == 0


def test_recomputed_outputs_count_as_outputs_again():
    """After preemption a request's earlier outputs are re-fed as a prefill: they must still count."""
    state = init_sampler_state(8, V)
    toks = np.array([[4, 4, 9, 9, 9]], np.int32)  # prompt of 2, then 3 earlier outputs
    state = record_prompt(state, toks, np.arange(5)[None], np.ones((1, 5), bool), md_for(slot=1, prompt_len=2))
    assert np.asarray(state.output_counts)[1, 9] == 3 and np.asarray(state.output_counts)[1, 4] == 0
    assert np.asarray(state.prompt_mask)[1, 4] and not np.asarray(state.prompt_mask)[1, 9]


def md_for(slot, prompt_len):
    return build_metadata(
        [RowSampling(SamplingParams(), 0, prompt_len, slot, prompt_len=prompt_len)], 1, num_slots=8, max_logprobs=0
    )


def test_logprobs_are_raw_log_softmax():
    lg = rand_logits(2, seed=2)
    out, _ = draw(lg, [SamplingParams(temperature=0, logprobs=3)] * 2, num_logprobs=3)
    ref = jax.nn.log_softmax(lg, axis=-1)
    np.testing.assert_allclose(np.asarray(out.logprob), ref[np.arange(2), lg.argmax(-1)], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-lg, axis=-1)[:, :3])
    assert np.all(np.diff(np.asarray(out.top_logprobs), axis=-1) <= 0)


def test_one_program_serves_every_sampler_setting():
    """Sampler settings are data: one jitted sampler, traced once, serves greedy, sampling, filters,
    penalties and logprobs in any mix, and each stage still acts only on the rows that ask for it."""
    fn = jax.jit(sample)
    lg = rand_logits(4, seed=21)
    mixes = [
        [SamplingParams(temperature=0)] * 4,
        [SamplingParams(temperature=0.8, top_p=0.5, seed=1), SamplingParams(temperature=0), SamplingParams(top_k=3),
         SamplingParams(min_p=0.2)],
        [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0, logprobs=2),
         SamplingParams(repetition_penalty=1.5), SamplingParams(temperature=1.2, logprobs=0)],
    ]
    state = init_sampler_state(8, V)
    lowered = []
    for i, params in enumerate(mixes):
        lowered.append(compile_count())
        rows = [RowSampling(p, seed=j, sample_pos=i, slot=j) for j, p in enumerate(params)]
        md = build_metadata(rows, 4, num_slots=8, max_logprobs=5)
        out, state = fn(lg, md, state)
        for j, p in enumerate(params):
            if p.greedy and not p.uses_penalties:
                assert int(out.tokens[j]) == lg[j].argmax()
            if p.top_k:
                assert int(out.tokens[j]) in np.argsort(-lg[j])[: p.top_k]
        assert np.asarray(state.last_tokens)[:4].tolist() == np.asarray(out.tokens).tolist()
    assert lowered[1] == lowered[2] == compile_count(), "a sampler setting compiled another program"
    # logprobs rows get the raw distribution's top entries; the others are cut on the host
    ref = jax.nn.log_softmax(lg, axis=-1)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[1], np.argsort(-lg[1])[:5])
    np.testing.assert_allclose(np.asarray(out.top_logprobs)[1], np.sort(ref[1])[::-1][:5], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
        (dict(temperature=-1.0), "temperature must be non-negative, got -1.0."),
        (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
        (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
        (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
        (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2], got 3.0."),
        (dict(frequency_penalty=-2.5), "frequency_penalty must be in [-2, 2], got -2.5."),
        (dict(repetition_penalty=0.0), "repetition_penalty must be in (0, 100], got 0.0."),
        (dict(seed=-1), "seed must be in [0, 4294967295], got -1."),
        (dict(min_tokens=5, max_tokens=2), "min_tokens must be less than or equal to max_tokens=2, got 5."),
        (dict(logprobs=-1), "logprobs must be non-negative, got -1."),
        (dict(stop=[""]), "stop strings must be non-empty strings"),
        (dict(temperature=float("nan")), "temperature must not be NaN"),
        (dict(n=0), "n must be in [1, 128], got 0."),
        (dict(n=129), "n must be in [1, 128], got 129."),
        (dict(n=2.0), "n must be an integer, got 2.0."),
        (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias may hold at most 300 entries, got 301."),
        (dict(logit_bias={"12": 101}), "logit_bias value for token 12 must be in [-100, 100], got 101"),
        (dict(logit_bias={3: -100.5}), "logit_bias value for token 3 must be in [-100, 100], got -100.5"),
        (dict(logit_bias={"7": float("inf")}), "logit_bias value for token 7 must be finite, got inf"),
        (dict(logit_bias={"7": float("nan")}), "logit_bias value for token 7 must be finite, got nan"),
        (dict(logit_bias={"-1": 5}), "logit_bias keys must be token ids (non-negative integers), got '-1'"),
        (dict(logit_bias={"x1": 5}), "logit_bias keys must be token ids (non-negative integers), got 'x1'"),
        (dict(logit_bias={"1": 5, 1: 2}), "logit_bias names token 1 more than once"),
        (dict(logit_bias={1: "5"}), "logit_bias value for token 1 must be a number, got '5'"),
        (dict(logit_bias=[[1, 5]]), "logit_bias must be a mapping of token id -> bias, got list"),
    ],
)
def test_sampling_params_validation_names_field_and_limit(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_sampling_params_model_limits():
    with pytest.raises(ValueError, match=r"top_k must be at most the vocabulary size \(64\), got 100"):
        SamplingParams(top_k=100).check_against(vocab_size=64, max_logprobs=5)
    with pytest.raises(ValueError, match="greater than max allowed: 5"):
        SamplingParams(logprobs=6).check_against(vocab_size=64, max_logprobs=5)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    with pytest.raises(ValueError, match=r"logit_bias token id 64 is out of range: .*vocabulary size \(64\)"):
        SamplingParams(logit_bias={"64": 1.0}).check_against(vocab_size=64, max_logprobs=5)
    SamplingParams(logit_bias={"63": 1.0}).check_against(vocab_size=64, max_logprobs=5)


def test_logit_bias_keys_from_json_are_normalised_to_token_ids():
    """JSON object keys arrive as strings: they become ints, with the biases as floats; 300 entries fit."""
    sp = SamplingParams(logit_bias={"5": 3, 7: -100, "0012": 0.5})
    assert sp.logit_bias == {5: 3.0, 7: -100.0, 12: 0.5} and sp.has_logit_bias
    assert all(type(k) is int and type(v) is float for k, v in sp.logit_bias.items())
    assert len(SamplingParams(logit_bias={i: 100 for i in range(300)}).logit_bias) == 300
    assert not SamplingParams().has_logit_bias and not SamplingParams(logit_bias={}).has_logit_bias


def _filter_reference(logits, sp):
    """min-p, then top-k, then top-p (renormalised after top-k), in numpy: the set of tokens kept."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    allowed = np.ones(len(logits), bool)
    if sp.min_p > 0:
        allowed &= probs >= sp.min_p * probs.max()
    order = [i for i in np.argsort(-logits, kind="stable") if allowed[i]]
    if 0 < sp.top_k < len(logits):
        kth = logits[order[min(sp.top_k, len(order)) - 1]]
        allowed &= logits >= kth
        order = [i for i in order if allowed[i]]
    if sp.top_p < 1.0:
        kp = probs[order] / probs[order].sum()
        before = np.cumsum(kp) - kp
        cut = min(logits[i] for i, b in zip(order, before) if b < sp.top_p or i == order[0])
        allowed &= logits >= cut
    return allowed


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31))
@example(seed=58422868)  # a row of ties with -0.0 beside 0.0 at the top-k cut (signed zeros were two keys)
def test_filters_keep_exactly_the_reference_set(seed):
    """Top-k / top-p find their cut by bisection over the logits' values (no sort): each row keeps
    exactly the tokens the sorted reference keeps, flat rows, ties and top_k near the vocabulary too."""
    from jaxinfer.ops.sampler import _apply_filters

    rng = np.random.default_rng(seed)
    b = 6
    scale = rng.choice([0.05, 1.0, 4.0], size=(b, 1))  # flat rows need many tokens for their top-p mass
    lg = (rng.normal(0, 1, (b, V)) * scale).astype(np.float32)
    lg[0] = np.round(lg[0] * 2) / 2  # a row full of ties
    params = [
        SamplingParams(top_k=int(rng.choice([0, 1, 2, 5, 20, V - 1, V])), top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1])),
                       min_p=float(rng.choice([0.0, 0.0, 0.2])))
        for _ in range(b)
    ]
    md = build_metadata([RowSampling(p, seed=0, sample_pos=0, slot=i) for i, p in enumerate(params)], b,
                        num_slots=8, max_logprobs=0)
    kept = np.asarray(jax.jit(_apply_filters)(lg, md)) > np.finfo(np.float32).min
    for i, p in enumerate(params):
        want = _filter_reference(lg[i], p)
        assert (kept[i] == want).all(), (i, p, np.nonzero(kept[i] != want))
