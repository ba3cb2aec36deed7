"""A request's tokens and logprobs do not depend on what else is in the batch, in every precision.

The README promises that a seeded request draws the same tokens whatever else the engine is
running. That holds only if every product, norm and attention reduction computes a row's
numbers in an order that does not depend on the other rows: how many there are (a step of
1 row, of 32, or a prefill chunk of more than the decode kernel's rows), what they hold, how
the request's prompt was chunked, or whether its first pages came from the prefix cache.

Each case runs one target request alone, then the same request in the middle of a batch of
others with mixed prompt lengths (some sharing its first pages, so it takes prefix-cache hits
and its prefill is chunked differently under the shared token budget), then alone again
(now a prefix hit). Tokens and reported logprobs must be bitwise equal, greedy and seeded at
several temperatures, for float32, bfloat16, float16, int8 and int4 weights.

That holds on CPU with the native kernels (what CPU users get). The pure-JAX path (GPUs, TPUs,
``JAXINFER_CPU_KERNELS=0``) is invariant only in batch-invariant mode, and there only for the
products and row reductions (checked below op by op); its attention is not
(`tests/test_attention_invariance.py` records which XLA ops differ, as a strict xfail).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.ops import cpu_matmul, invariant
from jaxinfer.config import EngineConfig
from jaxinfer.sampling_params import SamplingParams
from tests.conftest import TINY, tiny_params

ENGINE = EngineConfig(
    page_size=4,
    num_pages=900,
    max_num_seqs=32,
    max_num_batched_tokens=96,
    batch_buckets=(1, 32),  # alone (1 row) and among the others (32): the two shapes the property is about
    # one prefill chunk size (more rows than the decode kernel's tile): the target's prompt alone and among
    # the others, and the mixed steps of its decode rows with their chunks. Token buckets 1, 32, 64: the
    # target's steps are (1 request, 1 token), (32, 32), (32, 64), as they were with an 8 bucket too (that one
    # held only other requests' last few decode rows): 3 programs per precision.
    chunk_buckets=(64,),
    page_buckets=(32,),  # one page-table width: fewer programs to compile per precision
    max_logprobs=5,
    kv_cache_dtype="float32",  # as the CPU preset has it; "kv-bfloat16" below caches in bfloat16
    name="invariance",
)

PRECISIONS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "float16": dict(dtype="float16"),
    "kv-bfloat16": dict(dtype="bfloat16", kv_cache_dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8"),
    "int4": dict(dtype="float32", quantization="int4"),
}

SAMPLING = [
    SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=11, max_tokens=20, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=1.3, top_p=0.9, seed=5, max_tokens=20, logprobs=2, ignore_eos=True),
]


def _prompts(seed: int = 0):
    rng = np.random.default_rng(seed)
    target = rng.integers(3, TINY.vocab_size, 37).tolist()
    others = []
    for i in range(31):
        n = int(rng.integers(1, 70))
        p = rng.integers(3, TINY.vocab_size, n).tolist()
        if i % 5 == 0:  # shares the target's first 4 pages: prefix hits in both directions
            p = target[:16] + p
        others.append(p)
    return target, others


def _key(out):
    c = out.outputs[0]
    lps = [(lp.token_id, lp.logprob, tuple(sorted(lp.top.items()))) for lp in c.logprobs]
    return c.token_ids, lps


@pytest.fixture(scope="module", params=list(PRECISIONS))
def llm(request):
    if not cpu_matmul.prepare():
        pytest.skip("the native CPU kernels are off or unavailable: the pure-JAX path is checked op by op below")
    opts = PRECISIONS[request.param]
    engine = ENGINE.replace(**opts)
    params = tiny_params(TINY)
    if not engine.quantization:  # LLM.from_params runs the tree as given: in the weights' dtype, as a loader gives it
        from jaxinfer.models import llama
        from jaxinfer.ops.spec import is_spec

        specs = llama.param_specs(TINY, jnp.dtype(engine.dtype))
        params = jax.tree.map(lambda s, x: x.astype(s.dtype), specs, params, is_leaf=is_spec)
    m = jaxinfer.LLM.from_params(TINY, params, engine_config=engine)
    wqkv = m.runner.params.layers[0].attention.wqkv
    assert wqkv.bits == int(engine.quantization[3:]) if engine.quantization else wqkv.dtype == engine.dtype
    yield m
    m.close()


def test_request_alone_equals_request_in_a_mixed_batch(llm):
    target, others = _prompts()
    for sp in SAMPLING:
        alone = _key(llm.generate([target], sp)[0])
        prompts = others[:15] + [target] + others[15:]
        batch = llm.generate(prompts, [sp] * len(prompts))
        inside = _key(batch[15])
        again = _key(llm.generate([target], sp)[0])  # its first pages are cached now
        assert inside[0] == alone[0], f"{llm.engine_config.dtype}/{llm.engine_config.quantization} {sp}: tokens"
        assert inside[1] == alone[1], f"{llm.engine_config.dtype}/{llm.engine_config.quantization} {sp}: logprobs"
        assert again == alone


def _rows_alone_and_among_others(f, width: int, dtype=np.float32):
    """f applied to a probe row alone and inside arrays of other rows (several sizes and places):
    the probe's result bits, one entry per case."""
    rng = np.random.default_rng(1)
    probe = rng.standard_normal(width).astype(dtype)
    got = []
    for m, at in [(1, 0), (2, 1), (5, 3), (16, 9), (33, 32), (100, 50)]:
        x = rng.standard_normal((m, width)).astype(dtype)
        x[at] = probe
        got.append(np.asarray(f(jnp.asarray(x)))[at].tobytes())
    return got


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
def test_tiled_dot_gives_a_row_the_same_bits_whatever_the_rows(monkeypatch, wdtype):
    """Batch-invariant mode's product on XLA's path (no kernel): each row the same in any batch,
    where XLA's own dot is not (the control)."""
    monkeypatch.setenv("JAXINFER_CPU_KERNELS", "0")
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((96, 200)).astype(np.float32)).astype(wdtype)
    dims = (((1,), (0,)), ((), ()))
    tiled = _rows_alone_and_among_others(
        jax.jit(lambda x: invariant.tiled_dot(x.astype(w.dtype), w, dims)), 96)
    assert len(set(tiled)) == 1
    plain = _rows_alone_and_among_others(
        jax.jit(lambda x: jax.lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=jnp.float32)), 96)
    assert len(set(plain)) > 1, "XLA's dot was invariant here: the control no longer shows the problem"


@pytest.mark.parametrize("kernels", [True, False])
def test_row_reductions_give_a_row_the_same_bits_whatever_the_rows(monkeypatch, kernels):
    """row_sum and the softmax family: the kernel's product with ones (kernels on) or the pairwise
    tree (batch-invariant mode on XLA's path), for norms' widths and a vocabulary's."""
    if kernels and not cpu_matmul.prepare():
        pytest.skip("native CPU kernels unavailable")
    if not kernels:
        monkeypatch.setenv("JAXINFER_CPU_KERNELS", "0")
        monkeypatch.setenv(invariant.ENV, "1")
    for width in (64, 576, 4099):
        for f in (invariant.row_sum, invariant.log_softmax, invariant.softmax, invariant.logsumexp,
                  lambda x: x * invariant.rsqrt(invariant.row_mean(x * x, keepdims=True) + 1e-6)):
            assert len(set(_rows_alone_and_among_others(jax.jit(f), width))) == 1, (width, f)
    x = np.random.default_rng(2).standard_normal((7, 4099)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(invariant.row_sum(jnp.asarray(x))), x.astype(np.float64).sum(-1), rtol=1e-5,
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(invariant.log_softmax(jnp.asarray(x))),
                               np.asarray(jax.nn.log_softmax(jnp.asarray(x))), atol=1e-5)


def test_mode_and_dtype_auto_follow_the_environment(monkeypatch):
    from jaxinfer.config import EngineConfig
    from jaxinfer.ops.backend import dtype_choice, resolve_engine_config

    monkeypatch.delenv(invariant.ENV, raising=False)
    assert EngineConfig().resolved().batch_invariant is False
    monkeypatch.setenv(invariant.ENV, "1")
    assert EngineConfig().resolved().batch_invariant is True
    assert EngineConfig(batch_invariant=False).resolved().batch_invariant is False  # explicit wins
    assert "batch_invariant=True" in repr(EngineConfig().resolved())  # a compile key (program fingerprint)
    monkeypatch.setenv("JAXINFER_CPU_KERNELS", "0")
    dtype, why = dtype_choice("cpu")
    assert dtype == "float32" and "JAXINFER_CPU_KERNELS=0" in why
    assert dtype_choice("gpu")[0] == "bfloat16"
    e = resolve_engine_config(EngineConfig(dtype="auto"), "cpu")
    assert e.dtype == "float32" and e.dtype_auto and e == EngineConfig(dtype="float32").resolved()
