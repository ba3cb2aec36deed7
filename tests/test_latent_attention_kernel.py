"""The native CPU kernel for multi-head latent attention (DeepSeek's absorbed form, `latent_paged_attention`).

A latent cache holds one entry of D values per token, shared by every query head: each head's key is the whole
entry, its value the entry's first ``value_dim`` values. The kernel (``jaxinfer_latent_attention`` in
jaxinfer/ops/kernels/paged_attention_cpu.cc) is checked against the pure-JAX path (`ragged_gather_attention`
with ``value_dim``) on random ragged steps (decode rows, prefill chunks from 0 and continuing a cached context,
scattered pages, empty requests, padding tokens), float32 and bfloat16 caches, entry sizes of an odd and an even
number of 8-float vectors; the caches they write are equal. Then batch invariance as
tests/test_attention_invariance.py checks the GQA kernel: a token's output is bitwise the same computed alone
token by token (decode), in prefill chunks of any size, in mixed batches beside other requests and padding, and
on one thread or the pool. Shapes the kernel does not take go to the pure-JAX path, and the kernel itself
refuses them with an error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import attention, backend
from jaxinfer.ops.attention import RaggedMetadata, latent_paged_attention
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.kv_cache import slots_for

KERNEL = attention.prepare_cpu_kernel()
pytestmark = pytest.mark.skipif(not KERNEL, reason="native CPU kernel unavailable")
CPU = KernelChoice.for_platform("cpu")
PURE = KernelChoice.pure_jax("cpu")

PAGE = 4
N, R, P = 40, 5, 8  # tokens, requests, pages per request: one shape per config
NUM_PAGES = 1 + R * P


def random_step(rng, h, d, cache_dtype):
    """A random ragged step over a cache of stale garbage: (q, entry, cache, meta)."""
    cache = jnp.asarray(rng.standard_normal((NUM_PAGES, PAGE, 1, d)).astype(np.float32) * 3).astype(cache_dtype)
    pages = rng.permutation(np.arange(1, NUM_PAGES)).astype(np.int32).reshape(R, P)
    table = np.zeros((R, P), np.int32)
    positions = np.full((N,), -1, np.int32)
    query_start = np.zeros((R + 1,), np.int32)
    kv_lens = np.zeros((R,), np.int32)
    real = int(rng.integers(2, R + 1))
    empty_between = int(rng.integers(0, real)) if rng.random() < 0.5 else -1
    at = 0
    for r in range(R):
        query_start[r] = at
        left = N - 3 - at  # a few padding tokens at the end
        if r >= real or r == empty_between or left <= 0:
            continue
        count = min(left, 1 if rng.random() < 0.4 else int(rng.integers(2, 16)))
        first = int(rng.integers(0, P * PAGE - count + 1)) if rng.random() < 0.7 else 0
        table[r, :-(-(first + count) // PAGE)] = pages[r, :-(-(first + count) // PAGE)]
        positions[at:at + count] = np.arange(first, first + count)
        kv_lens[r] = first + count
        at += count
    query_start[R] = at
    req = np.clip(np.searchsorted(query_start[1:], np.arange(N), side="right"), 0, R - 1)
    slots = np.where(positions >= 0, table[req, np.maximum(positions, 0) // PAGE] * PAGE + np.maximum(positions, 0)
                     % PAGE, 0).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((N, h, d)).astype(np.float32) * 2)
    entry = jnp.asarray(rng.standard_normal((N, 1, d)).astype(np.float32))
    meta = RaggedMetadata(*map(jnp.asarray, (positions, slots, query_start, table, kv_lens)))
    return q, entry, cache, meta


def traced_with(choice, scale, value_dim):
    """`latent_paged_attention` jitted under ``choice`` (the step's `KernelChoice`)."""
    fn = functools.partial(latent_paged_attention, scale=scale, value_dim=value_dim)

    def run(*args):
        with backend.using(choice):
            return fn(*args)

    return jax.jit(run)


CONFIGS = [
    # heads, entry size D, value_dim, cache dtype
    (4, 40, 32, "float32"),  # the test fixtures' latent (32 + 8): five 8-float vectors
    (3, 72, 64, "bfloat16"),
    (16, 576, 512, "bfloat16"),  # DeepSeek's latent (512 + 64)
]


@pytest.mark.parametrize("h,d,value_dim,cache_dtype", CONFIGS)
def test_kernel_matches_the_pure_jax_path(h, d, value_dim, cache_dtype):
    scale = d**-0.5
    kernel, pure = traced_with(CPU, scale, value_dim), traced_with(PURE, scale, value_dim)
    assert "jaxinfer_latent_attention" in kernel.lower(*random_step(np.random.default_rng(0), h, d,
                                                                    cache_dtype)).as_text()
    rng = np.random.default_rng(h * 1000 + d)
    for _ in range(3):
        q, entry, cache, meta = random_step(rng, h, d, cache_dtype)
        want, want_cache = pure(q, entry, cache, meta)
        got, got_cache = kernel(q, entry, cache, meta)
        assert got.shape == (N, h, value_dim)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
        padding = np.asarray(meta.positions) < 0
        assert not np.asarray(got)[padding].any()
        # page 0 is the dummy page padding tokens point at (the pure-JAX path writes them there, the kernel not)
        np.testing.assert_array_equal(np.asarray(got_cache[1:].astype(jnp.float32)),
                                      np.asarray(want_cache[1:].astype(jnp.float32)))
        assert not np.array_equal(np.asarray(got_cache[1:]), np.asarray(cache[1:]))  # it wrote something


def test_shapes_the_kernel_does_not_take_go_to_pure_jax():
    q, entry, cache, meta = random_step(np.random.default_rng(5), 4, 36, "float32")  # D not a multiple of 8
    assert not backend.latent_attention_fits(36, 32, jnp.float32)
    kernel = traced_with(CPU, 0.2, 32)
    assert "jaxinfer_latent_attention" not in kernel.lower(q, entry, cache, meta).as_text()
    got, _ = kernel(q, entry, cache, meta)
    want, _ = traced_with(PURE, 0.2, 32)(q, entry, cache, meta)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the kernel itself refuses them in one line
    with pytest.raises(Exception, match="multiple of 8"):
        jax.block_until_ready(attention.latent_kernel_call()(q, entry, cache, meta, 0.2, 32))


def test_derivatives_are_the_pure_jax_paths():
    q, entry, cache, meta = random_step(np.random.default_rng(6), 4, 40, "float32")

    def loss(choice, q, entry):
        with backend.using(choice):
            out, _ = latent_paged_attention(q, entry, cache, meta, scale=0.3, value_dim=32)
        return jnp.sum(out * jnp.cos(out))

    got = jax.jit(jax.grad(functools.partial(loss, CPU), argnums=(0, 1)))(q, entry)
    want = jax.jit(jax.grad(functools.partial(loss, PURE), argnums=(0, 1)))(q, entry)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


# -- batch invariance ---------------------------------------------------------------------------

LENGTHS = (70, 45, 23, 9)
CHUNKS = (3, 16, 37, 128)
INV_PAGE = 8


class World:
    """Sequences with fixed queries and entries per position, each on its own scattered pages."""

    def __init__(self, h, d, cache_dtype, seed=0):
        rng = np.random.default_rng(seed)
        self.h, self.d = h, d
        self.pages_per_seq = -(-max(LENGTHS) // INV_PAGE)
        self.num_pages = 1 + len(LENGTHS) * self.pages_per_seq + 3
        pages = rng.permutation(np.arange(1, self.num_pages)).astype(np.int32)
        self.tables = pages[: len(LENGTHS) * self.pages_per_seq].reshape(len(LENGTHS), self.pages_per_seq)
        self.q = [rng.standard_normal((n, h, d)).astype(np.float32) * 2 for n in LENGTHS]
        self.e = [rng.standard_normal((n, 1, d)).astype(np.float32) for n in LENGTHS]
        garbage = rng.standard_normal((self.num_pages, INV_PAGE, 1, d)).astype(np.float32) * 100
        self.initial_cache = jnp.asarray(garbage).astype(cache_dtype)

    def run(self, attend, steps, table_width=None):
        """Run ``steps`` (lists of rows (seq, start, n), None a padding row), each padded to [rows, longest
        chunk] tokens laid out as a ragged step of one request per row. Returns {(seq, position): out}."""
        cache, d = self.initial_cache, self.d
        width = table_width or self.pages_per_seq
        out = {}
        for step in steps:
            b = len(step)
            t = max(row[2] for row in step if row is not None)
            q = np.zeros((b * t, self.h, d), np.float32)
            e = np.zeros((b * t, 1, d), np.float32)
            positions = np.full((b * t,), -1, np.int32)
            table = np.zeros((b, width), np.int32)
            query_start = np.arange(b + 1, dtype=np.int32) * t
            for i, row in enumerate(step):
                if row is None:
                    continue
                s, start, n = row
                at = slice(i * t, i * t + n)
                positions[at] = np.arange(start, start + n)
                q[at], e[at] = self.q[s][start:start + n], self.e[s][start:start + n]
                table[i, : self.pages_per_seq] = self.tables[s]
            rows = np.repeat(np.arange(b), t)
            slots = np.where(positions >= 0, slots_for(table[rows], np.maximum(positions, 0)[:, None],
                                                       INV_PAGE)[:, 0], 0).astype(np.int32)
            kv_lens = np.where(positions.reshape(b, t) >= 0, positions.reshape(b, t) + 1, 0).max(axis=1)
            meta = RaggedMetadata(*map(jnp.asarray, (positions, slots, query_start, table, kv_lens.astype(np.int32))))
            o, cache = attend(jnp.asarray(q), jnp.asarray(e), cache, meta)
            o = np.asarray(o)
            for i, row in enumerate(step):
                if row is not None:
                    s, start, n = row
                    for j in range(n):
                        out[(s, start + j)] = o[i * t + j]
        return out


def kernel_path(d, value_dim, share=True):
    call = attention.latent_kernel_call(share=share)
    return jax.jit(lambda q, e, cache, meta: call(q, e, cache, meta, d**-0.5, value_dim))


def alone(seq, chunk):
    n = LENGTHS[seq]
    return [[(seq, s, min(chunk, n - s))] for s in range(0, n, chunk)]


def mixed_batches(rng, rows):
    """Every sequence at once: each starts after a random delay, prefills in chunks of random sizes, then
    decodes one token per step; rows shuffled every step, padding rows added."""
    todo = []
    for s, n in enumerate(LENGTHS):
        prompt = int(rng.integers(1, n + 1))
        chunks, at = [], 0
        while at < prompt:
            c = min(int(rng.choice([2, 5, 16, 33])), prompt - at)
            chunks.append((s, at, c))
            at += c
        chunks += [(s, p, 1) for p in range(prompt, n)]
        todo.append([None] * int(rng.integers(0, 4)) + chunks)
    steps = []
    while any(todo):
        step = [q.pop(0) for q in todo if q]
        step = [r for r in step if r is not None] + [None] * max(0, rows - len(step))
        if all(r is None for r in step):
            continue
        rng.shuffle(step)
        steps.append(step)
    return steps


def assert_same(got, want, what):
    assert got.keys() <= want.keys()
    for key, o in got.items():
        w = want[key]
        if not np.array_equal(o.view(np.uint32), w.view(np.uint32)):
            bad = np.argwhere(o != w)
            raise AssertionError(f"{what}: sequence {key[0]} position {key[1]} differs from the token computed alone "
                                 f"({len(bad)} elements, e.g. head {bad[0][0]} element {bad[0][1]})")


@pytest.mark.parametrize("h,d,value_dim,cache_dtype", [(4, 40, 32, "float32"), (40, 72, 64, "bfloat16")])
def test_kernel_output_does_not_depend_on_the_batch(h, d, value_dim, cache_dtype):
    world = World(h, d, cache_dtype)
    attend = kernel_path(d, value_dim)
    ref = {}
    for s in range(len(LENGTHS)):
        ref.update(world.run(attend, alone(s, 1)))  # decode steps, one token at a time
    for chunk in CHUNKS:
        assert_same(world.run(attend, alone(0, chunk)), ref, f"alone in chunks of {chunk}")
    rng = np.random.default_rng(1)
    for rows, width in [(4, None), (6, world.pages_per_seq + 3)]:
        got = world.run(attend, mixed_batches(rng, rows), table_width=width)
        assert len(got) == sum(LENGTHS)
        assert_same(got, ref, f"in mixed batches of {rows} rows")
    side_by_side = [[(0, 0, 37), (1, 0, 45), None, (2, 0, 20)], [(2, 20, 3), (0, 37, 33)]]
    assert_same(world.run(attend, side_by_side), ref, "prefill chunks side by side")
    # one thread instead of the pool (and so other head groups per item)
    assert_same(world.run(kernel_path(d, value_dim, share=False), mixed_batches(np.random.default_rng(2), 5)), ref,
                "on one thread")
