"""The native CPU attention kernel against the pure-JAX gather path, on the same inputs.

Both paths write the chunk's keys/values and attend over the pages; the kernel reads the
pages in place. Random chunks cover decode (T = 1), prefill from position 0, chunks that
continue a cached context, padding rows and padding tokens, grouped-query ratios, head
sizes with and without a specialised loop, page sizes below and above the kernel's key
block, float32 and bfloat16 caches, and sliding windows (shorter than a page, one
position, longer than a page) next to full causal attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import attention, backend, kernels
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.kv_cache import slots_for

pytestmark = pytest.mark.skipif(
    not attention.prepare_cpu_kernel(), reason="native CPU kernel unavailable"
)


def make_case(rng, b, t, h, kvh, d, page_size, cache_dtype):
    max_ctx = 3 * t + 40
    pages_per_row = -(-max_ctx // page_size)
    num_pages = 1 + b * pages_per_row
    cache = jnp.asarray(rng.standard_normal((num_pages, page_size, 2 * kvh, d), np.float32)).astype(cache_dtype)
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    table = perm.reshape(b, pages_per_row)
    positions = np.full((b, t), -1, np.int32)
    for i in range(b):
        if i == b - 1 and b > 1:
            continue  # a padding row
        n = int(rng.integers(1, t + 1))  # tokens in this row's chunk (the rest are padding)
        start = int(rng.integers(0, max_ctx - n + 1)) if rng.random() < 0.7 else 0
        positions[i, :n] = np.arange(start, start + n)
    slots = np.where(positions >= 0, slots_for(table, np.maximum(positions, 0), page_size), 0).astype(np.int32)
    kv_lens = (positions.max(axis=1) + 1).astype(np.int32)
    meta = AttentionMetadata(jnp.asarray(positions), jnp.asarray(slots), jnp.asarray(table), jnp.asarray(kv_lens))
    q = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
    k = jnp.asarray(rng.standard_normal((b, t, kvh, d), np.float32))
    v = jnp.asarray(rng.standard_normal((b, t, kvh, d), np.float32))
    return q, k, v, cache, meta, positions


CASES = [
    # b, t, h, kvh, d, page_size, cache dtype
    (5, 1, 9, 3, 64, 16, "float32"),  # SmolLM2's decode
    (4, 128, 9, 3, 64, 16, "float32"),  # SmolLM2's prefill chunk
    (3, 37, 4, 1, 32, 4, "float32"),  # pages smaller than a key block
    (3, 20, 8, 8, 128, 32, "float32"),  # no grouping, pages larger than a key block
    (2, 9, 32, 2, 16, 8, "float32"),  # 16 query heads per kv head: a tile is one token
    (3, 21, 8, 4, 256, 16, "bfloat16"),  # Gemma 3's head_dim
    (4, 1, 8, 4, 256, 16, "float32"),
    (4, 1, 6, 2, 64, 16, "bfloat16"),
    (3, 50, 6, 2, 64, 16, "bfloat16"),
]


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("b,t,h,kvh,d,page_size,cache_dtype", CASES)
def test_kernel_matches_gather_path(b, t, h, kvh, d, page_size, cache_dtype, window):
    check_kernel_against_gather(b, t, h, kvh, d, page_size, cache_dtype, window)


@pytest.mark.parametrize("window", [1, 20])
def test_kernel_sliding_window_edges(window):
    check_kernel_against_gather(3, 37, 4, 1, 32, 16, "float32", window)
    check_kernel_against_gather(4, 1, 4, 2, 32, 16, "float32", window)


def rows_on_kernel(q, k, v, cache, meta, scale, window, call=None):
    """[B, T] rows through the kernel, as `paged_attention` feeds it: B requests of T tokens."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    call = call or (lambda *a: attention._cpu_attention(*a, scale, window))
    out, cache = call(q.reshape(b * t, h, d), k.reshape(b * t, kvh, d), v.reshape(b * t, kvh, d), cache,
                      meta.ragged())
    return out.reshape(b, t, h, d), cache


def check_kernel_against_gather(b, t, h, kvh, d, page_size, cache_dtype, window):
    rng = np.random.default_rng(b * 1000 + t)
    q, k, v, cache, meta, positions = make_case(rng, b, t, h, kvh, d, page_size, jnp.dtype(cache_dtype))
    scale = d**-0.5
    out_k, cache_k = jax.jit(lambda *a: rows_on_kernel(*a, scale, window))(q, k, v, cache, meta)
    out_r, cache_r = jax.jit(lambda *a: attention.gather_attention(*a, scale=scale, window=window))(
        q, k, v, cache, meta)
    # page 0 is the dummy page the pure-JAX path sends padding tokens to; the kernel skips them
    assert np.array_equal(np.asarray(cache_k)[1:], np.asarray(cache_r)[1:]), "the caches differ after the write"
    real = positions >= 0
    np.testing.assert_allclose(np.asarray(out_k)[real], np.asarray(out_r)[real], rtol=2e-5, atol=2e-5)
    assert not np.any(np.asarray(out_k)[~real]), "padding tokens must come out as zeros"


def test_paged_attention_uses_the_kernel_the_choice_names():
    """The host's choice (the kernel is loaded) takes it; an explicit choice without it, on the same host
    with the kernel loaded, does not: the trace follows the choice, not the process."""
    rng = np.random.default_rng(0)
    q, k, v, cache, meta, _ = make_case(rng, 2, 1, 4, 2, 64, 16, jnp.float32)

    def hlo(choice=None):
        def fn(*a):
            if choice is None:
                return attention.paged_attention(*a, scale=0.125)
            with backend.using(choice):
                return attention.paged_attention(*a, scale=0.125)
        return jax.jit(fn).lower(q, k, v, cache, meta).as_text()

    assert attention.CPU_TARGET in hlo()
    assert attention.CPU_TARGET in hlo(KernelChoice.for_platform("cpu"))
    assert attention.CPU_TARGET not in hlo(KernelChoice.for_platform("cpu", native_cpu_kernels=False))
    assert attention.CPU_TARGET not in hlo(KernelChoice.pure_jax("cpu"))


def test_position_past_the_page_table_is_an_error():
    rng = np.random.default_rng(1)
    q, k, v, cache, meta, _ = make_case(rng, 2, 1, 4, 2, 64, 16, jnp.float32)
    capacity = meta.page_table.shape[1] * cache.shape[1]
    bad = AttentionMetadata(jnp.full_like(meta.positions, capacity), meta.slots, meta.page_table, meta.kv_lens)
    with pytest.raises(Exception, match="past the pages given"):
        jax.block_until_ready(jax.jit(lambda *a: rows_on_kernel(*a, 0.125, 0))(q, k, v, cache, bad))


FALLBACK_PROBE = """
import warnings, jax, jax.numpy as jnp, numpy as np
warnings.simplefilter("error")  # disabling is not a failure: no warning either
from jaxinfer.ops import attention
from jaxinfer.ops.attention import AttentionMetadata
q = jnp.zeros((1, 1, 4, 64)); k = jnp.zeros((1, 1, 2, 64)); cache = jnp.zeros((4, 16, 4, 64))
meta = AttentionMetadata(np.zeros((1, 1), np.int32), np.full((1, 1), 16, np.int32), np.ones((1, 1), np.int32),
                         np.ones((1,), np.int32))
hlo = jax.jit(lambda *a: attention.paged_attention(*a, scale=0.125)).lower(q, k, k, cache, meta).as_text()
print(attention.CPU_TARGET in hlo)
"""


def test_disabled_kernels_take_the_pure_jax_path():
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAXINFER_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", FALLBACK_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_kernel_build_is_cached_per_source_and_machine(monkeypatch):
    installed = kernels.installed("paged_attention_cpu.cc")  # the install-time build, when it fits
    assert installed is None or kernels.build("paged_attention_cpu.cc") == installed
    monkeypatch.setenv("JAXINFER_INSTALLED_KERNELS", "0")  # the runtime build: compiled once, then cached
    path = kernels.build("paged_attention_cpu.cc")
    assert path.startswith(kernels.cache_dir()) and path.endswith(".so")
    assert kernels.build("paged_attention_cpu.cc") == path  # the second call finds the built library
    scalar = kernels.build("paged_attention_cpu.cc", ["-O2", "-march=native", "-mno-avx512f", "-mno-avx2"])
    assert scalar != path and kernels.build("paged_attention_cpu.cc", ["-O2", "-march=native", "-mno-avx512f",
                                                                          "-mno-avx2"]) == scalar


@pytest.mark.parametrize("name,flags", [
    ("scalar", ["-O2", "-march=native", "-mno-avx512f", "-mno-avx2", "-mno-fma"]),
    ("avx2", ["-O3", "-march=native", "-mno-avx512f", "-fopenmp-simd"]),
])
def test_other_builds_match_the_gather_path(name, flags):
    """The same source built for another SIMD level (through `kernels.load_variant`) computes the same."""
    from jaxinfer.env import cpu_flags

    if name == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if name == "avx2" and "avx512f" not in cpu_flags():
        pytest.skip("no AVX-512 here: the default build is this AVX2 build, which every test above runs")
    _, names = kernels.load_variant(kernels.PAGED_ATTENTION, flags)
    rng = np.random.default_rng(5)
    q, k, v, cache, meta, positions = make_case(rng, 3, 8, 8, 2, 64, 16, jnp.float32)

    variant = attention.cpu_kernel_call(names[attention.CPU_TARGET])
    out_k, cache_k = jax.jit(lambda *a: rows_on_kernel(*a, 0.125, 0, lambda *r: variant(*r, 0.125, 0)))(
        q, k, v, cache, meta)
    out_r, cache_r = jax.jit(lambda *a: attention.gather_attention(*a, scale=0.125))(q, k, v, cache, meta)
    assert np.array_equal(np.asarray(cache_k)[1:], np.asarray(cache_r)[1:])
    real = positions >= 0
    np.testing.assert_allclose(np.asarray(out_k)[real], np.asarray(out_r)[real], rtol=2e-5, atol=2e-5)
