"""Attention over ragged rows: the CPU kernel, the pure-JAX path and a float64 reference agree.

A ragged step is every token of every request in one flat list (`RaggedMetadata`): decode rows
(requests of one token), prefill chunks from position 0 and chunks continuing a cached context
(segments crossing pages), empty padding requests (at the end and between real ones) and padding
tokens after the last segment. Each random mix runs through `ragged_paged_attention` with the
native CPU kernel and with the pure-JAX path, and both are checked against a float64 numpy
reference written here from the definition (a token at position p attends its own request's keys
0..p, or p - w + 1..p with a window), and the written caches against each other and the expected
one. The same tokens as ``[B, T]`` rows (`paged_attention`) give bitwise the kernel's ragged output.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import attention, backend
from jaxinfer.ops.attention import AttentionMetadata, RaggedMetadata, paged_attention, ragged_paged_attention
from jaxinfer.ops.backend import KernelChoice

KERNEL = attention.prepare_cpu_kernel()
needs_kernel = pytest.mark.skipif(not KERNEL, reason="native CPU kernel unavailable")
CPU = KernelChoice.for_platform("cpu")
PURE = KernelChoice.pure_jax("cpu")

PAGE = 4
N, R, P = 48, 6, 8  # tokens, requests, pages per request: one shape for every mix (one compile per config)
NUM_PAGES = 1 + R * P


def random_mix(rng, h, kvh, d, cache_dtype):
    """A random ragged step and the cache it starts from (stale garbage in every slot)."""
    dtype = jnp.dtype(cache_dtype)
    cache = rng.standard_normal((NUM_PAGES, PAGE, 2 * kvh, d)).astype(np.float32) * 3
    cache = np.asarray(jnp.asarray(cache).astype(dtype).astype(jnp.float32))  # what the cache holds
    pages = rng.permutation(np.arange(1, NUM_PAGES)).astype(np.int32).reshape(R, P)
    table = np.zeros((R, P), np.int32)
    positions = np.full((N,), -1, np.int32)
    slots = np.zeros((N,), np.int32)
    query_start = np.zeros((R + 1,), np.int32)
    kv_lens = np.zeros((R,), np.int32)
    real = int(rng.integers(1, R))  # the rest are empty padding requests
    empty_between = int(rng.integers(0, real)) if rng.random() < 0.5 else -1
    at = 0
    for r in range(R):
        query_start[r] = at
        if r >= real or r == empty_between:
            continue
        left = N - 4 - at  # keep a few padding tokens at the end
        if left <= 0:
            continue
        count = 1 if rng.random() < 0.4 or left < 2 else int(rng.integers(2, min(20, left) + 1))
        count = min(count, left)
        first = int(rng.integers(0, P * PAGE - count + 1)) if rng.random() < 0.7 else 0
        last = first + count
        used = -(-last // PAGE)
        table[r, :used] = pages[r, :used]  # pages past the context stay the dummy page
        positions[at:at + count] = np.arange(first, last)
        slots[at:at + count] = table[r, positions[at:at + count] // PAGE] * PAGE + positions[at:at + count] % PAGE
        kv_lens[r] = last
        at += count
    query_start[R] = at
    q = rng.standard_normal((N, h, d)).astype(np.float32)
    k = rng.standard_normal((N, kvh, d)).astype(np.float32)
    v = rng.standard_normal((N, kvh, d)).astype(np.float32)
    meta = RaggedMetadata(*map(jnp.asarray, (positions, slots, query_start, table, kv_lens)))
    return q, k, v, cache, meta


def reference(q, k, v, cache, meta, scale, window, cache_dtype):
    """float64, from the definition: (out [N, H, D], the cache after the write)."""
    positions, slots, qs, table, _ = (np.asarray(x) for x in (meta.positions, meta.slots, meta.query_start,
                                                               meta.page_table, meta.kv_lens))
    n, h, d = q.shape
    kvh = k.shape[1]
    rounded = lambda x: np.asarray(jnp.asarray(x).astype(jnp.dtype(cache_dtype)).astype(jnp.float32))
    new = cache.copy()
    flat = new.reshape(-1, 2 * kvh, d)
    for r in range(len(qs) - 1):
        for t in range(qs[r], qs[r + 1]):
            if positions[t] >= 0:
                flat[slots[t], 0::2] = rounded(k[t])
                flat[slots[t], 1::2] = rounded(v[t])
    out = np.zeros((n, h, d))
    for r in range(len(qs) - 1):
        for t in range(qs[r], qs[r + 1]):
            p = positions[t]
            if p < 0:
                continue
            keys = np.arange(max(0, p - window + 1) if window else 0, p + 1)
            rows = new[table[r, keys // PAGE], keys % PAGE].astype(np.float64)  # [keys, 2*KVH, D]
            for head in range(h):
                kv = head // (h // kvh)
                s = rows[:, 2 * kv] @ q[t, head].astype(np.float64) * scale
                w = np.exp(s - s.max())
                out[t, head] = (w / w.sum()) @ rows[:, 2 * kv + 1]
    return out, new


@functools.lru_cache(maxsize=None)
def ragged_fn(choice, scale, window):
    def attend(q, k, v, cache, meta):
        with backend.using(choice):
            return ragged_paged_attention(q, k, v, cache, meta, scale, window)

    return jax.jit(attend)


CONFIGS = [
    # query heads, KV heads, head_dim, cache dtype, window
    (4, 4, 16, "float32", 0),  # one query head per KV head
    (8, 2, 32, "float32", 0),  # four per KV head
    (6, 2, 16, "float32", 5),  # a window longer than a page
    (8, 2, 32, "bfloat16", 0),
    (4, 1, 16, "bfloat16", 3),  # one KV head for all, a window shorter than a page
]
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-5}  # both paths read the same (rounded) cache


@pytest.mark.parametrize("h,kvh,d,cache_dtype,window", CONFIGS)
def test_kernel_and_pure_jax_agree_with_the_float64_reference(h, kvh, d, cache_dtype, window):
    rng = np.random.default_rng(zlib.crc32(repr((h, kvh, d, cache_dtype, window)).encode()))  # the same every run
    scale = d**-0.5
    paths = {"pure JAX": PURE} | ({"CPU kernel": CPU} if KERNEL else {})
    for _ in range(3):
        q, k, v, cache, meta = random_mix(rng, h, kvh, d, cache_dtype)
        want, want_cache = reference(q, k, v, cache, meta, scale, window, cache_dtype)
        real = np.asarray(meta.positions) >= 0
        got = {}
        for name, choice in paths.items():
            start = jnp.asarray(cache).astype(jnp.dtype(cache_dtype))
            out, new_cache = ragged_fn(choice, scale, window)(q, k, v, start, meta)
            out, new_cache = np.asarray(out), np.asarray(new_cache.astype(jnp.float32))
            got[name] = out
            np.testing.assert_allclose(out[real], want[real], rtol=1e-4, atol=1e-4, err_msg=name)
            assert not np.any(out[~real]), f"{name}: padding tokens must come out as zeros"
            # page 0 is the dummy page padding writes to; every other slot is the expected one
            np.testing.assert_array_equal(new_cache[1:], want_cache[1:], err_msg=name)
        if len(got) == 2:
            np.testing.assert_allclose(got["CPU kernel"], got["pure JAX"], rtol=TOLERANCE[cache_dtype],
                                       atol=TOLERANCE[cache_dtype])


@needs_kernel
@pytest.mark.parametrize("window", [0, 5])
def test_rows_are_the_ragged_call_bitwise_on_the_kernel(window):
    """[B, T] rows (each request a row, padding tokens after its real ones, padding rows) give the
    kernel's ragged output on the same tokens bit for bit, and the same cache."""
    rng = np.random.default_rng(11 + window)
    h, kvh, d = 8, 2, 32
    q, k, v, cache, meta = random_mix(rng, h, kvh, d, "float32")
    qs = np.asarray(meta.query_start)
    t = int(max(np.diff(qs).max(), 1))
    rows_pos = np.full((R, t), -1, np.int32)
    rows_slots = np.zeros((R, t), np.int32)
    rows_q = np.zeros((R, t, h, d), np.float32)
    rows_k = np.zeros((R, t, kvh, d), np.float32)
    rows_v = np.zeros((R, t, kvh, d), np.float32)
    for r in range(R):
        a, b = qs[r], qs[r + 1]
        rows_pos[r, :b - a], rows_slots[r, :b - a] = np.asarray(meta.positions)[a:b], np.asarray(meta.slots)[a:b]
        rows_q[r, :b - a], rows_k[r, :b - a], rows_v[r, :b - a] = q[a:b], k[a:b], v[a:b]
    rows = AttentionMetadata(jnp.asarray(rows_pos), jnp.asarray(rows_slots), meta.page_table, meta.kv_lens)

    def on_rows(*a):
        with backend.using(CPU):
            return paged_attention(*a, scale=d**-0.5, window=window)

    out_rows, cache_rows = jax.jit(on_rows)(rows_q, rows_k, rows_v, jnp.asarray(cache), rows)
    out, new_cache = ragged_fn(CPU, d**-0.5, window)(q, k, v, jnp.asarray(cache), meta)
    out, out_rows = np.asarray(out), np.asarray(out_rows)
    for r in range(R):
        a, b = qs[r], qs[r + 1]
        assert np.array_equal(out_rows[r, :b - a].view(np.uint32), out[a:b].view(np.uint32)), f"request {r}"
    np.testing.assert_array_equal(np.asarray(cache_rows)[1:], np.asarray(new_cache)[1:])


def test_pure_jax_reads_page_columns_in_blocks():
    """A step too large for one block of page columns loops over blocks (online softmax, blocks past
    every token skipped) and still equals the reference; the program holds no full-cache copy."""
    from jaxinfer.ops import gather_attention as ga

    rng = np.random.default_rng(3)
    q, k, v, cache, meta = random_mix(rng, 4, 2, 16, "float32")
    old = ga.BLOCK_BYTES
    ga.BLOCK_BYTES = 1  # one page column per block
    try:
        f = jax.jit(functools.partial(ga.ragged_gather_attention, scale=0.25, window=0), donate_argnums=3)
        text = f.lower(q, k, v, jnp.asarray(cache), meta).compile().as_text()
        out, new_cache = f(q, k, v, jnp.asarray(cache), meta)
    finally:
        ga.BLOCK_BYTES = old
    assert " while(" in text or "while(" in text
    layer = "f32[%d,%d,%d,%d]" % cache.shape
    assert not [ln for ln in text.splitlines() if layer in ln and " copy(" in ln], "a full-layer cache copy"
    want, want_cache = reference(q, k, v, cache, meta, 0.25, 0, "float32")
    real = np.asarray(meta.positions) >= 0
    np.testing.assert_allclose(np.asarray(out)[real], want[real], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(new_cache)[1:], want_cache[1:])


@needs_kernel
def test_the_kernels_derivative_is_the_pure_jax_paths():
    rng = np.random.default_rng(4)
    q, k, v, cache, meta = random_mix(rng, 4, 2, 16, "float32")

    def loss(choice, q, k, v):
        with backend.using(choice):
            return ragged_paged_attention(q, k, v, jnp.asarray(cache), meta, 0.25)[0].sum()

    got = jax.jit(jax.grad(functools.partial(loss, CPU), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(functools.partial(loss, PURE), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_metadata_of_the_wrong_shape_is_named():
    q, k, v, cache, meta = random_mix(np.random.default_rng(5), 4, 2, 16, "float32")
    bad = RaggedMetadata(meta.positions, meta.slots, meta.query_start[:-1], meta.page_table, meta.kv_lens)
    with pytest.raises(ValueError, match="query_start must be"):
        ragged_paged_attention(q, k, v, jnp.asarray(cache), bad, 0.25)
    bad = RaggedMetadata(meta.positions[:-1], meta.slots, meta.query_start, meta.page_table, meta.kv_lens)
    with pytest.raises(ValueError, match="positions and slots must be"):
        ragged_paged_attention(q, k, v, jnp.asarray(cache), bad, 0.25)
