"""Attention over the paged KV cache: the one attention mechanism.

`ragged_paged_attention` attends a ragged batch (`RaggedMetadata`: every token of every request in
one flat list, with per-request offsets ``query_start``, page tables and lengths) over the pages
named by each request's page table (its cached context plus the step's own keys/values), and writes
the step's keys/values into their cache slots. A decode row is a request with one token, a prefill
chunk (whole prompt, a continued chunk, after a prefix-cache hit) a request with many; both mix
freely in one step. `paged_attention` is the same over ``[B, T]`` rows (`AttentionMetadata`): B
requests of T tokens each, a reshape onto it.

The pure-JAX path (`jaxinfer.ops.gather_attention`) runs everywhere: work items of up to a
tile of one request's tokens read that request's page columns a block at a time, with an online
softmax. Its cost grows with the pages attended (``P``, a bucketed size; blocks past every token
are skipped), never with the cache's capacity. On CPU, XLA emits its page gather element by
element rather than as block copies; that gather and the masked softmax were the largest part of
a batched decode step and a large part of a batched prefill (`python -m benchmarks.engine` shows
the split). So on the CPU platform attention goes to a native kernel that reads the pages where
they lie (`jaxinfer/ops/kernels/paged_attention_cpu.cc`), for decode rows and prefill chunks
alike, in any mix; the latent cache of multi-head latent attention has a kernel of its own in the same
source (`latent_kernel_call`). Which path a program takes is the step's `jaxinfer.ops.backend.KernelChoice`
(decided once, after the kernels load), never the process's state while tracing:
a program for a GPU or TPU never sees the CPU kernel.

Accelerators (`jaxinfer.ops.attention_pallas`, where the reasons are given in full):

- TPU: Pallas ``ragged_paged_attention``, which reads our cache layer as it is
  (K at even, V at odd head indices), for decode and prefill chunks alike and
  stopping at each row's length. It is staged where the shapes fit its tiling
  (head_dim a multiple of 128, a KV-head count that tiles; `tpu_kernel_fits`);
  other models (SmolLM2: head_dim 64, 3 KV heads) take the pure-JAX path.
- GPU (cuda): our own Pallas (Triton) ragged paged attention (`jaxinfer.ops.attention_pallas_gpu`),
  which reads this cache layer as it is, decode rows and prefill chunks in one launch, key blocks
  fixed by absolute position (batch-invariant by construction). It is staged where the shapes fit
  (`gpu_kernel_fits`: head_dim and page_size powers of two, a float32 or bfloat16 cache) and the
  step's `KernelChoice` has it (``gpu_attention``; ``JAXINFER_GPU_KERNELS=0`` keeps the pure-JAX
  path). JAX's own Pallas GPU ``paged_attention`` and ``decode_attention`` were not wired: they read
  K and V head-major or contiguous (a copy or a page gather of the cache every step) and are
  decode-only (`jaxinfer.ops.attention_pallas`). The latent cache of multi-head latent attention
  stays on the pure-JAX path on GPU (a different layout; documented fallback). Not measured on a GPU
  yet (none was available): proven on CPU by interpret mode and by lowering the step for cuda;
  `jaxinfer.tools.device_check` reports it on the first GPU it runs on.

The kernel is built by `prepare_cpu_kernel` (`jaxinfer.ops.backend.prepare` calls it at model
load, with its own progress line; cached per machine), never inside a jit trace.

On a device mesh (`jaxinfer.ops.mesh`) attention runs inside ``jax.shard_map`` over the
KV-head axis: each device attends its own query heads over its own shard of the cache.

Batch invariance (a query token's output bitwise the same whatever else is computed with it):

- CPU kernel: yes. Decode rows and prefill tiles run one per-row routine with one order per
  output element (key blocks at absolute positions, a fixed tree for each q.k, the same softmax
  steps); a token gives the same bits in a decode step, anywhere in a chunk of any size, beside
  any other requests, as a ragged step or as ``[B, T]`` rows, and on any thread
  (tests/test_attention_invariance.py, tests/test_ragged_attention.py). Multi-head latent attention
  (DeepSeek, `latent_paged_attention`) on CPU goes to the same source's latent kernel, built the same way
  (one routine per row, key blocks at absolute positions, fixed trees), and is batch-invariant too
  (tests/test_latent_attention_kernel.py).
- Pure-JAX path on CPU (``JAXINFER_CPU_KERNELS=0``): no, measured op by op (on the earlier
  gather-everything form; the ragged form's tile and block sizes follow the step's shape too).
  The q.k einsum changes its order of summation with the number of query rows and with the keys
  gathered (XLA's CPU dot goes to Eigen, whose matrix product picks a kernel by shape), and the
  softmax's sum over the keys changes order with the number of rows reduced and the keys
  gathered. The value einsum was invariant in the
  cases tried. A rewrite in elementwise adds of one fixed tree was not invariant either (XLA fuses
  it differently per shape, and the fused loops contract multiply-adds differently) and was 2-10x
  slower, so it was not kept. On GPU and TPU the same einsums and reduction go to cuBLAS/XLA's
  emitters and the MXU, whose orders also follow the shapes; not measured here.
- Pallas GPU kernel (cuda): yes by construction (fixed tile shapes, key blocks at absolute positions,
  one program per row's whole reduction, no split-K; `jaxinfer.ops.attention_pallas_gpu`), checked
  bitwise in interpret mode on CPU (tests/test_pallas_gpu_attention.py); not yet measured on a GPU.

Compile keys: every path stops at each request's context (the kernels at its last position; the
pure-JAX path skips, at run time, the blocks of page columns past the step's last position), so the
engine passes the page table at its full width and pages attended are not a compile key.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops import backend, kernels, mesh
from jaxinfer.ops.attention_pallas import from_ragged, rows_as_ragged, to_ragged, tpu_ragged_attention
from jaxinfer.ops.attention_pallas_gpu import gpu_ragged_attention
from jaxinfer.ops.gather_attention import (
    AttentionMetadata,
    RaggedMetadata,
    gather_attention,
    ragged_gather_attention,
)

__all__ = ["AttentionMetadata", "RaggedMetadata", "gather_attention", "latent_kernel_call", "latent_paged_attention",
           "paged_attention", "prepare_cpu_kernel", "ragged_gather_attention", "ragged_paged_attention"]


def ragged_paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_layer: jax.Array,
    meta: RaggedMetadata,
    scale: float,
    window: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Causal grouped-query attention of a ragged batch over each request's pages.

    q: [N, H, D]; k, v: [N, KVH, D]; cache_layer: [num_pages, page_size, 2*KVH, D].
    A token at position p attends its own request's keys 0..p; ``window`` > 0: sliding-window
    attention, keys p - window + 1 .. p (transformers' rule: ``q - k < window``).
    Returns (out [N, H, D], updated cache_layer); padding tokens come out as zeros.
    """
    n, h, d = q.shape
    r = meta.page_table.shape[0]
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d:
        raise ValueError(f"k and v must be [N, KVH, D] with N = {n} and D = {d}, got {k.shape} and {v.shape}")
    if meta.positions.shape != (n,) or meta.slots.shape != (n,):
        raise ValueError(f"positions and slots must be [N] = ({n},), got {meta.positions.shape} and "
                         f"{meta.slots.shape}")
    if meta.query_start.shape != (r + 1,) or meta.kv_lens.shape != (r,):
        raise ValueError(f"query_start must be [R + 1] = ({r + 1},) and kv_lens [R] = ({r},) for a [{r}, P] "
                         f"page table, got {meta.query_start.shape} and {meta.kv_lens.shape}")
    if mesh.tp_size() > 1:
        # XLA cannot partition a custom call or a Pallas kernel: each device attends its own
        # heads over its own shard of the cache (the layout puts a KV head's queries with it).
        heads = jax.sharding.PartitionSpec(None, mesh.TP_AXIS, None)  # [N, heads, D]
        local = jax.shard_map(
            functools.partial(_attend, scale=scale, window=window),
            in_specs=(heads, heads, heads, mesh.CACHE_SPEC, jax.sharding.PartitionSpec()),
            out_specs=(heads, mesh.CACHE_SPEC),
            check_vma=False,
        )
        return local(q, k, v, cache_layer, meta)
    return _attend(q, k, v, cache_layer, meta, scale, window)


def latent_paged_attention(
    q: jax.Array,
    entry: jax.Array,
    cache_layer: jax.Array,
    meta: RaggedMetadata,
    scale: float,
    value_dim: int,
) -> tuple[jax.Array, jax.Array]:
    """Multi-head latent attention (DeepSeek) in its absorbed form over a latent cache: every head attends
    the same per-token entries, each head's key being the whole entry and its value the first
    ``value_dim`` values (`jaxinfer.models.transformer.latent_attention` folds the latent's per-head
    up-projections into the query and the output, so only the latent pages are read).

    q: [N, H, D]; entry: [N, 1, D] (the step's tokens' entries, written to their slots);
    cache_layer: [num_pages, page_size, 1, D]. Returns (out [N, H, value_dim], updated cache_layer).

    On CPU with the native attention kernel in the step's `KernelChoice` (``cpu_attention``) and shapes it
    takes (`jaxinfer.ops.backend.latent_attention_fits`: D and ``value_dim`` multiples of 8, a float32 or
    bfloat16 cache) it runs the native latent kernel (`latent_kernel_call`), batch-invariant as the GQA kernel;
    elsewhere the pure-JAX path (`ragged_gather_attention`). On a device mesh each device attends its own
    heads over the whole latent cache, which every device holds (the entry is the same for every head, as
    sglang-jax and vLLM's TPU backend keep it).
    """
    n, h, d = q.shape
    if entry.shape != (n, 1, d) or cache_layer.shape[2:] != (1, d):
        raise ValueError(f"latent entries must be [N, 1, D] = ({n}, 1, {d}) over a [pages, page_size, 1, {d}] cache, "
                         f"got {entry.shape} and {cache_layer.shape}")
    fn = functools.partial(_latent_attend, scale=scale, value_dim=value_dim)
    if mesh.tp_size() > 1:
        heads, whole = jax.sharding.PartitionSpec(None, mesh.TP_AXIS, None), jax.sharding.PartitionSpec()
        fn = jax.shard_map(fn, in_specs=(heads, whole, mesh.LATENT_CACHE_SPEC, whole),
                           out_specs=(heads, mesh.LATENT_CACHE_SPEC), check_vma=False)
    return fn(q, entry, cache_layer, meta)


def _latent_attend(q, entry, cache_layer, meta: RaggedMetadata, scale: float, value_dim: int):
    """Latent attention on one device's heads: the native CPU kernel where the step's choice has it and it
    takes the shapes, else pure JAX."""
    if backend.current().cpu_attention and backend.latent_attention_fits(q.shape[2], value_dim, cache_layer.dtype):
        return _cpu_latent_attention(q, entry, cache_layer, meta, scale, value_dim)
    return ragged_gather_attention(q, entry, None, cache_layer, meta, scale, value_dim=value_dim)


LATENT_TARGET = "jaxinfer_latent_attention"  # in `CPU_SOURCE`, registered with the GQA kernel


def latent_kernel_call(target: str = LATENT_TARGET, share: bool = True):
    """The native latent kernel's FFI call as ``fn(q, entry, cache_layer, meta, scale, value_dim) -> (out,
    cache)`` (``target``: another build's name, for tests and benchmarks; ``share``: split the work over XLA's
    intra-op pool). q float32 [N, H, D], entry float32 [N, 1, D]; it writes the step's entries in place."""

    def call(q, entry, cache_layer, meta: RaggedMetadata, scale: float, value_dim: int):
        n, h, _ = q.shape
        return jax.ffi.ffi_call(
            target,
            (jax.ShapeDtypeStruct((n, h, value_dim), jnp.float32),
             jax.ShapeDtypeStruct(cache_layer.shape, cache_layer.dtype)),
            input_output_aliases={2: 1},
        )(q, entry, cache_layer, meta.page_table, meta.positions, meta.query_start, scale=np.float32(scale),
          value_dim=np.int64(value_dim), share=share)

    return call


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _cpu_latent_attention(q, entry, cache_layer, meta: RaggedMetadata, scale: float, value_dim: int):
    """CPU: the native latent kernel writes the step's entries into the cache in place, then attends.
    Derivatives are those of the pure-JAX path, which computes the same function."""
    f32 = jnp.float32
    out, cache_layer = latent_kernel_call(share=mesh.tp_size() == 1)(
        q.astype(f32), entry.astype(f32), cache_layer, meta, scale, value_dim)
    return out.astype(q.dtype), cache_layer


@_cpu_latent_attention.defjvp
def _cpu_latent_attention_jvp(scale, value_dim, primals, tangents):
    def pure(q, entry, cache_layer, meta):
        return ragged_gather_attention(q, entry, None, cache_layer, meta, scale, value_dim=value_dim)

    return jax.jvp(pure, primals, tangents)


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_layer: jax.Array,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """`ragged_paged_attention` over ``[B, T]`` rows: each row a request of T tokens.

    q: [B, T, H, D]; k, v: [B, T, KVH, D]; meta: `AttentionMetadata` ([B, T] positions and slots,
    -1 for padding). Returns (out [B, T, H, D], updated cache_layer).
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    if meta.positions.shape != (b, t) or meta.slots.shape != (b, t):
        raise ValueError(f"positions and slots must be [B, T] = {(b, t)}, got {meta.positions.shape} and "
                         f"{meta.slots.shape}")
    kernel = backend.current().attention_kernel(h // mesh.tp_size(), kvh // mesh.tp_size(), d, cache_layer.shape[1],
                                                cache_layer.dtype)
    if kernel == "tpu":
        # The Pallas kernel places a request's queries by its length, so a row's padding tokens cannot
        # sit inside its segment: the rows' real tokens are packed back to back first.
        ragged, index = rows_as_ragged(meta)
        out, cache_layer = ragged_paged_attention(to_ragged(q, index), to_ragged(k, index), to_ragged(v, index),
                                                  cache_layer, ragged, scale, window)
        return from_ragged(out, index), cache_layer
    out, cache_layer = ragged_paged_attention(q.reshape(b * t, h, d), k.reshape(b * t, kvh, d),
                                              v.reshape(b * t, kvh, d), cache_layer, meta.ragged(), scale, window)
    return out.reshape(b, t, h, d), cache_layer


def _attend(q, k, v, cache_layer, meta: RaggedMetadata, scale: float, window: int):
    """Attention on one device's heads: the kernel the step's choice names for these shapes, else pure JAX."""
    h, kvh, d = q.shape[1], k.shape[1], q.shape[2]
    choice = backend.current()
    kernel = choice.attention_kernel(h, kvh, d, cache_layer.shape[1], cache_layer.dtype)
    if kernel == "cpu":
        return _cpu_attention(q, k, v, cache_layer, meta, scale, window)
    if kernel == "tpu":  # block sizes for the TPU the choice names, not the device the trace runs on
        return tpu_ragged_attention(q, k, v, cache_layer, meta, scale=scale, window=window, tpu_kind=choice.tpu_kind)
    if kernel == "gpu":  # float32 operands' products at the step's precision (None: TF32 on NVIDIA)
        return gpu_ragged_attention(q, k, v, cache_layer, meta, scale=scale, window=window,
                                    precision=choice.lax_precision, interpret=choice.gpu_interpret)
    return ragged_gather_attention(q, k, v, cache_layer, meta, scale, window)


CPU_SOURCE = kernels.PAGED_ATTENTION
CPU_TARGET = "jaxinfer_paged_attention"  # registered by `kernels.load` (`kernels.TARGETS`)


def prepare_cpu_kernel() -> bool:
    """Build (once per machine, then cached on disk) and register the CPU attention kernel.

    Call it before tracing a step (`jaxinfer.ops.backend.prepare` does, at load). Returns whether
    the kernel is available; a failed build warns once and the pure-JAX path is used. Tracing with
    the host's choice (`backend.current` outside a step) then takes it.
    """
    if backend.host_platform() != "cpu":
        return False
    return kernels.prepare(CPU_SOURCE)



def cpu_kernel_call(target: str = CPU_TARGET, share: bool = True):
    """The native kernel's FFI call as ``fn(q, k, v, cache_layer, meta, scale, window) -> (out, cache)``
    (``target``: another build's name, for tests and benchmarks; ``share``: split the work over XLA's
    intra-op pool). q, k, v float32 [N, H or KVH, D]; it writes the step's keys/values in place."""

    def call(q, k, v, cache_layer, meta: RaggedMetadata, scale: float, window: int):
        n, h, d = q.shape
        return jax.ffi.ffi_call(
            target,
            (jax.ShapeDtypeStruct((n, h, d), jnp.float32), jax.ShapeDtypeStruct(cache_layer.shape, cache_layer.dtype)),
            input_output_aliases={3: 1},
        )(q, k, v, cache_layer, meta.page_table, meta.positions, meta.query_start, scale=np.float32(scale),
          window=np.int64(window), share=share)

    return call


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def _cpu_attention(q, k, v, cache_layer, meta: RaggedMetadata, scale: float, window: int):
    """CPU: the native kernel writes the step's keys/values into the cache in place, then attends.

    Derivatives (research code differentiating the model) are those of the pure-JAX path,
    which computes the same function.
    """
    f32 = jnp.float32
    out, cache_layer = cpu_kernel_call(share=mesh.tp_size() == 1)(
        q.astype(f32), k.astype(f32), v.astype(f32), cache_layer, meta, scale, window)
    return out.astype(q.dtype), cache_layer


@_cpu_attention.defjvp
def _cpu_attention_jvp(scale, window, primals, tangents):
    return jax.jvp(functools.partial(ragged_gather_attention, scale=scale, window=window), primals, tangents)
