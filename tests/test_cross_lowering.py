"""Accelerator programs checked without an accelerator (`jaxinfer.tools.lowering`): the step lowered for cuda
and tpu on this CPU host holds to what must be true there, and each check catches a program that breaks it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine import step
from jaxinfer.ops import backend, kv_cache, quant
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.tools import lowering

# head_dim 128 and one KV head: the shapes the Pallas TPU kernel takes (float32 and bfloat16 caches);
# hidden 128 so int4's groups of 32 divide every contraction.
MODEL = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=128, max_position_embeddings=512, name="lowering-128")
# 173 pages: no step tensor (batch x pages attended) has a cache layer's size by chance
ENGINE = EngineConfig(page_size=16, num_pages=173, max_num_seqs=4, batch_buckets=(1, 2, 4), chunk_buckets=(16,),
                      page_buckets=(2, 4), max_logprobs=4, name="lowering")
WEIGHTS = {  # name -> (engine dtype, quantization)
    "float32": ("float32", None), "bfloat16": ("bfloat16", None), "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
}
KINDS = ("step", "decode")  # the engine's ragged step (chunks and decode rows); the library's [B, 1] decode


@functools.lru_cache(maxsize=None)
def program(platform: str, weights: str, kind: str, precision: str = "default") -> lowering.StepProgram:
    dtype, q = WEIGHTS[weights]
    cfg = MODEL if q is None else MODEL.__class__(**{**MODEL.__dict__, "quant": quant.default_scheme(q)})
    return lowering.lower_step(cfg, ENGINE.replace(dtype=dtype, matmul_precision=precision), platform, kind,
                               batch=2, tokens=16, pages=4)


every_program = pytest.mark.parametrize("platform,weights,kind", [
    (p, w, k) for p in lowering.PLATFORMS for w in WEIGHTS for k in KINDS])


# -- the KV cache: read through the pages attended, written at the new tokens' slots ----------------------


@every_program
def test_no_op_the_size_of_the_whole_cache(platform, weights, kind):
    prog = program(platform, weights, kind)
    assert lowering.full_cache_ops(prog.text, prog.cache_shape) == []
    assert lowering.undonated_cache_args(prog.text, prog.cache_shape) == []
    # the only values of that size are the in-place updates at the slots (one per layer at least)
    writes = [op for op in lowering.parse(prog.text).ops if op.name in lowering.IN_PLACE
              and any(t is not None and t.shape == prog.cache_shape for t in op.result_types)]
    assert len(writes) >= 1


CACHE = (173, 16, 2, 128)


def _lower(fn, *args, platform="cuda", donate=(0,)):
    return jax.jit(fn, donate_argnums=donate).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _cache(dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(CACHE, dtype)


SLOTS = jax.ShapeDtypeStruct((4,), jnp.int32)
NEW = jax.ShapeDtypeStruct((4, 2, 128), jnp.bfloat16)
TABLE = jax.ShapeDtypeStruct((2, 4), jnp.int32)


def _write(cache, new, slots):
    return cache.at[slots // CACHE[1], slots % CACHE[1]].set(new)


def test_the_full_cache_check_passes_a_write_at_the_slots_and_a_page_gather():
    def good(cache, new, slots, table):
        pages = cache[table]  # [2, 4, 16, 2, 128]: the pages attended
        return _write(cache, new, slots), pages.astype(jnp.float32).sum()

    text = _lower(good, _cache(), NEW, SLOTS, TABLE)
    assert lowering.full_cache_ops(text, CACHE) == [] and lowering.undonated_cache_args(text, CACHE) == []


@pytest.mark.parametrize("bad,op", [
    (lambda cache, new, slots, table: (_write(cache.astype(jnp.float32), new, slots).astype(cache.dtype), 0.0),
     "stablehlo.convert"),  # a bfloat16 cache widened whole (what XLA:CPU does to gathers of one)
    (lambda cache, new, slots, table: (cache, cache.astype(jnp.float32)[table].sum()), "stablehlo.convert"),
    (lambda cache, new, slots, table: (cache.reshape(-1, 2, 128).at[slots].set(new).reshape(CACHE), 0.0),
     "stablehlo.reshape"),  # a flat-slot view of the whole layer
    (lambda cache, new, slots, table: (jnp.zeros_like(cache).at[0].set(cache[0]), 0.0), "stablehlo.broadcast"),
    (lambda cache, new, slots, table: (jax.lax.fori_loop(0, 2, lambda i, c: _write(c, new, slots + i), cache), 0.0),
     "stablehlo.while"),  # the cache as a loop carry
])
def test_the_full_cache_check_catches_a_program_that_copies_the_cache(bad, op):
    found = lowering.full_cache_ops(_lower(bad, _cache(), NEW, SLOTS, TABLE), CACHE)
    assert found and any(f.startswith(op) for f in found), found


def test_the_donation_check_catches_a_cache_that_is_not_donated():
    text = _lower(lambda c, n, s: _write(c, n, s), _cache(), NEW, SLOTS, donate=())
    assert lowering.undonated_cache_args(text, CACHE) == [f"%arg0: tensor<{'x'.join(map(str, CACHE))}xbf16> is not donated"]


# -- the kernels each platform calls -----------------------------------------------------------------------


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("kind", KINDS)
def test_each_program_calls_its_platforms_pallas_attention_and_no_cpu_kernel(weights, kind):
    """TPU: Pallas' ragged paged attention (Mosaic); cuda: our Pallas GPU kernel (a Triton custom call,
    `jaxinfer.ops.attention_pallas_gpu`). Neither reads a cache layer through a gather: the kernels read
    the pages where they lie (the pure-JAX path's page gather is also what makes it batch-dependent)."""
    tpu, cuda = program("tpu", weights, kind), program("cuda", weights, kind)
    assert tpu.attention_kernel == "tpu" and lowering.has_pallas_ragged_attention(tpu.text)
    assert not lowering.has_pallas_gpu_attention(tpu.text)
    assert cuda.attention_kernel == "gpu" and lowering.has_pallas_gpu_attention(cuda.text)
    assert not lowering.has_pallas_ragged_attention(cuda.text)
    assert lowering.cpu_targets(tpu.text) == [] and lowering.cpu_targets(cuda.text) == []
    for prog in (tpu, cuda):
        assert prog.check()["pallas"] == [] and prog.check()["cache_gathers"] == []
        assert lowering.cache_gathers(prog.text, prog.cache_shape) == []


@pytest.mark.parametrize("kind", KINDS)
def test_the_gpu_kernel_checks_fail_with_the_kernel_off(kind):
    """The same cuda step with the GPU kernel off (``JAXINFER_GPU_KERNELS=0``'s choice): the pure-JAX path,
    whose page gather of the cache layer and missing Triton call both checks report."""
    off = KernelChoice.for_platform("cuda", gpu_kernels=False)
    prog = lowering.lower_step(MODEL, ENGINE.replace(dtype="bfloat16"), "cuda", kind, batch=2, tokens=16, pages=4,
                               kernels=off)
    assert prog.attention_kernel is None and not lowering.has_pallas_gpu_attention(prog.text)
    found = lowering.check_program(prog.text, prog.cache_shape, "cuda", "default", expect_pallas=True)
    assert found["pallas"] and "Triton" in found["pallas"][0]
    assert found["cache_gathers"] and all("173x16x2x128xbf16" in f for f in found["cache_gathers"])


def test_the_gpu_kernel_check_reads_the_kernel_name():
    """Another Triton kernel in the program is not ours: the check looks for our kernel by name."""
    text = program("cuda", "bfloat16", "decode").text
    assert lowering.has_pallas_gpu_attention(text)
    assert not lowering.has_pallas_gpu_attention(text, name="some_other_triton_kernel")
    assert not lowering.has_pallas_gpu_attention(text.replace(lowering.TRITON_CALL, "__gpu$xla.gpu.other"))


def test_the_pallas_check_fails_where_the_kernel_is_not_staged():
    """A model whose head_dim (64) the kernel does not take: the TPU program falls back to the gather path,
    so a check that expects the kernel reports it, and the gather of the cache layer too."""
    small = MODEL.__class__(**{**MODEL.__dict__, "head_dim": 64})
    prog = lowering.lower_step(small, ENGINE, "tpu", "decode")
    assert prog.attention_kernel is None and not lowering.has_pallas_ragged_attention(prog.text)
    found = lowering.check_program(prog.text, prog.cache_shape, "tpu", "default", expect_pallas=True)
    assert found["pallas"] and found["cache_gathers"]


def test_the_cpu_target_check_catches_the_native_kernels():
    host = backend.prepare()
    if not (host.cpu_attention and host.cpu_matmul):
        pytest.skip("native CPU kernels unavailable")
    text = lowering.lower_step(MODEL, ENGINE, "cpu", "decode", kernels=KernelChoice.for_platform("cpu")).text
    found = lowering.cpu_targets(text)
    assert any("jaxinfer_paged_attention" in f for f in found) and any("jaxinfer_matmul" in f for f in found)


# -- quantized weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", lowering.PLATFORMS)
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_dequantized_weight_flows_only_into_its_product(platform, weights, kind):
    """On the pure-JAX path every layer's quantized weight is converted to float before XLA's dot (its dot takes
    float operands): the copy must flow only into the product, where the compiler can fuse it."""
    text = program(platform, weights, kind).text
    assert len(lowering.quantized_args(text)) >= 2 * MODEL.num_layers  # the layers' projections at least
    assert lowering.float_weight_copies(text, allow_fused=True) == []


@pytest.mark.xfail(strict=True, reason="today's XLA path dequantizes each weight to a float32 [K, N] tensor "
                   "before the dot (models/decoder.py matmul: w.dequantize(jnp.float32)); no copy at all needs a "
                   "quantized-product kernel on GPU and TPU")
@pytest.mark.parametrize("platform", lowering.PLATFORMS)
def test_no_float_copy_of_a_quantized_weight_at_all(platform):
    assert lowering.float_weight_copies(program(platform, "int8", "decode").text) == []


def test_the_weight_check_catches_a_copy_used_outside_the_product():
    w = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                     quant.leaf_spec(quant.ArraySpec((128, 256), jnp.float32, (None, None)), quant.Scheme.parse("int8")))
    x = jax.ShapeDtypeStruct((2, 128), jnp.float32)

    def bad(x, w):
        full = w.dequantize(jnp.float32)
        return x @ full, full.sum(axis=0)  # the float copy also feeds a reduction: it must be kept whole

    def good(x, w):
        return x @ w.dequantize(jnp.float32)

    found = lowering.float_weight_copies(_lower(bad, x, w, donate=()), allow_fused=True)
    assert len(found) == 1 and "used elsewhere" in found[0] and "128x256xf32" in found[0], found
    fused = lowering.float_weight_copies(_lower(good, x, w, donate=()))
    assert len(fused) == 1 and "only into products" in fused[0]
    assert lowering.float_weight_copies(_lower(good, x, w, donate=()), allow_fused=True) == []
    assert lowering.float_weight_copies(_lower(lambda x, w: w.lookup(jnp.arange(2), jnp.float32), x, w,
                                               donate=())) == []  # a few rows of it: no copy


# -- the precision of float32 products ---------------------------------------------------------------------


@every_program
def test_float32_products_carry_the_default_precision(platform, weights, kind):
    prog = program(platform, weights, kind)
    assert lowering.precision_findings(prog.text, "default") == []


@pytest.mark.parametrize("platform,weights", [("cuda", "float32"), ("cuda", "int8"), ("tpu", "float32"),
                                              ("tpu", "int8")])
@pytest.mark.parametrize("kind", KINDS)
def test_float32_products_carry_the_highest_precision_when_configured(platform, weights, kind):
    """float32 weights and the dequantized int8 ones: every float32 product says HIGHEST. The attention's
    products are inside the Pallas kernels' bodies on both platforms (Mosaic on tpu, Triton on cuda, where
    `jaxinfer.ops.attention` passes the step's precision to the kernel), not in this text."""
    prog = program(platform, weights, kind, "highest")
    assert prog.kernels.matmul_precision == "highest"
    f32 = [d for d in lowering.dot_precisions(prog.text) if d[1] == ("f32", "f32")]
    assert f32 and all(prec == ("HIGHEST", "HIGHEST") for _, _, prec in f32)
    assert lowering.precision_findings(prog.text, "highest") == []
    # the same program read for the other setting fails, and the default one fails "highest"
    assert lowering.precision_findings(prog.text, "default")
    assert lowering.precision_findings(program(platform, weights, kind).text, "highest")


def test_every_check_of_a_program_at_once():
    found = program("cuda", "float32", "decode").check()
    assert set(found) == {"full_cache_ops", "undonated_cache", "float_weight_copies", "precision", "cpu_targets",
                          "pallas", "cache_gathers"} and not any(found.values())
    assert program("cuda", "int8", "decode").check()["float_weight_copies"]  # strict: the fusible copies too


def test_lowering_allocates_nothing_for_a_large_cache():
    """Abstract inputs: a cache of 1M pages (hundreds of GB) lowers without memory for it."""
    big = ENGINE.replace(num_pages=1 << 20)
    prog = lowering.lower_step(MODEL, big, "cuda", "decode")
    assert prog.cache_shape[0] == 1 << 20 and lowering.full_cache_ops(prog.text, prog.cache_shape) == []


def test_an_unknown_platform_is_refused():
    with pytest.raises(ValueError, match="platform"):
        with lowering.abstract_device("metal"):
            pass
    with pytest.raises(ValueError, match="kernel choice is for tpu"):
        lowering.lower_step(MODEL, ENGINE, "cuda", kernels=KernelChoice.for_platform("tpu"))


def test_the_step_without_donation_is_what_the_donation_check_sees():
    """The engine's step donates the cache; the same function jitted without donation is caught."""
    args = lowering.step_inputs(MODEL, ENGINE, "decode", 2, 1, 4)
    text = jax.jit(step._decode_step, static_argnames=("cfg", "kernels")).trace(
        *args, cfg=MODEL, kernels=KernelChoice("cuda")).lower(lowering_platforms=("cuda",)).as_text()
    found = lowering.undonated_cache_args(text, tuple(kv_cache.cache_specs(MODEL, ENGINE)[0].shape))
    assert len(found) == MODEL.num_layers


def test_a_loop_that_only_reads_the_cache_passes_and_one_that_writes_it_does_not():
    def reads(cache, new, slots, table):
        total = jax.lax.fori_loop(0, 2, lambda i, acc: acc + cache[table[i]].astype(jnp.float32).sum(), 0.0)
        return _write(cache, new, slots), total

    def writes(cache, new, slots, table):
        return jax.lax.fori_loop(0, 2, lambda i, c: _write(c, new, slots + i), cache), 0.0

    assert lowering.full_cache_ops(_lower(reads, _cache(), NEW, SLOTS, TABLE), CACHE) == []
    assert [f for f in lowering.full_cache_ops(_lower(writes, _cache(), NEW, SLOTS, TABLE), CACHE)
            if f.startswith("stablehlo.while")]
