"""The native CPU matmul kernel (`jaxinfer.ops.cpu_matmul`) against a float64 numpy reference,
and its one reduction order: a row's result is bitwise the same alone and among others.

Every weight form it takes (int8 per channel and in groups of 32, int8 with an offset, int4
with an offset in groups of 32 and 64, int4 without an offset, float32, bfloat16 and float16
[K, N] and transposed [N, K]), every row count of one decode tile (AVX-512 tiles are 16 rows,
AVX2 ones 12, scalar 8), the many-row (blocked, prefill) path past it, column counts that are
not a multiple of the vector width, under jit. The AVX2 and scalar builds of the same source
(compiled with AVX-512 or AVX2 turned off) are checked the same way, so a host with only
AVX2 runs tested code. The transposed int8 layout (``axis`` 1: q [N, K], scale
[N, K / group], GGUF's row blocks) is checked on all three builds over row counts, groups of
32, per row, and groups that are not a multiple of the vector width. Errors name what is
wrong; `fits` says no where the kernel must not be staged. Tolerances are relative to
sum |x| |w| (the accumulation order differs from numpy's); invariance is bitwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import backend, cpu_matmul, quant
from jaxinfer.env import cpu_flags
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.quant import QuantizedWeight

pytestmark = pytest.mark.skipif(not cpu_matmul.prepare(), reason="native CPU matmul kernel unavailable")

SCHEMES = ("int8", "int8-g32", "int8-off", "int4-g32", "int4-g64", "int4-sym", "f32", "f32T", "bf16", "bf16T",
           "f16", "f16T")
FLOATS = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
TOL = 2e-6
DECODE_TILE = 16  # the most rows one tile of the few-row path holds (AVX-512; AVX2 12, scalar 8)


def make_weight(rng, scheme: str, k: int, n: int):
    """(the weight as the kernel takes it, w_contract, its float64 [K, N] value)."""
    w = rng.standard_normal((k, n)).astype(np.float32)
    if scheme.rstrip("T") in FLOATS:  # float32 / bfloat16 / float16, [K, N] or (T) [N, K]
        wd = jnp.asarray(w, FLOATS[scheme.rstrip("T")])
        ref = np.asarray(wd.astype(jnp.float32), np.float64)
        return (wd.T.copy(), 1, ref) if scheme.endswith("T") else (wd, 0, ref)
    if scheme == "int4-sym":  # int4 without an offset: v = u - 8, groups of 32
        u = rng.integers(0, 16, (k, n))
        scale = (rng.random((k // 32, n)) * 0.1 + 0.01).astype(np.float16)
        qw = QuantizedWeight(quant.pack(u, 4), scale, None, 4, 32)
    elif scheme == "int8-off":  # the format allows an offset with int8 too (no scheme makes one)
        v = rng.integers(-128, 128, (k, n))
        scale = (rng.random((k // 64, n)) * 0.1 + 0.01).astype(np.float16)
        offset = rng.standard_normal((k // 64, n)).astype(np.float16)
        qw = QuantizedWeight(quant.pack(v, 8), scale, offset, 8, 64)
    else:
        qw = quant.quantize(w, quant.Scheme.parse(scheme))
    ref = quant.dequantize_host(qw).astype(np.float64)
    return jax.tree.map(jnp.asarray, qw), 0, ref


def as_multiplied(x, w, targets=None):
    """x as the kernel multiplies it by ``w``: rounded to bfloat16 where the build's path takes a bfloat16
    weight on the AMX tiles (`cpu_matmul.bf16_dot`), quantized per block of 32 where it takes a quantized
    weight by VNNI (`cpu_matmul.int8_dot`), else as it is (float32)."""
    simd = targets.get("isa", "") if targets else KernelChoice.loaded().simd
    if cpu_matmul.bf16_dot(w, simd):
        return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    if cpu_matmul.int8_dot(w, simd):
        return np.asarray(cpu_matmul.quantize_x(jnp.asarray(x)))
    return x


def check(y, x, ref, tol=TOL):
    x = np.asarray(x, np.float64)
    bound = np.abs(x) @ np.abs(ref)
    err = np.abs(np.asarray(y, np.float64) - x @ ref)
    assert y.shape == (x.shape[0], ref.shape[1]) and y.dtype == np.float32
    assert np.all(err <= tol * bound + 1e-30), float(np.max(err / (bound + 1e-30)))


def axis1_weight(q, scale, offset, bits, group):
    """A weight stored [N, K] with groups along K (QuantizedWeight.axis 1, the quantized LM head's layout)."""
    return QuantizedWeight(q, scale, offset, bits, group, axis=1)


def make_transposed(rng, k: int, n: int, group: int):
    """An int8 [N, K] weight in groups of ``group`` along K, and its float64 [K, N] value."""
    q = rng.integers(-128, 128, (n, k), dtype=np.int8)
    scale = (rng.random((n, k // group)) * 0.1 + 0.01).astype(np.float16)
    ref = (q.astype(np.float64).reshape(n, k // group, group) * scale.astype(np.float64)[:, :, None]).reshape(n, k)
    return axis1_weight(jnp.asarray(q), jnp.asarray(scale), None, 8, group), ref.T


# (K, N, group): groups of 32 and per row (0: K), N not a multiple of the vector width or of the
# tile's weight rows, K not a multiple of the vector width (72, per row), groups of 8 and 24
# (not a multiple of AVX-512's 16 lanes: the scalar loop there), wide enough to share (1000).
T_CASES = ((64, 100, 32), (64, 49, 0), (576, 49, 32), (576, 100, 0), (72, 37, 0), (64, 50, 8), (576, 29, 24),
           (96, 37, 0), (96, 50, 32))  # K = 96: half a 64-byte chunk at the end on the VNNI path


@functools.lru_cache(maxsize=None)
def transposed_cases():
    rng = np.random.default_rng(7)
    return {c: make_transposed(rng, c[0], c[1], c[2] or c[0]) for c in T_CASES}


def run_transposed(rows_list, targets=None, cases_=None) -> None:
    ws = cases_ or transposed_cases()
    for rows in rows_list:
        rng = np.random.default_rng(100 + rows)
        xs = {k: jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32)) for k, _, _ in ws}
        f = jax.jit(lambda xs, weights: {c: cpu_matmul.matmul(xs[c[0]], w, 1, targets=targets)
                                         for c, w in weights.items()})
        out = f(xs, {c: v[0] for c, v in ws.items()})
        for c, y in out.items():
            check(np.asarray(y), as_multiplied(xs[c[0]], ws[c][0], targets), ws[c][1])


T_ROWS = (*range(1, 17), 17, 33, 48, 64)


def test_transposed_int8():
    run_transposed(T_ROWS)
    rng = np.random.default_rng(8)
    run_transposed((1, 3), cases_={(576, 1000, 32): make_transposed(rng, 576, 1000, 32),
                                   (1536, 200, 0): make_transposed(rng, 1536, 200, 1536)})


def test_transposed_int8_matches_xla_and_jvp():
    w, ref = transposed_cases()[(64, 100, 32)]
    x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32))
    check(np.asarray(cpu_matmul.xla_matmul(x, w, 1)), x, ref)
    loss = lambda fn: jax.grad(lambda x: jnp.sum(jnp.sin(fn(x, w, 1))))(x)  # noqa: E731
    np.testing.assert_allclose(loss(cpu_matmul.matmul), loss(cpu_matmul.xla_matmul), rtol=1e-4, atol=1e-5)


@functools.lru_cache(maxsize=None)
def cases(k: int, n: int):
    rng = np.random.default_rng(k * 1000 + n)
    return {s: make_weight(rng, s, k, n) for s in SCHEMES}


def run_all(rows: int, shapes, targets=None) -> None:
    """One jitted program with every scheme and shape at ``rows`` rows, checked."""
    ws = {(s, k, n): cases(k, n)[s] for k, n in shapes for s in SCHEMES}
    rng = np.random.default_rng(rows)
    xs = {k: jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32)) for k, _ in shapes}

    @jax.jit
    def f(xs, weights):
        return {key: cpu_matmul.matmul(xs[key[1]], w, ws[key][1], targets=targets) for key, w in weights.items()}

    out = f(xs, {key: v[0] for key, v in ws.items()})
    for key, y in out.items():
        check(np.asarray(y), as_multiplied(xs[key[1]], ws[key][0], targets), ws[key][2])


SHAPES = ((64, 100), (576, 49))


# Every decode tile size (AVX-512 tiles are 16 rows, AVX2 12), then the blocked path's row
# tiles (6 rows; 4 scalar) and their remainders, up to prefill's sizes.
ROWS = sorted({*range(1, 18), 24, 31, 33, 47, 48, 49, 100, 130})


@pytest.mark.parametrize("rows", ROWS)
def test_every_scheme_and_row_count(rows):
    shapes = SHAPES if rows in (1, 2, 5, 16, 48, 130) else SHAPES[:1]
    run_all(rows, shapes)


def test_wide_and_threaded():
    """Shapes large enough to be shared with the pool threads, several bands and a tail."""
    run_all(3, ((576, 1000),))
    run_all(1, ((1536, 200),))
    run_all(70, ((576, 1000),))


# ---------------------------------------------------------------------------
# one reduction order: bitwise the same alone and among others

PROBES = 5  # rows whose results are compared alone (M = 1) and inside every batch
INV_ROWS = (*range(1, 49), 49, 64, 100, 128, 300)  # decode's tiles, past them, prefill's sizes


@functools.lru_cache(maxsize=None)
def invariance_forms() -> dict:
    """Every weight form: {(name, K, N): (weight, w_contract, float64 [K, N] value)}. N = 100
    and 37 leave columns past the last whole vector; K = 68 (float forms) leaves a contraction
    tail on the transposed layout; int8 [N, K] in groups of 32 and per row."""
    forms = {(s, 64, 100): cases(64, 100)[s] for s in SCHEMES}
    rng = np.random.default_rng(12)
    for s in ("f32", "bf16", "f16", "f32T", "bf16T", "f16T"):
        forms[(s, 68, 37)] = make_weight(rng, s, 68, 37)
    for (k, n, g) in ((64, 100, 32), (72, 37, 0), (96, 37, 0)):
        w, ref = transposed_cases()[(k, n, g)]
        forms[(f"int8T-g{g}", k, n)] = (w, 1, ref)
    return forms


def check_invariance(rows_list, targets=None, share=None) -> None:
    """For each M in ``rows_list``: PROBES rows at random positions among random others give,
    for every weight form, bitwise the result each gives alone; and every row is within the
    float64 reference's tolerance."""
    forms = invariance_forms()
    wcs = {key: v[1] for key, v in forms.items()}
    weights = {key: v[0] for key, v in forms.items()}
    ks = sorted({key[1] for key in forms})
    rng = np.random.default_rng(11)
    probes = {k: rng.standard_normal((PROBES, k)).astype(np.float32) for k in ks}

    @jax.jit
    def f(xs, weights):
        return {key: cpu_matmul.matmul(xs[key[1]], w, wcs[key], targets=targets, share=share)
                for key, w in weights.items()}

    alone = [f({k: jnp.asarray(probes[k][j:j + 1]) for k in ks}, weights) for j in range(PROBES)]
    for m in rows_list:
        pos = rng.choice(m, size=min(PROBES, m), replace=False)
        xs = {k: rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 10) for k in ks}
        for k in ks:
            xs[k][pos] = probes[k][:len(pos)]
        out = f({k: jnp.asarray(v) for k, v in xs.items()}, weights)
        for key, y in out.items():
            y = np.asarray(y)
            for j, r in enumerate(pos):
                got, want = y[r], np.asarray(alone[j][key])[0]
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
                    f"{key}: row {r} of {m} differs from the row alone at columns "
                    f"{np.flatnonzero(got != want)[:8]}")
            check(y, as_multiplied(xs[key[1]], forms[key][0], targets), forms[key][2])


def test_rows_bitwise_the_same_alone_and_among_others():
    """Every form, M = 1..48 (every decode tile), 49 and prefill's 64, 100, 128, 300 (the
    blocked path): the probe rows' bits never change."""
    check_invariance(INV_ROWS)


def test_thread_split_does_not_change_bits():
    """One thread against the shared pool (other bands per thread), few and many rows."""
    shapes = ((576, 1000),)
    ws = {(s, k, n): cases(k, n)[s] for k, n in shapes for s in SCHEMES}
    rng = np.random.default_rng(5)
    for m in (3, 100):
        x = jnp.asarray(rng.standard_normal((m, 576)).astype(np.float32))

        @functools.partial(jax.jit, static_argnums=1)
        def f(weights, share):
            return {key: cpu_matmul.matmul(x, w, ws[key][1], share=share) for key, w in weights.items()}

        weights = {key: v[0] for key, v in ws.items()}
        one, pool = f(weights, False), f(weights, True)
        for key in ws:
            assert np.array_equal(np.asarray(one[key]), np.asarray(pool[key])), (key, m)


def test_eager_and_x_dtype():
    w, _, ref = cases(64, 100)["int4-g32"]
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    check(np.asarray(cpu_matmul.matmul(jnp.asarray(x), w)), as_multiplied(x, w), ref)
    y = cpu_matmul.matmul(jnp.asarray(x, jnp.bfloat16), w)  # x is taken as float32
    check(np.asarray(y), as_multiplied(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)), w), ref)


def test_jvp_matches_xla():
    w, wc, _ = cases(64, 100)["int8-g32"]
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32))
    loss = lambda fn: jax.grad(lambda x: jnp.sum(jnp.sin(fn(x, w, wc))))(x)  # noqa: E731
    np.testing.assert_allclose(loss(cpu_matmul.matmul), loss(cpu_matmul.xla_matmul), rtol=1e-4, atol=1e-5)


def _variant(flags, isa, required):
    if not required <= cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(required - cpu_flags())}")
    try:
        targets, got = cpu_matmul.load_variant(flags)
    except RuntimeError as e:
        pytest.skip(f"cannot build the variant: {e}")
    assert got == isa
    return targets


NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
NO_DOTS = [*NO_AMX, "-mno-avx512vnni"]  # AVX-512 without the dot instructions: float products only


@pytest.mark.parametrize("name", ["avx512", "avx2", "scalar"])
def test_other_builds(name):
    """The AVX-512 path without AMX or VNNI (bfloat16 weights widened, quantized ones too, x in float32:
    AVX-512 CPUs without them, and ``JAXINFER_CPU_AMX=0 JAXINFER_CPU_VNNI=0``), the AVX2 path (8 lanes, 12-row decode tiles) and the scalar fallback
    (8-row tiles): against the reference, and the same row bits alone and among others across their tiles."""
    if name == "avx512":
        if not backend.simd_features(KernelChoice.loaded().simd):
            pytest.skip("no AMX or VNNI path here: the default build is the plain AVX-512 (or narrower) one the "
                        "tests above run")
        targets = _variant(["-O3", "-march=native", *NO_DOTS, "-fopenmp-simd"], "avx512", {"avx512f"})
        for m in (1, 5, 16, 17, 130):
            run_all(m, SHAPES, targets=targets)
        check_invariance((1, 2, 16, 17, 48, 100), targets=targets)
        x = jnp.ones((2, 64), jnp.float32)
        with pytest.raises(Exception, match="bf16_dot asks for AMX bfloat16 products"):
            jax.block_until_ready(jax.ffi.ffi_call(targets["float"], jax.ShapeDtypeStruct((2, 8), jnp.float32))(
                x, jnp.ones((64, 8), jnp.bfloat16), w_contract=np.int64(0), share=True, bf16_dot=True))
        with pytest.raises(Exception, match="int8_dot asks for VNNI integer products"):
            jax.block_until_ready(jax.ffi.ffi_call(targets["q"], jax.ShapeDtypeStruct((2, 8), jnp.float32))(
                x, jnp.ones((64, 8), jnp.int8), jnp.ones((2, 8), jnp.float16), jnp.zeros((0, 8), jnp.float16),
                bits=np.int64(8), group=np.int64(32), w_contract=np.int64(0), share=True, int8_dot=True))
        return
    if name == "avx2":
        if "avx512f" not in cpu_flags():
            pytest.skip("no AVX-512 here: the default build is this AVX2 build, which every test above runs")
        targets = _variant(["-O3", "-march=native", "-mno-avx512f", *NO_DOTS, "-fopenmp-simd"], "avx2",
                           {"avx2", "fma", "f16c"})
        rows = (1, 5, 12, 13, 25, 48, 130)
        inv = (1, 2, 7, 12, 13, 19, 48, 64, 128)
    else:
        targets = _variant(["-O2", "-march=native", "-mno-avx512f", "-mno-avx2", "-mno-fma", *NO_DOTS], "scalar",
                           set())
        rows = (1, 9, 48, 130)
        inv = (1, 3, 8, 9, 13, 48, 100)
    for m in rows:
        run_all(m, SHAPES, targets=targets)
    run_transposed(T_ROWS if name == "avx2" else (1, 2, 3, 5, 9, 48, 70), targets=targets)
    check_invariance(inv, targets=targets)


def _raises(match, fn):
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(fn())


def test_errors_name_the_problem():
    f32 = jnp.float32
    x = jnp.ones((2, 64), f32)
    call = lambda target, shape, *args, **attrs: jax.ffi.ffi_call(  # noqa: E731
        target, jax.ShapeDtypeStruct(shape, f32))(*args, **attrs)
    share = dict(share=True)
    fshare = dict(share=True, bf16_dot=False)  # the float target's attributes
    _raises(r"INVALID_ARGUMENT.*do not agree on the contraction",
            lambda: call(cpu_matmul.TARGET_FLOAT, (2, 8), x, jnp.ones((63, 8), f32), w_contract=np.int64(0), **fshare))
    _raises(r"w_contract must be 0 or 1",
            lambda: call(cpu_matmul.TARGET_FLOAT, (2, 8), x, jnp.ones((64, 8), f32), w_contract=np.int64(2), **fshare))
    _raises(r"w must be float32, bfloat16 or float16, got int8",
            lambda: call(cpu_matmul.TARGET_FLOAT, (2, 8), x, jnp.ones((64, 8), jnp.int8), w_contract=np.int64(0),
                         **fshare))
    _raises(r"x \[2, 64\] and w \[8, 60\] do not agree",
            lambda: call(cpu_matmul.TARGET_FLOAT, (2, 8), x, jnp.ones((8, 60), jnp.bfloat16), w_contract=np.int64(1),
                         **fshare))
    q8, s = jnp.ones((64, 8), jnp.int8), jnp.ones((2, 8), jnp.float16)
    none = jnp.zeros((0, 8), jnp.float16)
    def qattrs(bits, group, wc=0, int8_dot=False):
        return dict(bits=np.int64(bits), group=np.int64(group), w_contract=np.int64(wc), int8_dot=int8_dot, **share)
    _raises(r"scale \[3, 8\] should be \[2, 8\]",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, q8, jnp.ones((3, 8), jnp.float16), none, **qattrs(8, 32)))
    _raises(r"group 48 must be positive, divide K = 64",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, q8, s, none, **qattrs(8, 48)))
    _raises(r"q must be uint8",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, q8, s, none, **qattrs(4, 32)))
    _raises(r"x \[2, 64\] and q \[64, 8\] do not agree",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, jnp.ones((64, 8), jnp.uint8), s, none, **qattrs(4, 32)))
    _raises(r"offset \[1, 8\] should be \[2, 8\]",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, q8, s, jnp.ones((1, 8), jnp.float16), **qattrs(8, 32)))
    _raises(r"y \[2, 9\] should be \[2, 8\]",
            lambda: call(cpu_matmul.TARGET_Q, (2, 9), x, q8, s, none, **qattrs(8, 32)))
    # the transposed int8 layout: q [N, K], scale [N, K / group], no offset
    qt, st = jnp.ones((8, 64), jnp.int8), jnp.ones((8, 2), jnp.float16)
    _raises(r"x \[2, 64\] and q \[8, 63\] do not agree.*\[N, K\]",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, jnp.ones((8, 63), jnp.int8), st, none, **qattrs(8, 32, 1)))
    _raises(r"scale \[2, 8\] should be \[8, 2\] \(N, K / group\)",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, qt, s, none, **qattrs(8, 32, 1)))
    _raises(r"takes no offset",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, qt, st, jnp.ones((8, 2), jnp.float16), **qattrs(8, 32, 1)))
    _raises(r"int8 q \(bits 8\) only",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, jnp.ones((8, 32), jnp.uint8), st, none, **qattrs(4, 32, 1)))
    _raises(r"y \[2, 9\] should be \[2, 8\]",
            lambda: call(cpu_matmul.TARGET_Q, (2, 9), x, qt, st, none, **qattrs(8, 32, 1)))
    _raises(r"w_contract must be 0 or 1",
            lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, qt, st, none, **qattrs(8, 32, 2)))
    if cpu_matmul.isa() and "vnni" in backend.simd_features(cpu_matmul.isa()):  # the VNNI path's own limits
        _raises(r"int8_dot takes groups of a multiple of 32 contraction rows, got group 16",
                lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, q8, jnp.ones((4, 8), jnp.float16), none,
                             **qattrs(8, 16, int8_dot=True)))
        _raises(r"int8_dot takes groups of a multiple of 32 contraction rows, got group 16",
                lambda: call(cpu_matmul.TARGET_Q, (2, 8), x, qt, jnp.ones((8, 4), jnp.float16), none,
                             **qattrs(8, 16, 1, int8_dot=True)))
    # through matmul: a weight whose K does not match x
    wt, _ = transposed_cases()[(64, 100, 32)]
    _raises(r"do not agree on the contraction", lambda: cpu_matmul.matmul(jnp.ones((2, 576), f32), wt, 1))


def test_fits(monkeypatch):
    qw = cases(64, 100)["int4-g32"][0]
    f = jnp.ones((64, 100), jnp.float32)
    assert cpu_matmul.fits(1, qw) and cpu_matmul.fits(48, qw) and cpu_matmul.fits(4096, qw)  # any rows
    assert cpu_matmul.fits(1, f) and cpu_matmul.fits(1, f, 1) and cpu_matmul.fits(4096, f)
    assert not cpu_matmul.fits(0, qw) and not cpu_matmul.fits(0, f)
    assert not cpu_matmul.fits(1, qw, 1)  # quantized weights contract over their rows only
    for dt in (jnp.bfloat16, jnp.float16):
        assert cpu_matmul.fits(1, f.astype(dt)) and cpu_matmul.fits(1, f.astype(dt), 1)
        assert cpu_matmul.fits(512, f.astype(dt))
    assert not cpu_matmul.fits(1, f.astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.int32))
    assert not cpu_matmul.fits(1, jnp.ones((2, 64, 100), jnp.float32))
    odd = QuantizedWeight(qw.q, qw.scale, qw.offset, 4, 48)  # a group that does not divide K
    assert not cpu_matmul.fits(1, odd)
    # axis 1 ([N, K]): int8 without an offset, contracted over axis 1 only
    wt, _ = transposed_cases()[(64, 100, 32)]
    assert cpu_matmul.fits(1, wt, 1) and cpu_matmul.fits(300, wt, 1)
    assert cpu_matmul.fits(1, transposed_cases()[(64, 49, 0)][0], 1)
    assert not cpu_matmul.fits(1, wt, 0)
    assert not cpu_matmul.fits(1, axis1_weight(wt.q, wt.scale, wt.scale, 8, 32), 1)  # an offset
    assert not cpu_matmul.fits(1, axis1_weight(jnp.ones((100, 32), jnp.uint8), wt.scale, None, 4, 32), 1)  # int4
    assert not cpu_matmul.fits(1, axis1_weight(wt.q, wt.scale, None, 8, 48), 1)  # 48 does not divide 64
    monkeypatch.setenv("JAXINFER_CPU_KERNELS", "0")
    assert not cpu_matmul.fits(1, qw) and not cpu_matmul.prepare()  # the host's choice has no kernel now


def test_fits_follows_the_kernel_choice():
    """`fits` reads the choice it is given (in a step: the step's), not which kernels are loaded: with the
    kernel loaded, a choice without it says no, and a choice for another platform says no."""
    f = jnp.ones((64, 100), jnp.float32)
    assert cpu_matmul.fits(1, f, 0, KernelChoice.for_platform("cpu"))
    assert not cpu_matmul.fits(1, f, 0, KernelChoice.for_platform("cpu", native_cpu_kernels=False))
    for platform in ("tpu", "cuda"):
        assert not cpu_matmul.fits(1, f, 0, KernelChoice.for_platform(platform))
    assert KernelChoice.loaded().cpu_matmul and KernelChoice.loaded().simd == cpu_matmul.isa()
