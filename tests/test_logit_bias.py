"""logit_bias: OpenAI's token id -> bias, a padded per-row stage of the one sampler program."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxinfer
from conftest import TINY, TINY_ENGINE, tiny_params
from jaxinfer.engine.compile_cache import compile_count
from jaxinfer.ops.sampler import init_sampler_state, sample
from jaxinfer.engine.sampling import RowSampling, build_metadata
from jaxinfer.sampling_params import MAX_LOGIT_BIAS, SamplingParams

SP = SamplingParams
V = 64
sample_jit = jax.jit(sample)


def draw(logits, params, seeds=None, num_logprobs=0):
    rows = [RowSampling(p, seed=(seeds[i] if seeds else 100 + i), sample_pos=3, slot=i) for i, p in enumerate(params)]
    md = build_metadata(rows, logits.shape[0], num_slots=8, max_logprobs=num_logprobs)
    out, _ = sample_jit(np.asarray(logits, np.float32), md, init_sampler_state(8, V))
    return out


def rand_logits(b, seed=0):
    return np.random.default_rng(seed).normal(0, 2, (b, V)).astype(np.float32)


def test_a_plus_100_bias_forces_its_token_for_greedy_and_sampled_rows():
    lg = rand_logits(4, seed=1)
    weakest = lg.argmin(-1)  # the least likely token of each row
    params = [
        SP(temperature=0, logit_bias={int(weakest[0]): 100}),
        SP(temperature=1.0, logit_bias={str(weakest[1]): 100}),
        SP(temperature=1.5, top_p=0.9, top_k=5, logit_bias={int(weakest[2]): 100, 3: -50}),
        SP(temperature=0.7, logit_bias={int(weakest[3]): 100}),
    ]
    for seed in range(5):
        out = draw(lg, params, seeds=[seed * 4 + i for i in range(4)])
        np.testing.assert_array_equal(np.asarray(out.tokens), weakest)


def test_a_minus_100_bias_bans_the_greedy_argmax():
    lg = rand_logits(3, seed=2)
    order = np.argsort(-lg, axis=-1)
    out = draw(lg, [SP(temperature=0, logit_bias={int(order[i, 0]): -100}) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(out.tokens), order[:, 1])  # the runner-up wins
    both = SP(temperature=0, logit_bias={int(order[0, 0]): -100, int(order[0, 1]): -100})
    assert int(draw(lg[:1], [both]).tokens[0]) == order[0, 2]


def test_rows_without_a_bias_draw_what_they_draw_in_a_batch_without_any():
    lg = rand_logits(4, seed=3)
    plain = [SP(temperature=0), SP(temperature=0.9, seed=5), SP(temperature=1.2, top_k=10),
             SP(temperature=0.8, min_p=0.1)]
    seeds = [11, 12, 13, 14]
    for trial in range(4):
        base = np.asarray(draw(lg, plain, seeds=[s + trial for s in seeds]).tokens)
        for biased_row in range(4):  # one row gets a bias that changes its token; the others must not move
            params = list(plain)
            params[biased_row] = params[biased_row].clone(logit_bias={int(lg[biased_row].argmin()): 100})
            got = np.asarray(draw(lg, params, seeds=[s + trial for s in seeds]).tokens)
            keep = np.arange(4) != biased_row
            np.testing.assert_array_equal(got[keep], base[keep])
            assert got[biased_row] == lg[biased_row].argmin()


def test_logprobs_are_those_of_the_unbiased_distribution():
    lg = rand_logits(2, seed=4)
    target = int(lg[0].argmin())
    out = draw(lg, [SP(temperature=0, logprobs=3, logit_bias={target: 100}), SP(temperature=0, logprobs=3)],
               num_logprobs=3)
    ref = np.asarray(jax.nn.log_softmax(lg, axis=-1))
    assert int(out.tokens[0]) == target
    np.testing.assert_allclose(float(out.logprob[0]), ref[0, target], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-lg, axis=-1)[:, :3])
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-ref, axis=-1)[:, :3], rtol=1e-5, atol=1e-5)


def test_a_full_bias_of_300_entries_applies_every_entry_in_one_program():
    """Every one of the 300 slots is applied (here over a 512-token vocabulary), and a batch with
    and without a bias run the same traced program."""
    v = 512
    lg = np.random.default_rng(5).normal(0, 1, (2, v)).astype(np.float32)
    fn = jax.jit(sample)
    rows = lambda ps: [RowSampling(p, seed=0, sample_pos=0, slot=i) for i, p in enumerate(ps)]  # noqa: E731
    state = init_sampler_state(4, v)
    md = build_metadata(rows([SP(temperature=0), SP(temperature=0)]), 2, num_slots=4, max_logprobs=0)
    fn(lg, md, state)
    before = compile_count()
    banned = {t: -100.0 for t in np.argsort(-lg[0])[:MAX_LOGIT_BIAS].tolist()}  # the 300 best tokens of row 0
    md = build_metadata(rows([SP(temperature=0, logit_bias=banned), SP(temperature=0)]), 2, num_slots=4,
                        max_logprobs=0)
    assert md.bias_ids.shape == md.bias_values.shape == (2, MAX_LOGIT_BIAS)
    out, _ = fn(lg, md, state)
    assert compile_count() == before, "a logit_bias compiled another program"
    assert int(out.tokens[0]) == np.argsort(-lg[0])[MAX_LOGIT_BIAS]  # the best token no bias pushed down
    assert int(out.tokens[1]) == lg[1].argmax()


# -- through the engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    m = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE)
    yield m
    m.close()


def test_the_engine_applies_each_requests_bias_to_its_own_rows(llm):
    p = list(range(1, 23))
    sp = SP(max_tokens=6, temperature=0, ignore_eos=True)
    plain = llm.generate([p], sp)[0].outputs[0].token_ids
    forced = 7 if 7 not in plain else 8
    outs = llm.generate([p, p], [sp.clone(logit_bias={str(forced): 100}), sp])
    assert outs[0].outputs[0].token_ids == [forced] * 6  # prefill's first token and every decode step
    assert outs[1].outputs[0].token_ids == plain
    banned = llm.generate([p], sp.clone(logit_bias={t: -100 for t in set(plain)}))[0].outputs[0].token_ids
    assert not set(banned) & set(plain)
    assert llm.wait_idle()
    llm.engine.allocator.check_all_free()


def test_a_bias_out_of_the_vocabulary_is_refused_naming_the_id_and_the_size(llm):
    with pytest.raises(ValueError, match=rf"logit_bias token id {TINY.vocab_size} is out of range: .*"
                                         rf"vocabulary size \({TINY.vocab_size}\)"):
        llm.generate([[1, 2, 3]], SP(max_tokens=2, logit_bias={TINY.vocab_size: 1}))


def test_steps_without_a_bias_reuse_device_arrays_instead_of_shipping_them(llm):
    """A batch with no logit_bias gets the runner's neutral arrays, already on device (one pair per
    batch bucket, the same objects every step); a batch with one gets host arrays built for it."""
    runner = llm.runner
    rows = [RowSampling(SP(temperature=0), seed=0, sample_pos=1, slot=0)]
    a, b = runner._sampling(rows, 2), runner._sampling(rows, 2)
    assert isinstance(a.bias_ids, jax.Array) and a.bias_ids is b.bias_ids and a.bias_values is b.bias_values
    assert (np.asarray(a.bias_ids) == -1).all() and a.bias_ids.shape == (2, MAX_LOGIT_BIAS)
    biased = runner._sampling([RowSampling(SP(temperature=0, logit_bias={3: 1.5}), 0, 1, 0)], 2)
    assert isinstance(biased.bias_ids, np.ndarray)
    assert biased.bias_ids[0, 0] == 3 and biased.bias_values[0, 0] == 1.5 and (biased.bias_ids[1] == -1).all()
