"""Quantized weights (jaxinfer.ops.quant): the format, GGUF blocks kept exactly, and models that compute
the function of their dequantized weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, TINY_ENGINE, tiny_params
from test_paged_model import full_logits
from jaxinfer.ops import backend, quant
from jaxinfer.config import EngineConfig
from jaxinfer.models import decoder
from jaxinfer.ops.spec import abstract, check_tree

def dequantized_tree(params):
    """The float tree a quantized tree stands for (the LM head back to [hidden, vocab])."""
    def f(x):
        return jnp.asarray(quant.dequantize_host(jax.tree.map(np.asarray, x))) if quant.is_quantized(x) else x

    out = jax.tree.map(f, params, is_leaf=quant.is_quantized)
    if quant.is_quantized(params.lm_head):  # stored [vocab, hidden] when quantized
        out = dataclasses.replace(out, lm_head=out.lm_head.T)
    return out


@pytest.mark.parametrize("name", quant.SCHEMES)
def test_quantize_round_trip_error_is_within_half_a_step(name):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(128, 40)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero column: scale 0, exact zeros
    s = quant.Scheme.parse(name)
    qw = quant.quantize(w, s)
    back = quant.dequantize_host(qw)
    g = s.group_of(128)
    step = np.repeat(qw.scale.astype(np.float32), g, axis=0)
    # round to nearest against float16-rounded scales: within half a step (plus the offset's rounding)
    slack = 0.5 * step + (np.abs(np.repeat(qw.offset.astype(np.float32), g, axis=0)) * 2**-10 if s.offset else 0)
    assert np.all(np.abs(back - w) <= slack + 1e-6)
    assert np.all(back[:, 3] == 0)
    assert qw.q.dtype == (np.uint8 if s.bits == 4 else np.int8)
    assert qw.q.shape == ((64 if s.bits == 4 else 128), 40)
    # the jitted dequantization is the host one
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x.dequantize())(qw)), back)


def test_int4_packing_is_two_rows_per_byte():
    v = np.arange(8 * 3).reshape(8, 3) % 16
    q = quant.pack(v, 4)
    assert q.shape == (4, 3)
    np.testing.assert_array_equal(q[1, 2] & 15, v[2, 2])
    np.testing.assert_array_equal(q[1, 2] >> 4, v[3, 2])


@pytest.mark.parametrize("kind", quant.BLOCK_TYPES)
def test_gguf_blocks_decode_as_gguf_does(kind):
    import gguf

    rng = np.random.default_rng(2)
    w = rng.normal(size=(6, 64)).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(w, t)
    b = quant.blocks_from_gguf(raw, kind, (6, 64))
    np.testing.assert_array_equal(b.dequantize(), gguf.quants.dequantize(raw, t).reshape(6, 64))
    # kept in the matching scheme, the weight is exactly the file's
    scheme = quant.Scheme.parse("int8-g32" if kind == "Q8_0" else "int4-g32")
    leaf = quant.weight_from_hf([b], scheme, None)
    np.testing.assert_array_equal(quant.dequantize_host(leaf), b.dequantize().T)


@pytest.mark.parametrize("mode", quant.MODES)
def test_quantized_model_computes_its_dequantized_weights(mode):
    cfg, params = quant.quantize_params(tiny_params(), TINY, mode)
    assert cfg.quant == quant.default_scheme(mode)
    assert params.lm_head.bits == 8  # the head stays 8-bit under int4
    assert params.layers[0].attention.wqkv.bits == (8 if mode == "int8" else 4)
    specs = decoder.param_specs(cfg)
    check_tree(specs, params)
    assert jax.tree.structure(abstract(specs)) == jax.tree.structure(jax.tree.map(lambda x: 0, params))
    seq = np.random.default_rng(3).integers(0, TINY.vocab_size, 11).tolist()
    # with the native kernels where they build, activations in float32 (no VNNI): the dequantized model
    backend.prepare()
    choice = backend.KernelChoice.loaded()
    exact = dataclasses.replace(choice, simd="+".join(p for p in choice.simd.split("+") if p != "vnni"))
    got = full_logits(params, cfg, seq, exact)
    want = full_logits(dequantized_tree(params), TINY, seq, exact)
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max())
    if "vnni" in backend.simd_features(choice.simd):
        # activations quantized to int8 per block of 32 (cpu_matmul.int8_dot): measured 4.2% of the largest
        # logit on this random model, whose activations have no outliers to spare the blocks' scales
        vnni = full_logits(params, cfg, seq, choice)
        err = np.abs(vnni - want).max()
        assert 0 < err < 0.08 * np.abs(want).max(), err


def test_quantized_llm_generates_and_reports_its_quantization():
    import jaxinfer

    llm = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE.replace(quantization="int8"))
    try:
        assert llm.info()["quantization"] == "int8"
        out = llm.generate([[1, 2, 3, 4, 5]], jaxinfer.SamplingParams(max_tokens=6, temperature=0.0))[0]
        assert len(out.outputs[0].token_ids) == 6
    finally:
        llm.close()


def test_bad_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization must be"):
        quant.check_mode("fp8")


def test_a_layout_that_would_split_a_quantization_group_is_refused():
    from jaxinfer.ops import mesh

    w = quant.quantize(np.ones((64, 4), np.float32), quant.Scheme.parse("int4-g32"))
    rows = np.concatenate([np.arange(16), -np.ones(16, int), np.arange(16, 64), -np.ones(16, int)])  # a pad mid-group
    with pytest.raises(ValueError, match="splits the scale groups of a quantized weight"):
        mesh._quantized_maps(0, rows, w)
    aligned = np.concatenate([np.arange(32), -np.ones(32, int), np.arange(32, 64)])
    q_idx, s_idx = mesh._quantized_maps(0, aligned, w)
    np.testing.assert_array_equal(s_idx, [0, -1, 1])
    np.testing.assert_array_equal(q_idx, np.concatenate([np.arange(16), -np.ones(16, int), np.arange(16, 32)]))


def test_float_copy_check_sees_a_materialised_weight(monkeypatch):
    """The check device_check runs on GPU/TPU (where the dequantization must fuse into the dot): on
    CPU the native kernel takes decode's few rows and prefill's many without a float copy, and
    XLA's path (the GPU/TPU code, kernels off) does build the float weight, which the check sees."""
    from jaxinfer.models.decoder import matmul
    from jaxinfer.ops import cpu_matmul

    if cpu_matmul.prepare():
        for rows in (1, 64):
            got = quant.float_copy_check(256, 256, rows, "int4-g32", matmul)
            assert got["custom_call"] and got["fused"], rows
    monkeypatch.setenv("JAXINFER_CPU_KERNELS", "0")
    many = quant.float_copy_check(256, 256, 80, "int4-g32", matmul)  # a row count not traced above
    assert not many["fused"] and many["temp_bytes"] >= many["float_copy_bytes"] and not many["custom_call"]


@pytest.mark.parametrize("name", ["int8", "int8-g32", "int4-g32"])
def test_head_layout_rows_lookup_and_product(name):
    """The head's layout (axis 1, [vocab, hidden], groups along hidden): a lookup gives the rows,
    a product contracts them, and both are the dequantized matrix's."""
    from jaxinfer.models.decoder import matmul

    rng = np.random.default_rng(4)
    e = rng.normal(size=(50, 64)).astype(np.float32)
    w = quant.quantize(e, quant.Scheme.parse(name), axis=1)
    assert w.axis == 1 and w.shape == (50, 64) and w.q.shape[0] == 50
    back = quant.dequantize_host(w)
    np.testing.assert_array_equal(back, quant.dequantize_host(quant.quantize(e.T, quant.Scheme.parse(name))).T)
    wj = jax.tree.map(jnp.asarray, w)
    idx = jnp.asarray([[3, 49], [0, 7]])
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a, i: a.lookup(i))(wj, idx)), back[np.asarray(idx)])
    x = rng.normal(size=(3, 64)).astype(np.float32)
    y = np.asarray(jax.jit(lambda a, b: matmul(a, b, w_contract=1))(jnp.asarray(x), wj))
    from jaxinfer.ops import cpu_matmul

    if cpu_matmul.fits(3, wj, 1) and cpu_matmul.int8_dot(wj, backend.current().simd):
        x = np.asarray(cpu_matmul.quantize_x(jnp.asarray(x)))  # the VNNI path multiplies x quantized per block
    np.testing.assert_allclose(y, x.astype(np.float64) @ back.T.astype(np.float64), atol=2e-5 * np.abs(x).sum())
