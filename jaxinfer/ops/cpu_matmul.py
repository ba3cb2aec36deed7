"""A native CPU kernel for the products ``x @ W`` (XLA FFI), float or quantized, any rows.

Batch-1 decode reads every weight once per token, so a step is bound by memory bandwidth.
XLA's CPU path for a quantized weight dequantizes it into a float32 copy and then runs its
dot over that copy (several times the bytes of the weight); its float32 matrix-vector
product reaches about half the bandwidth, and its bfloat16 one rounds the activations to
bfloat16. `jaxinfer/ops/kernels/matmul_cpu.cc` reads each weight element once, widens it in
registers, and shares output columns with XLA's intra-op thread pool. Prefill's many rows
take the same kernel, blocked: each thread converts a cache-sized panel of its columns to
float32 once and runs every row over it. See `benchmarks/matmul_kernel.py` for the figures.

Weights it takes (``y [M, N] float32 = x [M, K] float32 @ W``; activations stay float32):

- a `jaxinfer.ops.quant.QuantizedWeight` (int8, or int4 with or without an offset, any group
  that divides K), contracted over its rows (``w_contract`` 0);
- a `QuantizedWeight` stored transposed, ``[N, K]`` with groups along its rows (``axis`` 1,
  GGUF's row blocks: a tied LM head), int8 without an offset only, contracted over its
  columns (``w_contract`` 1): q ``int8 [N, K]``, scale ``float16 [N, K / group]``;
- a float32, bfloat16 or float16 ``[K, N]`` array (``w_contract`` 0), or ``[N, K]``
  (``w_contract`` 1: a tied LM head stored ``[vocab, hidden]``). 16-bit weights are
  widened exactly to float32 (x is not rounded to 16 bits, as XLA's bfloat16 dot does).

One reduction order: each output element is computed by the same float operations in the
same order whatever the number of rows in the call, the row's position among them, the
other rows, the thread count and the path inside the kernel (few rows or blocked), so a
row's result is bitwise the same alone or in any batch (the kernel's top comment gives the
order; tests/test_cpu_matmul.py checks it for every weight form).

Use: `jaxinfer.ops.backend.start_build` early (a background compile, once per machine, cached
on disk), then `jaxinfer.ops.backend.prepare` before tracing (loads and registers it, and returns
the `KernelChoice` that says whether programs use it). In a trace, call `matmul` only where
`fits` says so; `fits` reads only the choice (the step's), never the process's registry, and is
False where the choice has no CPU matmul (off CPU, ``JAXINFER_CPU_KERNELS=0``, a failed build),
for a weight it does not take, and under a multi-device mesh (XLA cannot partition a custom call).
`matmul`'s derivatives are those of the XLA formula (`xla_matmul`), which computes the same function (on
the VNNI path x's quantization is passed straight through).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops import backend, kernels, mesh
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.quant import QuantizedWeight

SOURCE = kernels.MATMUL
TARGET_FLOAT, TARGET_Q = kernels.TARGETS[SOURCE]  # registered by `kernels.load`

# The float weight dtypes the kernel takes (widened to float32 in registers).
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# ---------------------------------------------------------------------------
# building


def prepare() -> bool:
    """Build (once per machine, then cached on disk), load and register the kernel.

    Call it before tracing (`jaxinfer.ops.backend.prepare` does). Returns whether the kernel is
    available; a failed build warns once and callers use XLA's path.
    """
    if backend.host_platform() != "cpu":
        return False
    return kernels.prepare(SOURCE)


def isa() -> Optional[str]:
    """The SIMD path the loaded kernel was compiled for ("avx512", "avx2" or "scalar"), or None."""
    return KernelChoice.loaded().simd or None


def load_variant(flags: Sequence[str]) -> tuple[dict, str]:
    """Build the kernel with other compiler flags (e.g. ``["-O3", "-march=native",
    "-mno-avx512f"]`` for the AVX2 path) through `kernels.load_variant`, load it and register its
    handlers under their own target names; returns ({"float": target, "q": target}, isa). For
    tests and benchmarks: pass the targets to `matmul` (``targets=``). Cached on disk like the
    default build. Raises RuntimeError when it cannot be built."""
    lib, names = kernels.load_variant(SOURCE, flags)
    isa = kernels.matmul_isa(lib)
    return {"float": names[TARGET_FLOAT], "q": names[TARGET_Q], "isa": isa}, isa


# ---------------------------------------------------------------------------
# use


def _axis(w: QuantizedWeight) -> int:
    """The axis a quantized weight's groups run along (0: [K, N]; 1: [N, K])."""
    return w.axis


def _transposed_ok(w: QuantizedWeight, w_contract: int) -> bool:
    """An ``axis`` 1 weight the kernel takes: int8 ``[N, K]``, no offset, contracted over axis 1."""
    if w_contract != 1 or w.bits != 8 or w.offset is not None or w.scale is None:
        return False
    if len(w.q.shape) != 2 or len(w.scale.shape) != 2:
        return False
    n, k = w.q.shape
    group = w.group or k
    return (group > 0 and k % group == 0 and jnp.dtype(w.q.dtype) == jnp.int8
            and jnp.dtype(w.scale.dtype) == jnp.float16 and tuple(w.scale.shape) == (n, k // group))


def _weight_ok(w: Any, w_contract: int) -> bool:
    if isinstance(w, QuantizedWeight):
        if _axis(w) == 1:
            return _transposed_ok(w, w_contract)
        if _axis(w) != 0 or w_contract != 0 or w.bits not in (8, 4) or len(w.q.shape) != 2 or len(w.scale.shape) != 2:
            return False
        k, n = w.shape
        group = w.group or k
        if group <= 0 or k % group or (w.bits == 4 and group % 2):
            return False
        qdtype = jnp.int8 if w.bits == 8 else jnp.uint8
        def side_ok(a) -> bool:
            return a is None or (jnp.dtype(a.dtype) == jnp.float16 and tuple(a.shape) == (k // group, n))

        return jnp.dtype(w.q.dtype) == qdtype and w.scale is not None and side_ok(w.scale) and side_ok(w.offset)
    shape, dtype = getattr(w, "shape", None), getattr(w, "dtype", None)
    return (shape is not None and len(shape) == 2 and dtype is not None
            and jnp.dtype(dtype) in [jnp.dtype(d) for d in FLOAT_DTYPES] and w_contract in (0, 1))


def fits(rows: int, w: Any, w_contract: int = 0, choice: Optional[KernelChoice] = None) -> bool:
    """Whether to stage the kernel for ``rows`` rows of x times ``w``: a choice with the CPU matmul
    (``choice``, default `jaxinfer.ops.backend.current`: the step's), at least one row (any
    number: decode's few and prefill's many take the same kernel, in the same reduction
    order), a weight it takes, and no multi-device mesh being traced under."""
    choice = choice if choice is not None else backend.current()
    return (
        choice.cpu_matmul
        and rows >= 1
        and _weight_ok(w, w_contract)
        and mesh.tp_size() == 1
    )


def quantize_x(x2: jax.Array) -> jax.Array:
    """x as the VNNI path multiplies it (`int8_dot`), in float32: per row and block of `DOT_BLOCK` values,
    xq = round-to-nearest-even(x * 127 / max |x|) in [-127, 127], times max |x| / 127 (zeros stay zeros)."""
    m, k = x2.shape
    xb = x2.astype(jnp.float32).reshape(m, k // DOT_BLOCK, DOT_BLOCK)
    mx = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    inv = jnp.where(mx > 0, 127.0 / jnp.where(mx > 0, mx, 1.0), 0.0)
    xq = jnp.clip(jnp.round(xb * inv), -127, 127)
    return (xq * (mx / 127.0)).reshape(m, k)


def xla_matmul(x2: jax.Array, w: Any, w_contract: int = 0, bf16_x: bool = False, q8_x: bool = False) -> jax.Array:
    """XLA's path for the same function: dequantize (a quantized weight) or widen (a 16-bit
    one), then dot, in float32 (``bf16_x``: x rounded to bfloat16 first, as the AMX path does;
    ``q8_x``: x quantized per block as the VNNI path does, `quantize_x`). The kernel's derivatives;
    the reference its tests use."""
    f32 = jnp.float32
    if bf16_x:
        x2 = x2.astype(jnp.bfloat16)
    if q8_x:
        x2 = quantize_x(x2)
    if isinstance(w, QuantizedWeight) and _axis(w) == 1 and w.bits == 8 and w.offset is None:
        n, k = w.q.shape  # [N, K], scale [N, K / group]
        group = w.group or k
        deq = w.q.astype(f32).reshape(n, k // group, group) * w.scale.astype(f32)[:, :, None]
        w, w_contract = deq.reshape(n, k), 1
    elif isinstance(w, QuantizedWeight):
        w, w_contract = w.dequantize(f32), (w_contract if _axis(w) == 1 else 0)
    dims = (((1,), (w_contract,)), ((), ()))
    return jax.lax.dot_general(x2.astype(f32), w.astype(f32), dims, preferred_element_type=f32)


def matmul(x2: jax.Array, w: Any, w_contract: int = 0, targets: Optional[dict] = None,
           share: Optional[bool] = None) -> jax.Array:
    """``x2 [M, K] @ w`` -> ``[M, N]`` float32 by the native kernel (see `fits`).

    ``w``: a `QuantizedWeight` [K, N] (``w_contract`` 0) or int8 [N, K] (``axis`` 1,
    ``w_contract`` 1), or float32, bfloat16 or float16 [K, N] (``w_contract`` 0) or [N, K]
    (``w_contract`` 1). ``x2`` is taken as float32 (never rounded to the weight's dtype).
    ``targets``: another build's handlers (`load_variant`), for tests.
    ``share``: whether to share the work with XLA's intra-op threads (default: unless a
    multi-device mesh is being traced under); False measures one thread, in benchmarks.
    """
    names = (targets["float"], targets["q"]) if targets else (TARGET_FLOAT, TARGET_Q)
    if share is None:
        share = mesh.tp_size() == 1
    simd = targets.get("isa", "") if targets else backend.current().simd
    return _kernel_matmul(x2.astype(jnp.float32), w, w_contract, names, bool(share), dot_kind(w, simd))


# x's quantization block on the VNNI path (`int8_dot`; the kernel's vnni::kQ).
DOT_BLOCK = 32


def bf16_dot(w: Any, simd: str) -> bool:
    """Whether the kernel built for ``simd`` multiplies ``w`` on the AMX tiles with x rounded to
    bfloat16 (a bfloat16 weight on an "+amx" path), rather than x in float32 times the widened weight."""
    return ("amx" in backend.simd_features(simd) and not isinstance(w, QuantizedWeight)
            and jnp.dtype(getattr(w, "dtype", jnp.float32)) == jnp.bfloat16)


def int8_dot(w: Any, simd: str) -> bool:
    """Whether the kernel built for ``simd`` multiplies ``w`` by VNNI integer dots with x quantized to int8
    per row and block of `DOT_BLOCK` (`quantize_x`): a [K, N] int8 or int4 weight, or an int8 [N, K] one
    (``axis`` 1: a tied LM head), whose contraction and groups are multiples of the block, on a "+vnni" path. Decided by the weight alone, never by the rows, so a row's
    result is the same whatever the batch."""
    if "vnni" not in backend.simd_features(simd) or not isinstance(w, QuantizedWeight):
        return False
    if _axis(w) == 1 and not _transposed_ok(w, 1):  # [N, K]: int8 without an offset (a tied LM head)
        return False
    k = w.shape[_axis(w)]
    return k % DOT_BLOCK == 0 and (w.group or k) % DOT_BLOCK == 0


def dot_kind(w: Any, simd: str) -> str:
    """The kernel's products for ``w`` on ``simd``: "bf16" (`bf16_dot`), "int8" (`int8_dot`) or "" (x in float32)."""
    return "bf16" if bf16_dot(w, simd) else ("int8" if int8_dot(w, simd) else "")


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4, 5))
def _kernel_matmul(x2, w, w_contract: int, names: tuple, share: bool, dot: str = ""):
    m, k = x2.shape
    if isinstance(w, QuantizedWeight):
        qc = 1 if _axis(w) == 1 else 0  # the axis of q that meets x's K
        n = w.q.shape[1 - qc]
        offset = w.offset if w.offset is not None else jnp.zeros((0, n), jnp.float16)
        return jax.ffi.ffi_call(names[1], jax.ShapeDtypeStruct((m, n), jnp.float32), vmap_method="sequential")(
            x2, w.q, w.scale, offset, bits=np.int64(w.bits), group=np.int64(w.group or k), w_contract=np.int64(qc),
            share=share, int8_dot=dot == "int8")
    n = w.shape[1 - w_contract]
    return jax.ffi.ffi_call(names[0], jax.ShapeDtypeStruct((m, n), jnp.float32), vmap_method="sequential")(
        x2, w, w_contract=np.int64(w_contract), share=share, bf16_dot=dot == "bf16")


@_kernel_matmul.defjvp
def _kernel_matmul_jvp(w_contract, names, share, dot, primals, tangents):
    # x's quantization on the VNNI path has a zero derivative almost everywhere: its derivative is taken
    # as the identity (straight through), i.e. that of the float product.
    return jax.jvp(functools.partial(xla_matmul, w_contract=w_contract, bf16_x=dot == "bf16"), primals, tangents)
