"""The model over the paged KV cache: incremental computation equals full recomputation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, TINY_ENGINE, tiny_params
from jaxinfer.ops import backend, kv_cache
from jaxinfer.engine import step
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.config import EngineConfig, RopeScaling
from jaxinfer.models import decoder, llama
from jaxinfer.ops.sampler import init_sampler_state
from jaxinfer.engine.sampling import RowSampling, build_metadata
from jaxinfer.sampling_params import SamplingParams

PS = TINY_ENGINE.page_size
fwd = jax.jit(llama.forward, static_argnums=1)


@functools.partial(jax.jit, static_argnums=(1, 5))
def _fwd_with(params, cfg, ids, cache, attn, choice):
    with backend.using(choice):
        return llama.forward(params, cfg, ids, cache, attn)


def full_logits(params, cfg, seq, choice=None):
    """Logits at every position from one pass over `seq` on a fresh cache (no reuse); ``choice``: traced with
    these kernels (`jaxinfer.ops.backend.KernelChoice`), not whichever the host had at the first trace."""
    n = len(seq)
    cache = kv_cache.init_cache(cfg, EngineConfig(page_size=PS, num_pages=n // PS + 2))
    pos = np.arange(n, dtype=np.int32)[None]
    table = np.arange(1, 1 + -(-n // PS), dtype=np.int32)[None]
    attn = AttentionMetadata(pos, kv_cache.slots_for(table, pos, PS), table, np.array([n], np.int32))
    ids = jnp.asarray([seq], jnp.int32)
    if choice is None:
        h, _ = fwd(params, cfg, ids, cache, attn)
        return np.asarray(llama.logits(params, cfg, h[0]))
    h, _ = _fwd_with(params, cfg, ids, cache, attn, choice)
    with backend.using(choice):
        return np.asarray(llama.logits(params, cfg, h[0]))


def chunk_attn(pages, start, n, t_pad, p_pad):
    """Attention metadata for one row holding tokens [start, start+n) padded to t_pad."""
    pos = np.full((1, t_pad), -1, np.int32)
    pos[0, :n] = np.arange(start, start + n)
    table = np.zeros((1, p_pad), np.int32)
    table[0, : len(pages)] = pages
    slots = np.zeros((1, t_pad), np.int32)
    slots[0, :n] = kv_cache.slots_for(table[0], pos[0, :n], PS)
    return AttentionMetadata(pos, slots, table, np.array([start + n], np.int32))


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def test_paged_decode_matches_full_recompute_at_every_step(params):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, TINY.vocab_size, 7).tolist()
    cache = kv_cache.init_cache(TINY, TINY_ENGINE)
    pages = [9, 3, 17, 5, 11, 2, 30]  # deliberately scattered
    attn = chunk_attn(pages, 0, len(prompt), 8, 8)
    toks = np.zeros((1, 8), np.int32)
    toks[0, : len(prompt)] = prompt
    h, cache = fwd(params, TINY, jnp.asarray(toks), cache, attn)
    seq = list(prompt)
    step_logits = [np.asarray(llama.logits(params, TINY, h[0, len(prompt) - 1]))]
    for _ in range(12):
        seq.append(int(np.argmax(step_logits[-1])))
        p = len(seq) - 1
        attn = chunk_attn(pages, p, 1, 1, 8)
        h, cache = fwd(params, TINY, jnp.asarray([[seq[-1]]], jnp.int32), cache, attn)
        step_logits.append(np.asarray(llama.logits(params, TINY, h[0, 0])))
    ref = full_logits(params, TINY, seq)
    for i, lg in enumerate(step_logits):
        np.testing.assert_allclose(lg, ref[len(prompt) - 1 + i], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunks", [[13], [4, 4, 5], [1, 8, 4], [3, 3, 3, 3, 1]])
def test_chunked_prefill_matches_single_pass(params, chunks):
    rng = np.random.default_rng(1)
    seq = rng.integers(0, TINY.vocab_size, sum(chunks)).tolist()
    ref = full_logits(params, TINY, seq)
    cache = kv_cache.init_cache(TINY, TINY_ENGINE)
    pages = [40, 7, 22, 1, 15]
    start = 0
    for n in chunks:
        t_pad = 16
        attn = chunk_attn(pages, start, n, t_pad, 8)
        toks = np.zeros((1, t_pad), np.int32)
        toks[0, :n] = seq[start : start + n]
        h, cache = fwd(params, TINY, jnp.asarray(toks), cache, attn)
        got = np.asarray(llama.logits(params, TINY, h[0, :n]))
        np.testing.assert_allclose(got, ref[start : start + n], rtol=1e-4, atol=1e-4)
        start += n


def test_padding_rows_and_tokens_do_not_touch_other_pages(params):
    """Padding writes go to the dummy page 0 only."""
    cache = kv_cache.init_cache(TINY, TINY_ENGINE)
    attn = chunk_attn([5, 6], 0, 3, 16, 4)  # 13 padding tokens
    toks = np.zeros((1, 16), np.int32)
    toks[0, :3] = [1, 2, 3]
    _, cache = fwd(params, TINY, jnp.asarray(toks), cache, attn)
    for layer in cache:
        arr = np.asarray(layer)
        touched = {int(p) for p in np.nonzero(np.abs(arr).reshape(arr.shape[0], -1).sum(1))[0]}
        assert touched <= {0, 5}, touched


def test_decode_step_does_not_copy_the_cache():
    """A decode step's cost must not grow with cache capacity: no full-layer copy in the program."""
    cfg = TINY
    params = tiny_params()
    eng = TINY_ENGINE.replace(num_pages=512)
    cache = kv_cache.init_cache(cfg, eng)
    attn = AttentionMetadata(
        np.array([[5]], np.int32), np.array([[45]], np.int32), np.array([[11, 12]], np.int32), np.array([6], np.int32)
    )
    md = build_metadata([RowSampling(SamplingParams(temperature=0), 0, 6, 0)], 1, num_slots=4, max_logprobs=5)
    state = init_sampler_state(4, cfg.vocab_size)
    compiled = step.decode_step.lower(
        params, cache, state, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.bool_), attn, md, cfg=cfg
    ).compile()
    layer_shape = "f32[%d,%d,%d,%d]" % cache[0].shape
    hlo = compiled.as_text()
    copies = [ln for ln in hlo.splitlines() if layer_shape in ln and " copy(" in ln]
    assert not copies, f"{len(copies)} full-layer cache copies, e.g. {copies[0].strip()[:200]}"


def test_llama3_rope_scaling_keeps_high_frequencies_and_scales_low_ones():
    from dataclasses import replace

    base = replace(TINY, head_dim=64, rope_theta=500000.0)
    scaled = replace(base, rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=8192))
    f0, f1 = (decoder.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)[0] for c in (base, scaled))
    wavelen = 2 * np.pi / f0
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    np.testing.assert_allclose(f1[high], f0[high], rtol=1e-6)
    np.testing.assert_allclose(f1[low], f0[low] / 8.0, rtol=1e-6)
    mid = ~high & ~low
    assert np.all((f1[mid] < f0[mid]) & (f1[mid] > f0[mid] / 8.0))


def test_bfloat16_weights_and_cache_track_float32(params):
    """bfloat16 (the GPU/TPU default) gives the same logits as float32 within bf16 precision."""
    seq = list(range(3, 40, 3))
    ref = full_logits(params, TINY, seq)
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    n = len(seq)
    eng = EngineConfig(page_size=PS, num_pages=n // PS + 2, dtype="bfloat16")
    cache = kv_cache.init_cache(TINY, eng)
    assert cache[0].dtype == jnp.bfloat16
    attn = chunk_attn(list(range(1, n // PS + 2)), 0, n, n, 8)
    h, _ = fwd(p16, TINY, jnp.asarray([seq], jnp.int32), cache, attn)
    got = np.asarray(llama.logits(p16, TINY, h[0]))
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() < 0.05 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def test_forward_is_a_pure_function_research_code_can_differentiate(params):
    """The same forward used for serving works under jax.grad (no hidden state, no callbacks)."""
    seq = np.array([[5, 6, 7, 8, 9, 10]], np.int32)
    cache = kv_cache.init_cache(TINY, EngineConfig(page_size=PS, num_pages=4))

    def loss(p, cache, attn):
        h, _ = llama.forward(p, TINY, seq[:, :-1], cache, attn)
        lg = llama.logits(p, TINY, h)
        return -jnp.take_along_axis(jax.nn.log_softmax(lg), seq[:, 1:, None], axis=-1).mean()

    # jitted as one program (op by op, each op of the backward pass would compile on its own: 20 s)
    g = jax.jit(jax.grad(loss))(params, cache, chunk_attn([1, 2], 0, 5, 5, 2))
    leaves = jax.tree.leaves(g)
    assert all(bool(jnp.isfinite(x).all()) for x in leaves)
    assert float(jnp.abs(g.layers[0].attention.wqkv).sum()) > 0


def test_parameter_spec_tree_derives_shapes_and_shardings():
    from jaxinfer.ops import spec

    specs = llama.param_specs(TINY)
    params = tiny_params()
    spec.check_tree(specs, params)
    abstract = spec.abstract(specs)
    assert abstract.layers[1].attention.wqkv.shape == (TINY.hidden_size, TINY.q_size + 2 * TINY.kv_size)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    sh = spec.shardings(specs, mesh, {"mlp": "model", "qkv": "model", "heads": "model"})
    assert sh.layers[0].mlp.w_gate_up.spec == jax.sharding.PartitionSpec(None, "model")
    placed = jax.device_put(params, sh)
    assert placed.layers[0].mlp.w_down.sharding.spec == jax.sharding.PartitionSpec("model", None)
    bad = dataclasses.replace(params, final_norm=jnp.zeros((3,)))
    with pytest.raises(ValueError, match=r"final_norm.*\(3,\)"):
        spec.check_tree(specs, bad)
