"""The TPU ragged paged attention adapter against the pure-JAX gather path.

Every check builds a padded batch (decode rows, prefill chunks from position 0, chunks that
continue a cached context, rows that end exactly at and one past a page boundary, padding
rows, an all-padding batch), runs it through `tpu_ragged_attention` (the rows packed into the
ragged layout first, as `paged_attention` does on TPU) and `gather_attention` on the same
inputs, and compares the real tokens' outputs and the returned caches. A ragged batch built
directly (the ragged step's layout) goes to the adapter as it is.

This JAX cannot interpret the Pallas kernel on CPU (see `interpreter_failure`), so:

* the adapter's mapping (write, ragged layout, call, unflatten) runs with a jittable
  stand-in for the kernel, `ragged_reference`, which is checked against the kernel's own
  pure-JAX reference `ref_ragged_paged_attention` (too slow to run eagerly for every case);
* the real kernel is traced and lowered to a Mosaic TPU program on CPU (an abstract TPU
  device), which checks the shapes and block sizes the adapter gives it;
* the interpret-mode tests run the real kernel when the interpreter can, else skip with
  the interpreter's exception.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops.gather_attention import AttentionMetadata, RaggedMetadata, gather_attention as _gather_attention
from jaxinfer.ops.gather_attention import ragged_gather_attention
from jaxinfer.ops.attention_pallas import (
    from_ragged,
    kernel_sequences,
    pallas_tpu_kernel,
    rows_as_ragged,
    to_ragged,
    tpu_kernel_fits,
    tpu_ragged_attention,
)
from jaxinfer.ops.kv_cache import slots_for

PAGE = 4  # tokens per page in these tests
D = 128  # the kernel's head_dim must be a multiple of 128


# -- a jittable stand-in for the kernel -----------------------------------------------------


def ragged_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None):
    """The kernel's contract in plain JAX, vectorised over tokens so that it jits.

    Token j of sequence s sits at position ``kv_len[s] - q_len[s] + (j - cu[s])`` and attends
    that sequence's keys up to it (and within the window). Tokens past ``cu[num_seqs]``
    get NaN: the real kernel leaves scratch there, so the adapter must never read them.
    """
    n, h, d = q.shape
    num_rows, p = page_indices.shape
    ps, kvh = kv_pages.shape[1], kv_pages.shape[2] // 2
    tok = jnp.arange(n, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), num_rows - 1)
    owned = tok < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + tok - cu_q_lens[seq]
    pages = kv_pages[page_indices[seq]].reshape(n, p * ps, kvh, 2, d)  # [N, S, KVH, 2, D]
    keys, values = pages[..., 0, :], pages[..., 1, :]
    k_pos = jnp.arange(p * ps, dtype=jnp.int32)[None, :]
    valid = (k_pos <= q_pos[:, None]) & (k_pos < kv_lens[seq][:, None])
    if sliding_window is not None:
        valid = valid & (k_pos > q_pos[:, None] - sliding_window)
    qg = q.reshape(n, kvh, h // kvh, d)
    logits = jnp.einsum("nkgd,nskd->nkgs", qg, keys, preferred_element_type=jnp.float32) * sm_scale
    logits = jnp.where(valid[:, None, None, :], logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("nkgs,nskd->nkgd", probs, values.astype(jnp.float32)).reshape(n, h, d)
    return jnp.where(owned[:, None, None], out, jnp.nan).astype(q.dtype)


# -- cases ----------------------------------------------------------------------------------


def make_case(rows, t, h, kvh, dtype, seed=0, pages_per_row=6):
    """rows: per batch row ``(start, n)`` (its chunk is positions start .. start+n-1, the rest
    of its T tokens padding) or None (a padding row). Pages are shuffled across rows."""
    rng = np.random.default_rng(seed)
    b = len(rows)
    num_pages = 1 + b * pages_per_row
    cache = rng.standard_normal((num_pages, PAGE, 2 * kvh, D), np.float32)
    table = rng.permutation(np.arange(1, num_pages)).astype(np.int32).reshape(b, pages_per_row)
    positions = np.full((b, t), -1, np.int32)
    for i, row in enumerate(rows):
        if row is not None:
            start, n = row
            assert n <= t and start + n <= pages_per_row * PAGE
            positions[i, :n] = np.arange(start, start + n)
            table[i, -(-(start + n) // PAGE):] = 0  # pages past the context: the dummy page
        else:
            table[i] = 0
    slots = np.where(positions >= 0, slots_for(table, np.maximum(positions, 0), PAGE), 0).astype(np.int32)
    kv_lens = np.where((positions >= 0).any(axis=1), positions.max(axis=1) + 1, 0).astype(np.int32)
    meta = AttentionMetadata(*(jnp.asarray(x) for x in (positions, slots, table, kv_lens)))
    arrays = [
        jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
        for shape in ((b, t, h, D), (b, t, kvh, D), (b, t, kvh, D))
    ]
    return (*arrays, jnp.asarray(cache).astype(dtype), meta)


# Rows as (start, n) or None (padding). Decode steps share one shape (B = 6, T = 1), chunks
# another (B = 5, T = 8), so each (window, dtype) compiles once per shape.
# Decode: kv_len 1, exactly one page (4), one past it (5), a padding row, two pages (8), 14.
DECODE = [(0, 1), (PAGE - 1, 1), (PAGE, 1), None, (2 * PAGE - 1, 1), (13, 1)]
# Prefill from position 0, ragged: kv_len 8 (two pages), 3, padding, 5 (one past a page), 1.
PREFILL = [(0, 8), (0, 3), None, (0, 5), (0, 1)]
# Chunks after a cached context: kv_len 13 (one past three pages), 8 (exactly two pages),
# padding, 12 (a chunk starting on a page boundary), 13 (a one-token chunk).
CONTINUE = [(5, 8), (2 * PAGE - 5, 5), None, (PAGE, 8), (3 * PAGE, 1)]
ALL_PADDING = [None] * 5

CASES = {
    # name: rows, T, H, KVH
    "decode": (DECODE, 1, 4, 2),
    "prefill": (PREFILL, 8, 4, 2),
    "continue": (CONTINUE, 8, 4, 2),
    "all_padding": (ALL_PADDING, 8, 4, 2),
    "continue_mqa": (CONTINUE, 8, 4, 1),
    "continue_mha": (CONTINUE, 8, 2, 2),
}
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2}


def rows_through_adapter(q, k, v, cache, meta, scale, window, **kw):
    """[B, T] rows through the adapter as `paged_attention` sends them on TPU: packed first."""
    ragged, index = rows_as_ragged(meta)
    out, cache = tpu_ragged_attention(to_ragged(q, index), to_ragged(k, index), to_ragged(v, index), cache, ragged,
                                      scale, window, **kw)
    return from_ragged(out, index), cache


@functools.partial(jax.jit, static_argnames=("scale", "window"))
def adapter_with_reference(q, k, v, cache, meta, scale, window):
    return rows_through_adapter(q, k, v, cache, meta, scale, window, kernel=ragged_reference)


gather = jax.jit(_gather_attention, static_argnames=("scale", "window"))


def check_against_gather(out, new_cache, q, k, v, cache, meta, window):
    """The real tokens' outputs equal the gather path's; every output is finite; the chunk's
    slots hold its k/v; nothing else changed except the dummy page."""
    scale = D**-0.5
    ref_out, ref_cache = gather(q, k, v, cache, meta, scale=scale, window=window)
    tol = TOLERANCE[jnp.dtype(q.dtype).name]
    real = np.asarray(meta.positions) >= 0
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert out.shape == q.shape and np.isfinite(out).all()
    np.testing.assert_allclose(out[real], ref_out[real], rtol=tol, atol=tol)
    new_cache, ref_cache = np.asarray(new_cache, np.float32), np.asarray(ref_cache, np.float32)
    np.testing.assert_array_equal(new_cache[1:], ref_cache[1:])
    slots = np.asarray(meta.slots)[real]
    written = new_cache.reshape(-1, *new_cache.shape[2:])[slots]  # [N, 2*KVH, D]
    np.testing.assert_array_equal(written[:, 0::2], np.asarray(k, np.float32)[real])
    np.testing.assert_array_equal(written[:, 1::2], np.asarray(v, np.float32)[real])
    untouched = np.ones(new_cache.shape[:2], bool)
    untouched[0] = False
    untouched[slots // PAGE, slots % PAGE] = False
    np.testing.assert_array_equal(new_cache[untouched], np.asarray(cache, np.float32)[untouched])


# -- the adapter's mapping ------------------------------------------------------------------


@pytest.mark.parametrize(
    "window,dtype", [(0, "float32"), (3, "float32"), (3, "bfloat16")]  # full causal; a window inside a page
)
@pytest.mark.parametrize("case", ["decode", "prefill", "continue", "all_padding"])
def test_adapter_matches_gather_path(case, window, dtype):
    rows, t, h, kvh = CASES[case]
    q, k, v, cache, meta = make_case(rows, t, h, kvh, jnp.dtype(dtype))
    out, new_cache = adapter_with_reference(q, k, v, cache, meta, scale=D**-0.5, window=window)
    check_against_gather(out, new_cache, q, k, v, cache, meta, window)


@pytest.mark.parametrize("case", ["continue_mqa", "continue_mha"])
def test_adapter_head_groupings(case):
    """One KV head for all query heads, and none shared; with a window longer than a page."""
    rows, t, h, kvh = CASES[case]
    q, k, v, cache, meta = make_case(rows, t, h, kvh, jnp.float32, seed=1)
    out, new_cache = adapter_with_reference(q, k, v, cache, meta, scale=D**-0.5, window=6)
    check_against_gather(out, new_cache, q, k, v, cache, meta, 6)


def test_padding_rows_anywhere_go_after_real_rows():
    """Real rows become the kernel's first sequences in their order (an empty sequence inside
    num_seqs would unbalance the kernel's prefetch), tokens packed in row order."""
    positions = jnp.array([[-1, -1, -1], [7, 8, -1], [-1, -1, -1], [0, 1, 2]], jnp.int32)
    table = jnp.array([[0, 0, 0], [5, 6, 7], [0, 0, 0], [9, 0, 0]], jnp.int32)
    meta = AttentionMetadata(positions, positions * 10, table, jnp.zeros((4,), jnp.int32))
    ragged, index = jax.jit(rows_as_ragged)(meta)
    cu_q_lens, kv_lens, num_seqs = jax.jit(kernel_sequences)(ragged)
    np.testing.assert_array_equal(index, [[12, 12, 12], [0, 1, 12], [12, 12, 12], [2, 3, 4]])
    np.testing.assert_array_equal(ragged.positions[:6], [7, 8, 0, 1, 2, -1])
    np.testing.assert_array_equal(ragged.slots[:5], [70, 80, 0, 10, 20])
    np.testing.assert_array_equal(num_seqs, [2])
    np.testing.assert_array_equal(cu_q_lens[:3], [0, 2, 5])
    np.testing.assert_array_equal(kv_lens[:2], [9, 3])
    np.testing.assert_array_equal(ragged.page_table[:2], [[5, 6, 7], [9, 0, 0]])
    np.testing.assert_array_equal(kv_lens[2:], [0, 0])


def test_all_padding_batch_runs_one_dummy_sequence():
    meta = AttentionMetadata(jnp.full((2, 3), -1, jnp.int32), jnp.zeros((2, 3), jnp.int32),
                             jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32))
    ragged, index = jax.jit(rows_as_ragged)(meta)
    cu_q_lens, kv_lens, num_seqs = jax.jit(kernel_sequences)(ragged)
    np.testing.assert_array_equal(num_seqs, [1])
    np.testing.assert_array_equal(cu_q_lens, [0, 1, 1])
    np.testing.assert_array_equal(kv_lens, [1, 0])
    out = jax.jit(from_ragged)(jnp.full((6, 2), jnp.nan), index)  # the dummy's output is dropped
    np.testing.assert_array_equal(out, np.zeros((2, 3, 2)))


def test_a_ragged_batch_goes_to_the_kernel_as_it_is():
    """The ragged step's layout (decode rows and chunks back to back, empty requests after them,
    padding tokens at the end) is the kernel's: cu_q_lens = query_start, kv_lens and the page
    table as given, and the outputs equal the pure-JAX path's."""
    rng = np.random.default_rng(7)
    kvh, h, num_pages = 2, 4, 20
    cache = jnp.asarray(rng.standard_normal((num_pages, PAGE, 2 * kvh, D), np.float32))
    table = rng.permutation(np.arange(1, num_pages)).astype(np.int32)[:16].reshape(4, 4)
    table[3] = 0  # an empty (padding) request
    segments = [(5, 1), (0, 6), (9, 4)]  # (first position, tokens): a decode row, a prefill, a continued chunk
    n = 16
    positions = np.full((n,), -1, np.int32)
    slots = np.zeros((n,), np.int32)
    query_start, at = [0], 0
    for r, (first, count) in enumerate(segments):
        positions[at:at + count] = np.arange(first, first + count)
        slots[at:at + count] = slots_for(table[r], positions[at:at + count], PAGE)
        at += count
        query_start.append(at)
    query_start.append(at)
    kv_lens = np.array([f + c for f, c in segments] + [0], np.int32)
    meta = RaggedMetadata(*map(jnp.asarray, (positions, slots, np.array(query_start, np.int32), table, kv_lens)))
    cu_q_lens, got_kv, num_seqs = kernel_sequences(meta)
    np.testing.assert_array_equal(cu_q_lens, query_start)
    np.testing.assert_array_equal(got_kv, kv_lens)
    np.testing.assert_array_equal(num_seqs, [3])
    q = jnp.asarray(rng.standard_normal((n, h, D), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((n, kvh, D), np.float32)) for _ in range(2))
    for window in (0, 3):
        out, new_cache = jax.jit(functools.partial(tpu_ragged_attention, scale=D**-0.5, window=window,
                                                   kernel=ragged_reference))(q, k, v, cache, meta)
        want, want_cache = jax.jit(functools.partial(ragged_gather_attention, scale=D**-0.5, window=window))(
            q, k, v, cache, meta)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
        assert not np.any(np.asarray(out)[positions < 0])
        np.testing.assert_array_equal(np.asarray(new_cache)[1:], np.asarray(want_cache)[1:])


def test_stand_in_matches_the_kernels_own_reference():
    """`ragged_reference` is the contract `ref_ragged_paged_attention` (shipped with the
    kernel) implements: checked on a ragged batch with a window."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((8, 4, D), np.float32))
    pages = jnp.asarray(rng.standard_normal((9, PAGE, 4, D), np.float32))
    # The reference loops over num_seqs in Python: the metadata stays numpy (static) so it jits.
    meta = (
        np.array([7, 3, 0], np.int32),  # kv lens: a cached context + chunk, a prefill
        np.array([[3, 1], [8, 0], [0, 0]], np.int32),
        np.array([0, 2, 5, 5], np.int32),
        np.array([2], np.int32),
    )
    want = jax.jit(lambda q, p: ref_ragged_paged_attention(q, p, *meta, sm_scale=0.3, sliding_window=2))(q, pages)
    got = jax.jit(lambda q, p: ragged_reference(q, p, *map(jnp.asarray, meta), sm_scale=0.3, sliding_window=2))(
        q, pages
    )
    np.testing.assert_allclose(got[:5], want, rtol=1e-5, atol=1e-5)
    assert np.isnan(np.asarray(got[5:])).all()


def test_gradients_are_the_gather_paths():
    rows, t, h, kvh = CASES["continue"]
    q, k, v, cache, meta = make_case(rows, t, h, kvh, jnp.float32, seed=3)

    def loss(attend, q, k, v):
        return attend(q, k, v, cache, meta, D**-0.5, 0)[0].sum()

    adapter = functools.partial(rows_through_adapter, kernel=ragged_reference)
    got = jax.jit(jax.grad(functools.partial(loss, adapter), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(functools.partial(loss, _gather_attention), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# -- the real kernel: shapes and lowering ---------------------------------------------------


@contextlib.contextmanager
def abstract_tpu(device_kind="TPU v5 lite"):
    """Trace and lower for a TPU on this CPU host (JAX's abstract-device mesh)."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        yield


def abstract_args(b, t, h, kvh, d, dtype, num_pages=9, pages_per_row=4, page_size=PAGE, ragged=False):
    """Shapes of a [B, T] step, or (``ragged``) of the same tokens as a ragged step of B requests."""
    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    if ragged:
        n = b * t
        meta = RaggedMetadata(s((n,), i32), s((n,), i32), s((b + 1,), i32), s((b, pages_per_row), i32), s((b,), i32))
        return s((n, h, d), dtype), s((n, kvh, d), dtype), s((n, kvh, d), dtype), s(
            (num_pages, page_size, 2 * kvh, d), dtype), meta
    meta = AttentionMetadata(s((b, t), i32), s((b, t), i32), s((b, pages_per_row), i32), s((b,), i32))
    return (
        s((b, t, h, d), dtype),
        s((b, t, kvh, d), dtype),
        s((b, t, kvh, d), dtype),
        s((num_pages, page_size, 2 * kvh, d), dtype),
        meta,
    )


@pytest.mark.parametrize(
    "h,kvh,d,dtype,fits",
    [
        (4, 2, 128, "float32", True),
        (8, 8, 128, "bfloat16", True),  # Llama 3 / Mistral heads
        (4, 1, 256, "bfloat16", True),  # Gemma 3 1B
        (12, 4, 128, "float32", True),
        (12, 4, 128, "bfloat16", True),
        (6, 3, 128, "bfloat16", False),  # 2*KVH = 6: 3 packed bfloat16 rows do not tile
        (9, 3, 64, "float32", False),  # SmolLM2: head_dim and KV heads
        (6, 3, 128, "float32", False),  # 2*KVH = 6 does not tile
        (4, 2, 64, "float32", False),  # head_dim below the 128 lanes
        (4, 2, 192, "float32", False),  # head_dim not a multiple of 128
        (24, 12, 128, "bfloat16", False),
        (32, 16, 128, "bfloat16", True),
    ],
)
def test_fits_is_exactly_what_the_kernel_takes(h, kvh, d, dtype, fits):
    """`tpu_kernel_fits` agrees with the kernel itself: the accepted shapes trace and lower
    to a TPU program, the rejected ones raise while tracing."""
    assert tpu_kernel_fits(h, kvh, d, PAGE, dtype) == fits
    f = jax.jit(functools.partial(tpu_ragged_attention, scale=0.1, window=0))
    args = abstract_args(2, 3, h, kvh, d, jnp.dtype(dtype), ragged=True)
    if fits:
        with abstract_tpu():
            assert "tpu_custom_call" in f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    else:
        with pytest.raises((AssertionError, ValueError)):
            f.trace(*args)


def test_fits_rejects_other_dtypes_and_bad_groupings():
    assert not tpu_kernel_fits(4, 2, 128, PAGE, jnp.float16)
    assert not tpu_kernel_fits(4, 2, 128, PAGE, jnp.int8)
    assert not tpu_kernel_fits(6, 4, 128, PAGE, jnp.float32)


@pytest.mark.parametrize(
    "b,t,h,kvh,dtype,window",
    [(4, 1, 4, 2, "bfloat16", 0), (3, 8, 8, 8, "bfloat16", 5), (2, 16, 4, 1, "float32", 0)],
)
def test_real_kernel_lowers_to_a_tpu_program(b, t, h, kvh, dtype, window):
    """The adapter with the real kernel traces and lowers to Mosaic (a tpu_custom_call)."""
    f = jax.jit(functools.partial(tpu_ragged_attention, scale=D**-0.5, window=window), donate_argnums=3)
    with abstract_tpu():
        text = f.trace(*abstract_args(b, t, h, kvh, D, jnp.dtype(dtype), ragged=True)).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_paged_attention_lowers_for_tpu_on_a_cpu_host_with_the_tpu_choice(dtype):
    """A `KernelChoice` for tpu, built on this CPU host, makes `paged_attention` stage the Pallas kernel
    (a Mosaic tpu_custom_call) where the shapes fit; the cuda choice stages the gather path."""
    from jaxinfer.ops import attention, backend
    from jaxinfer.ops.backend import KernelChoice

    def lowered(choice):
        def fn(q, k, v, cache, meta):
            with backend.using(choice):
                return attention.paged_attention(q, k, v, cache, meta, scale=D**-0.5)
        with abstract_tpu():
            return jax.jit(fn).trace(*abstract_args(4, 1, 4, 2, D, jnp.dtype(dtype))).lower(
                lowering_platforms=(choice.platform,)).as_text()

    assert "tpu_custom_call" in lowered(KernelChoice.for_platform("tpu"))
    assert "tpu_custom_call" not in lowered(KernelChoice.for_platform("cuda"))


def test_tpu_branch_traces_on_a_cpu_host_under_platform_dependent():
    """`lax.platform_dependent` traces every branch: the TPU one must trace off a TPU (the
    kernel's tuned-size lookup would raise there) and the CPU run takes the default."""
    rows, t, h, kvh = CASES["decode"]
    q, k, v, cache, meta = make_case(rows, t, h, kvh, jnp.float32, seed=4)
    scale = D**-0.5

    @jax.jit
    def step(q, k, v, cache, meta):
        return jax.lax.platform_dependent(
            q, k, v, cache, meta,
            tpu=functools.partial(rows_through_adapter, scale=scale, window=0),
            default=functools.partial(_gather_attention, scale=scale, window=0),
        )

    out, new_cache = step(q, k, v, cache, meta)
    check_against_gather(out, new_cache, q, k, v, cache, meta, 0)


# -- the real kernel in interpret mode ------------------------------------------------------


@functools.lru_cache(maxsize=None)
def interpreter_failure() -> str | None:
    """Why this JAX cannot interpret the kernel on CPU (the exception's last line), or None."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((4, 2, D), np.float32))
    pages = jnp.asarray(rng.standard_normal((3, PAGE, 2, D), np.float32))
    i32 = functools.partial(jnp.array, dtype=jnp.int32)
    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            out = ragged_paged_attention(
                q, pages, i32([5, 0]), i32([[1, 2], [0, 0]]), i32([0, 3, 3]), i32([1]),
                sm_scale=0.1, num_kv_pages_per_block=1, num_queries_per_block=2,
            )
            jax.block_until_ready(out)
    except Exception as e:  # noqa: BLE001 - any failure of the interpreter is the reason to skip
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return f"TPU interpret mode cannot run ragged_paged_attention on this JAX ({jax.__version__}): " + (
            lines[-1].strip() if lines else type(e).__name__
        )
    return None


@pytest.mark.parametrize(
    "case,window,dtype",
    [("decode", 0, "float32"), ("continue", 3, "float32"), ("prefill", 0, "bfloat16"), ("all_padding", 0, "float32")],
)
def test_interpreted_kernel_matches_gather_path(case, window, dtype):
    reason = interpreter_failure()
    if reason:
        pytest.skip(reason)
    rows, t, h, kvh = CASES[case]
    q, k, v, cache, meta = make_case(rows, t, h, kvh, jnp.dtype(dtype), seed=6)
    out, new_cache = rows_through_adapter(q, k, v, cache, meta, D**-0.5, window, interpret=True)
    check_against_gather(out, new_cache, q, k, v, cache, meta, window)


def test_interpret_flag_picks_explicit_block_sizes():
    """Off a TPU (interpret mode, or the TPU branch traced on a GPU host) the block sizes are
    explicit and fit the shapes: the kernel's tuned lookup raises anywhere but on a TPU."""
    kernel = pallas_tpu_kernel(page_size=16, pages_per_seq=3, num_tokens=5)
    assert kernel.keywords["num_kv_pages_per_block"] == 3 and kernel.keywords["num_queries_per_block"] == 5
    kernel = pallas_tpu_kernel(page_size=16, pages_per_seq=64, num_tokens=256)
    assert kernel.keywords["num_kv_pages_per_block"] == 8 and kernel.keywords["num_queries_per_block"] == 32
    assert callable(pallas_tpu_kernel(page_size=16, pages_per_seq=3, num_tokens=5, interpret=True))


@pytest.mark.parametrize("tpu_kind", ["TPU v6 lite", "TPU v5 lite", "TPU v4", "TPU7x"])  # kinds JAX's lookup reads
def test_block_sizes_come_from_the_choices_tpu_kind_as_the_kernels_own_lookup_gives_them(tpu_kind, monkeypatch):
    """`tpu_block_sizes` (from the kernel choice's ``tpu_kind``, never the devices) equals JAX's own
    lookup run on that TPU (its device reads pointed at a device of that kind), over shapes in and out
    of the tuned table; no TPU named: the explicit defaults."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned

    from jaxinfer.ops.attention_pallas import tpu_block_sizes

    class Device:
        device_kind = tpu_kind

    monkeypatch.setattr(tuned.jax, "devices", lambda *a, **k: [Device()])
    listed = [k for table in tuned.TUNED_BLOCK_SIZES.values() for k in list(table)[::97]]
    shapes = [(jnp.dtype(q).name, jnp.dtype(kv).name, h, kvh, d, ps, n, p) for q, kv, h, kvh, d, ps, n, p in listed]
    shapes += [("bfloat16", "bfloat16", 8, 1, 128, 16, 48, 40), ("float32", "float32", 4, 2, 128, 32, 512, 7)]
    for q, kv, heads, kv_heads, d, ps, n, pages in shapes:
        q_dt, kv_dt = jnp.dtype(q), jnp.dtype(kv)
        hb, cb = rpa.get_min_heads_per_blk(heads, 2 * kv_heads, q_dt, kv_dt)
        want = tuned.get_tuned_block_sizes(q_dt, kv_dt, hb, cb // 2, d, ps, n, pages)
        assert tpu_block_sizes(tpu_kind, q_dt, kv_dt, heads, kv_heads, d, ps, n, pages) == want
    assert tpu_block_sizes("", jnp.bfloat16, jnp.bfloat16, 8, 1, 128, 16, 48, 40) == (8, 32)
