"""The Pallas GPU (Triton) ragged paged attention (`jaxinfer.ops.attention_pallas_gpu`) run on CPU in Pallas
interpret mode: the same kernel body the cuda step lowers (tests/test_cross_lowering.py checks that it does).

(a) Against a float64 reference on random ragged mixes: decode rows, prefill chunks that cross pages, a
context already cached, empty (padding) requests, padding tokens, sliding windows, soft-capping, GQA ratios 1
to 8 (non-powers of two padded), float32 and bfloat16 caches (and bfloat16 queries). Unwritten slots hold large
garbage that must never be read.
(b) Bitwise batch invariance: a sequence's token gives the same bits alone in a decode step, inside a chunk of
any size and place, and beside other requests in a mixed step at another request index.

Interpret mode is slow (each shape compiles the kernel body as an XLA loop), so the shapes are tiny and every
case of one test shares one step shape. The wider sweep is marked ``slow``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import attention_pallas_gpu as gk
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.gather_attention import RaggedMetadata
from jaxinfer.ops.kv_cache import slots_for

PAGE = 8
NUM_PAGES = 24
WIDTH = 4  # page-table columns: contexts up to 32 keys


@functools.lru_cache(maxsize=None)
def attend(window: int, softcap: float, scale: float = 0.35):
    return jax.jit(functools.partial(gk.gpu_ragged_attention, scale=scale, window=window, softcap=softcap or None,
                                     interpret=True))


class World:
    """Sequences with fixed queries, keys and values per position and pages of their own, in one cache."""

    def __init__(self, h, kvh, d, cache_dtype, lengths, q_dtype=jnp.float32, seed=0):
        rng = np.random.default_rng(seed)
        self.h, self.kvh, self.d = h, kvh, d
        self.cache_dtype, self.q_dtype = jnp.dtype(cache_dtype), jnp.dtype(q_dtype)
        pages = rng.permutation(np.arange(1, NUM_PAGES)).astype(np.int32)
        self.tables = np.zeros((len(lengths), WIDTH), np.int32)
        used = 0
        for s, n in enumerate(lengths):
            need = -(-n // PAGE)
            assert need <= WIDTH and used + need < NUM_PAGES
            self.tables[s, :need] = pages[used:used + need]
            used += need
        # queries spread so the softmax weights are far from uniform; stored as the step passes them
        self.q = [np.asarray(jnp.asarray(rng.standard_normal((n, h, d)) * 2, self.q_dtype).astype(jnp.float32))
                  for n in lengths]
        self.k = [rng.standard_normal((n, kvh, d)).astype(np.float32) for n in lengths]
        self.v = [rng.standard_normal((n, kvh, d)).astype(np.float32) for n in lengths]
        garbage = rng.standard_normal((NUM_PAGES, PAGE, 2 * kvh, d)).astype(np.float32) * 100
        self.garbage = jnp.asarray(garbage).astype(self.cache_dtype)

    def cached(self, upto: dict) -> jax.Array:
        """The garbage cache with sequence s's keys/values 0 .. upto[s] - 1 written (an earlier step's)."""
        cache = np.array(self.garbage.astype(jnp.float32))
        for s, n in upto.items():
            for p in range(n):
                page, off = self.tables[s, p // PAGE], p % PAGE
                cache[page, off, 0::2] = self.k[s][p]
                cache[page, off, 1::2] = self.v[s][p]
        return jnp.asarray(cache).astype(self.cache_dtype)

    def step(self, rows, n_tokens, n_requests):
        """A ragged step: ``rows`` a list of (seq, start, count) or None (an empty request), padded to
        ``n_tokens`` tokens and ``n_requests`` requests. Returns (q, k, v, meta, cache before the step,
        [(seq, position, token index)])."""
        h, kvh, d = self.h, self.kvh, self.d
        q = np.zeros((n_tokens, h, d), np.float32)
        k = np.zeros((n_tokens, kvh, d), np.float32)
        v = np.zeros((n_tokens, kvh, d), np.float32)
        positions = np.full(n_tokens, -1, np.int32)
        slots = np.zeros(n_tokens, np.int32)
        starts, table, kv_lens, where = [0], np.zeros((n_requests, WIDTH), np.int32), np.zeros(n_requests, np.int32), []
        t = 0
        for r, row in enumerate(rows + [None] * (n_requests - len(rows))):
            if row is not None:
                s, start, count = row
                pos = np.arange(start, start + count)
                q[t:t + count], k[t:t + count], v[t:t + count] = self.q[s][pos], self.k[s][pos], self.v[s][pos]
                positions[t:t + count] = pos
                slots[t:t + count] = slots_for(self.tables[s][None], pos[None], PAGE)[0]
                table[r], kv_lens[r] = self.tables[s], start + count
                where += [(s, int(p), t + i) for i, p in enumerate(pos)]
                t += count
            starts.append(t)
        assert t <= n_tokens
        meta = RaggedMetadata(jnp.asarray(positions), jnp.asarray(slots), jnp.asarray(starts, jnp.int32),
                              jnp.asarray(table), jnp.asarray(kv_lens))
        before = self.cached({s: st for s, st, _ in (r for r in rows if r is not None)})
        return (jnp.asarray(q, self.q_dtype), jnp.asarray(k, self.q_dtype), jnp.asarray(v, self.q_dtype), meta,
                before, where)

    def reference(self, s, p, window, softcap, scale=0.35):
        """float64 attention of sequence s's token at p over its keys (as the cache holds them)."""
        rnd = lambda x: np.asarray(jnp.asarray(x, self.q_dtype).astype(self.cache_dtype).astype(jnp.float32),  # noqa: E731
                                   np.float64)
        lo = max(0, p - window + 1) if window else 0
        keys, values = rnd(self.k[s][lo:p + 1]), rnd(self.v[s][lo:p + 1])  # [L, KVH, D]
        q = self.q[s][p].astype(np.float64).reshape(self.kvh, self.h // self.kvh, self.d)
        scores = np.einsum("kgd,lkd->kgl", q, keys) * scale
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        w = np.exp(scores - scores.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        return np.einsum("kgl,lkd->kgd", w, values).reshape(self.h, self.d)


def run(world, rows, n_tokens, n_requests, window=0, softcap=0.0):
    """Outputs {(seq, position): [H, D] float32} of one step, checking padding tokens come out as zeros and
    the step's keys/values land in their slots."""
    q, k, v, meta, cache, where = world.step(rows, n_tokens, n_requests)
    out, cache = attend(window, softcap)(q, k, v, cache, meta)
    out = np.asarray(out.astype(jnp.float32))
    real = np.zeros(n_tokens, bool)
    real[[t for _, _, t in where]] = True
    assert not out[~real].any()
    written = np.asarray(cache.astype(jnp.float32)).reshape(-1, 2 * world.kvh, world.d)[np.asarray(meta.slots)[real]]
    np.testing.assert_array_equal(written[:, 0::2], np.asarray(k.astype(cache.dtype).astype(jnp.float32))[real])
    return {(s, p): out[t] for s, p, t in where}


MIX = dict(  # one step shape for every case: 24 tokens, 5 requests (some empty), contexts up to 32 keys
    lengths=(30, 9, 17, 3),
    rows=[(0, 29, 1), None, (1, 0, 9), (2, 5, 12), (3, 2, 1)],  # decode, empty, prompt, continued chunk, decode
)


@pytest.mark.parametrize("h,kvh,d,cache_dtype,q_dtype,window,softcap", [
    (2, 2, 16, jnp.float32, jnp.float32, 0, 0.0),  # GQA 1
    (6, 2, 16, jnp.bfloat16, jnp.float32, 5, 0.0),  # GQA 3 (padded to 4), a window inside a page
    (8, 1, 32, jnp.float32, jnp.float32, 11, 4.0),  # GQA 8, a window across pages, soft-capped
    (4, 2, 16, jnp.bfloat16, jnp.bfloat16, 0, 0.0),  # bfloat16 queries and cache
])
def test_matches_a_float64_reference_on_a_ragged_mix(h, kvh, d, cache_dtype, q_dtype, window, softcap):
    world = World(h, kvh, d, cache_dtype, MIX["lengths"], q_dtype=q_dtype)
    got = run(world, MIX["rows"], 24, 5, window, softcap)
    assert len(got) == 1 + 9 + 12 + 1
    tol = 3e-2 if jnp.dtype(q_dtype) == jnp.bfloat16 else 2e-5
    for (s, p), out in got.items():
        np.testing.assert_allclose(out, world.reference(s, p, window, softcap), rtol=tol, atol=tol, err_msg=f"{s}@{p}")


def test_a_step_with_no_real_token_is_all_zeros():
    world = World(4, 2, 16, jnp.float32, MIX["lengths"])
    assert run(world, [None, None], 24, 5) == {}


def test_a_token_gives_the_same_bits_alone_chunked_and_in_a_mixed_batch():
    """Sequence 0 (30 tokens, 4 pages) token by token alone, in chunks of 7 and 13, and as one prompt at request
    index 3 beside decode rows of other sequences: every token's output is bitwise the same. Each way is a
    step of another shape (8, 16, 48 tokens; 2, 3, 5 requests), as the engine's buckets make them."""
    for h, kvh, cache_dtype, window in [(4, 2, jnp.float32, 0), (6, 2, jnp.bfloat16, 6)]:
        world = World(h, kvh, 16, cache_dtype, (30, 20, 9, 5), seed=1)
        alone = {}
        for p in range(30):
            alone.update(run(world, [(0, p, 1)], 8, 2, window))
        ways = {"alone": alone}
        for size in (7, 13):
            outs = {}
            for start in range(0, 30, size):
                outs.update(run(world, [None, (0, start, min(size, 30 - start))], 16, 3, window))
            ways[f"chunks of {size}"] = outs
        mixed = run(world, [(1, 19, 1), (2, 0, 1), None, (0, 0, 30), (3, 0, 5)], 48, 5, window)
        ways["mixed"] = {key: val for key, val in mixed.items() if key[0] == 0}
        for name, outs in ways.items():
            assert sorted(outs) == [(0, p) for p in range(30)], name
            for p in range(30):
                assert np.array_equal(outs[(0, p)], alone[(0, p)]), (h, kvh, cache_dtype, window, name, p)
                np.testing.assert_allclose(alone[(0, p)], world.reference(0, p, window, 0.0), rtol=2e-5, atol=2e-5)


def test_the_fit_refuses_what_the_kernel_does_not_take():
    assert gk.gpu_kernel_fits(32, 8, 128, 16, jnp.bfloat16) and gk.gpu_kernel_fits(9, 3, 64, 16, jnp.float32)
    assert not gk.gpu_kernel_fits(8, 2, 96, 16, jnp.bfloat16)  # head_dim not a power of two
    assert not gk.gpu_kernel_fits(8, 2, 8, 16, jnp.bfloat16)  # too small for a Triton dot
    assert not gk.gpu_kernel_fits(8, 2, 128, 12, jnp.bfloat16)  # page size not a power of two
    assert not gk.gpu_kernel_fits(8, 3, 128, 16, jnp.bfloat16)  # heads not a multiple of the KV heads
    assert not gk.gpu_kernel_fits(8, 2, 128, 16, jnp.int8)  # a quantized cache
    with pytest.raises(ValueError, match="gpu_kernel_fits"):
        gk.gpu_ragged_attention(jnp.zeros((4, 8, 96)), jnp.zeros((4, 2, 96)), jnp.zeros((4, 2, 96)),
                                jnp.zeros((3, 16, 4, 96)), RaggedMetadata(*(jnp.zeros(4, jnp.int32),) * 2,
                                jnp.zeros(2, jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32)), 1.0)


def test_the_kernel_choice_names_it_on_cuda_only_and_the_switch_turns_it_off(monkeypatch):
    cuda = KernelChoice.for_platform("cuda")
    assert cuda.gpu_attention and "gpu attention" in str(cuda)
    assert cuda.attention_kernel(32, 8, 128, 16, jnp.bfloat16) == "gpu"
    assert cuda.attention_kernel(8, 2, 96, 16, jnp.bfloat16) is None  # unfit: the pure-JAX path
    assert not KernelChoice.for_platform("rocm").gpu_attention and not KernelChoice.for_platform("tpu").gpu_attention
    assert KernelChoice.pure_jax("cuda").attention_kernel(32, 8, 128, 16, jnp.bfloat16) is None
    monkeypatch.setenv("JAXINFER_GPU_KERNELS", "0")
    assert not KernelChoice.for_platform("cuda").gpu_attention
    assert KernelChoice.for_platform("cuda", gpu_kernels=True).gpu_attention
    with pytest.raises(ValueError, match="cuda platform only"):
        KernelChoice("tpu", gpu_attention=True)


@pytest.mark.slow
@pytest.mark.parametrize("ratio,cache_dtype", [(2, jnp.float32), (4, jnp.bfloat16), (5, jnp.float32),
                                               (7, jnp.bfloat16)])
def test_every_gqa_ratio_matches_the_reference(ratio, cache_dtype):
    world = World(ratio * 2, 2, 16, cache_dtype, MIX["lengths"], seed=ratio)
    for (s, p), out in run(world, MIX["rows"], 24, 5, window=7).items():
        np.testing.assert_allclose(out, world.reference(s, p, 7, 0.0), rtol=2e-5, atol=2e-5, err_msg=f"{s}@{p}")


def _triton_module(n_tokens, n_requests, dtype=jnp.bfloat16, precision=None, capsys=None):
    """The Triton module of the kernel lowered for cuda for a step of this shape (Llama 3's heads: 32 query
    and 8 KV heads of 128), as Pallas prints it with ``debug``."""
    from jaxinfer.tools import lowering

    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    meta = RaggedMetadata(sds((n_tokens,), i32), sds((n_tokens,), i32), sds((n_requests + 1,), i32),
                          sds((n_requests, 8), i32), sds((n_requests,), i32))
    args = (sds((n_tokens, 32, 128), dtype), sds((n_tokens, 8, 128), dtype), sds((n_tokens, 8, 128), dtype),
            sds((173, 16, 16, 128), dtype), meta)
    fn = functools.partial(gk.gpu_ragged_attention, scale=0.1, precision=precision, debug=True)
    capsys.readouterr()
    with lowering.abstract_device("cuda"):
        text = jax.jit(fn, donate_argnums=(3,)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    printed = capsys.readouterr().out
    assert lowering.has_pallas_gpu_attention(text)
    return printed[printed.index("The Triton module"):]


def _ops(module, name):
    """The ``name`` ops of a Triton module with their types, SSA names and locations dropped."""
    import re

    return [re.sub(r"%[\w#]+", "%", line.split(" loc(")[0].split(' "')[0]).strip()
            for line in module.splitlines() if f" {name} " in line]


def test_one_triton_program_whatever_the_step(capsys):
    """What makes the kernel batch-invariant on a GPU, where interpret mode cannot show it (XLA:CPU computes a
    row the same whatever its tile): every step shape, from a lone decode row to a wide mixed step, runs the
    same products and the same key loop (tile [64 rows x 128] x [128 x 64 keys], float32 sums), only over
    more programs. The products of float32 operands follow the step's precision (TF32 or full float32)."""
    small, wide = _triton_module(1, 1, capsys=capsys), _triton_module(96, 7, capsys=capsys)
    dots = _ops(small, "tt.dot")
    assert dots == _ops(wide, "tt.dot") and len(dots) == 2
    assert "tensor<64x128xbf16> * tensor<128x64xbf16> -> tensor<64x64xf32>" in dots[0]
    assert "tensor<64x64xbf16> * tensor<64x128xbf16> -> tensor<64x128xf32>" in dots[1]
    assert _ops(small, "scf.for") == _ops(wide, "scf.for") and len(_ops(small, "scf.for")) == 1
    assert all("inputPrecision = tf32" in d for d in _ops(_triton_module(4, 2, jnp.float32, capsys=capsys), "tt.dot"))
    exact = _ops(_triton_module(4, 2, jnp.float32, jax.lax.Precision.HIGHEST, capsys=capsys), "tt.dot")
    assert exact and not any("inputPrecision" in d for d in exact)  # IEEE float32: Triton's default, unprinted


def test_the_attention_entry_point_dispatches_to_it_for_ragged_steps_and_rows():
    """`jaxinfer.ops.attention` under a cuda choice with the kernel interpreted (`KernelChoice.gpu_interpret`):
    the ragged step and ``[B, T]`` rows (padding tokens inside a row) give the pure-JAX path's outputs and
    cache."""
    from jaxinfer.ops import attention, backend
    from jaxinfer.ops.attention import AttentionMetadata

    world = World(4, 2, 16, jnp.float32, MIX["lengths"], seed=3)
    q, k, v, meta, cache, _ = world.step(MIX["rows"], 24, 5)
    choice = KernelChoice("cuda", gpu_attention=True, gpu_interpret=True)
    assert "interpreted" in str(choice) and choice.attention_kernel(4, 2, 16, PAGE, jnp.float32) == "gpu"
    with pytest.raises(ValueError, match="needs gpu_attention"):
        KernelChoice("cuda", gpu_interpret=True)

    def both(fn, *args):
        with backend.using(choice):
            assert "pallas_call" in str(jax.make_jaxpr(fn)(*args))  # the kernel, not a fallback
            got = jax.jit(fn)(*args)
        with backend.using(KernelChoice.pure_jax("cuda")):
            want = jax.jit(fn)(*args)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
        return got

    both(lambda *a: attention.ragged_paged_attention(*a, scale=0.35, window=7), q, k, v, cache, meta)
    # two rows of 4 tokens: a continued chunk of sequence 2, and sequence 3's decode with 3 padding tokens
    pos = np.array([[5, 6, 7, 8], [2, -1, -1, -1]], np.int32)
    tables = world.tables[[2, 3]]
    slots = np.where(pos >= 0, slots_for(tables, np.maximum(pos, 0), PAGE), 0).astype(np.int32)
    rows = AttentionMetadata(jnp.asarray(pos), jnp.asarray(slots), jnp.asarray(tables), jnp.asarray([9, 3], jnp.int32))
    rng = np.random.default_rng(4)
    qr, kr, vr = (jnp.asarray(rng.standard_normal((2, 4, n, 16)), jnp.float32) for n in (4, 2, 2))
    out, _ = both(lambda *a: attention.paged_attention(*a, scale=0.35), qr, kr, vr, world.cached({2: 5, 3: 2}), rows)
    assert not np.asarray(out)[1, 1:].any()


@pytest.mark.parametrize("h,kvh,d,page,dtype,window,softcap", [
    (9, 3, 64, 16, jnp.bfloat16, 0, 0.0),  # SmolLM2's heads (GQA 3, padded to 4)
    (8, 8, 128, 128, jnp.float32, 4096, 0.0),  # no GQA, a page of 128 (one page a block), a window
    (16, 2, 256, 32, jnp.bfloat16, 4096, 50.0),  # Gemma-like: head_dim 256, a window, soft-capped
])
def test_it_lowers_to_triton_for_the_shapes_it_fits(h, kvh, d, page, dtype, window, softcap):
    from jaxinfer.tools import lowering

    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    n, r, p, cache = 16, 3, 8, (50, page, 2 * kvh, d)
    meta = RaggedMetadata(sds((n,), i32), sds((n,), i32), sds((r + 1,), i32), sds((r, p), i32), sds((r,), i32))
    args = (sds((n, h, d), dtype), sds((n, kvh, d), dtype), sds((n, kvh, d), dtype), sds(cache, dtype), meta)
    fn = functools.partial(gk.gpu_ragged_attention, scale=0.1, window=window, softcap=softcap or None)
    with lowering.abstract_device("cuda"):
        text = jax.jit(fn, donate_argnums=(3,)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lowering.has_pallas_gpu_attention(text)
    assert lowering.full_cache_ops(text, cache) == [] and lowering.cache_gathers(text, cache) == []
