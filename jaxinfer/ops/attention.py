"""Attention over the paged KV cache: the one attention entry point.

`paged_attention` attends a chunk of queries over the pages named by the page
table (the cached context plus the chunk's own keys/values) and writes the
chunk's keys/values into their cache slots.
It serves whole-prompt prefill, chunked prefill, prefix-cache hits and
decode alike: a decode step is a chunk of length 1.

The pure-JAX path (`jaxinfer.ops.gather_attention`) runs everywhere. Its cost grows with
the pages attended (``P``, a bucketed size), never with the cache's capacity.
On CPU, XLA emits its page gather element by element rather than as block
copies; that gather and the masked softmax over the gathered copy were the
largest part of a batched decode step and a large part of a batched prefill
(`python -m benchmarks.engine` shows the split). So on the CPU platform
attention goes to a native kernel that reads the pages where they lie
(`jaxinfer/ops/kernels/paged_attention_cpu.cc`), for decode and prefill chunks
alike. Which path a program takes is the step's `jaxinfer.ops.backend.KernelChoice`
(decided once, after the kernels load), never the process's state while tracing:
a program for a GPU or TPU never sees the CPU kernel.

Accelerators (`jaxinfer.ops.attention_pallas`, where the reasons are given in full):

- TPU: Pallas ``ragged_paged_attention``, which reads our cache layer as it is
  (K at even, V at odd head indices), for decode and prefill chunks alike and
  stopping at each row's length. It is staged where the shapes fit its tiling
  (head_dim a multiple of 128, a KV-head count that tiles; `tpu_kernel_fits`);
  other models (SmolLM2: head_dim 64, 3 KV heads) take the pure-JAX path.
- GPU: the pure-JAX path. The Pallas GPU ``paged_attention`` reads K and V as two
  head-major arrays: from our layout that is a copy of the whole cache every step
  (about 200 GiB per step for a 100 GiB Llama-3-8B cache), and it is decode-only;
  ``decode_attention`` and cuDNN's ``jax.nn.dot_product_attention`` read contiguous
  keys, i.e. the same page gather the pure-JAX path does, plus a transpose. None
  was measured on a GPU yet (none was available): `jaxinfer.tools.device_check` reports
  the decode step against the bandwidth roofline on the first GPU it runs on.

The kernel is built by `prepare_cpu_kernel` (`jaxinfer.ops.backend.prepare` calls it at model
load, with its own progress line; cached per machine), never inside a jit trace.

On a device mesh (`jaxinfer.ops.mesh`) attention runs inside ``jax.shard_map`` over the
KV-head axis: each device attends its own query heads over its own shard of the cache.

Batch invariance (a query token's output bitwise the same whatever else is computed with it):

- CPU kernel: yes. Decode steps and prefill tiles run one per-row routine with one order per
  output element (key blocks at absolute positions, a fixed tree for each q.k, the same softmax
  steps); a token gives the same bits in a decode step, anywhere in a chunk of any size, beside
  any other rows, and on any thread (tests/test_attention_invariance.py).
- Pure-JAX path on CPU (``JAXINFER_CPU_KERNELS=0``): no, measured op by op. The q.k einsum
  changes its order of summation with the number of query rows in the chunk and with the keys
  gathered (XLA's CPU dot goes to Eigen, whose matrix product picks a kernel by shape), and
  ``jax.nn.softmax``'s sum over the keys changes order with the number of rows reduced (batch,
  heads, chunk) and the keys gathered (the page bucket). The value einsum was invariant in the
  cases tried. A rewrite in elementwise adds of one fixed tree was not invariant either (XLA fuses
  it differently per shape, and the fused loops contract multiply-adds differently) and was 2-10x
  slower, so it was not kept. On GPU and TPU the same einsums and reduction go to cuBLAS/XLA's
  emitters and the MXU, whose orders also follow the shapes; not measured here.

Compile keys: the kernel reads each row's real context length (it stops at
the row's last position), so with it the page table is passed at its full
width and pages attended are not a compile key
(`jaxinfer.ops.backend.KernelChoice.reads_row_lengths`). The pure-JAX path
gathers every page in the table, so it keeps page buckets.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops import backend, kernels, mesh
from jaxinfer.ops.attention_pallas import tpu_ragged_attention
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.gather_attention import AttentionMetadata, gather_attention

__all__ = ["AttentionMetadata", "gather_attention", "paged_attention", "prepare_cpu_kernel", "reads_row_lengths"]


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_layer: jax.Array,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Causal grouped-query attention of a chunk over its sequence's pages.

    q: [B, T, H, D]; k, v: [B, T, KVH, D]; cache_layer: [num_pages, page_size, 2*KVH, D].
    ``window`` > 0: sliding-window attention, a query at position p attends keys
    p - window + 1 .. p (transformers' rule: ``q - k < window``); 0: every earlier key.
    Returns (out [B, T, H, D], updated cache_layer).
    """
    b, t, h, d = q.shape
    chex.assert_shape(meta.positions, (b, t))
    chex.assert_shape(meta.slots, (b, t))
    if mesh.tp_size() > 1:
        # XLA cannot partition a custom call or a Pallas kernel: each device attends its own
        # heads over its own shard of the cache (the layout puts a KV head's queries with it).
        heads = mesh.CACHE_SPEC  # [B, T, heads, D] and the cache [pages, slot, 2 KVH, D] alike
        local = jax.shard_map(
            functools.partial(_attend, scale=scale, window=window),
            in_specs=(heads, heads, heads, heads, jax.sharding.PartitionSpec()),
            out_specs=(heads, heads),
            check_vma=False,
        )
        return local(q, k, v, cache_layer, meta)
    return _attend(q, k, v, cache_layer, meta, scale, window)


def _attend(q, k, v, cache_layer, meta: AttentionMetadata, scale: float, window: int):
    """Attention on one device's heads: the kernel the step's choice names for these shapes, else pure JAX."""
    h, kvh, d = q.shape[2], k.shape[2], q.shape[3]
    kernel = backend.current().attention_kernel(h, kvh, d, cache_layer.shape[1], cache_layer.dtype)
    if kernel == "cpu":
        return _cpu_attention(q, k, v, cache_layer, meta, scale, window)
    if kernel == "tpu":
        return tpu_ragged_attention(q, k, v, cache_layer, meta, scale=scale, window=window)
    return gather_attention(q, k, v, cache_layer, meta, scale, window)


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


def reads_row_lengths(num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype, page_size: int,
                      kernels_choice: KernelChoice | None = None) -> bool:
    """Whether steps traced with ``kernels_choice`` (default: the host's now) attend with a kernel (CPU,
    or Pallas on TPU) that stops at each row's length, so the page table can be passed at full width.
    Head counts are one device's."""
    choice = kernels_choice if kernels_choice is not None else KernelChoice.loaded()
    return choice.reads_row_lengths(num_heads, num_kv_heads, head_dim, cache_dtype, page_size)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def _cpu_attention(q, k, v, cache_layer, meta: AttentionMetadata, scale: float, window: int):
    """CPU: the native kernel writes the chunk's keys/values into the cache in place, then attends.

    Derivatives (research code differentiating the model) are those of the pure-JAX path,
    which computes the same function.
    """
    b, t, h, d = q.shape
    f32 = jnp.float32
    out, cache_layer = jax.ffi.ffi_call(
        CPU_TARGET,
        (jax.ShapeDtypeStruct((b, t, h, d), f32), jax.ShapeDtypeStruct(cache_layer.shape, cache_layer.dtype)),
        input_output_aliases={3: 1},
    )(q.astype(f32), k.astype(f32), v.astype(f32), cache_layer, meta.page_table, meta.positions, scale=np.float32(scale),
        window=np.int64(window), share=mesh.tp_size() == 1)
    return out.astype(q.dtype), cache_layer


@_cpu_attention.defjvp
def _cpu_attention_jvp(scale, window, primals, tangents):
    return jax.jvp(functools.partial(gather_attention, scale=scale, window=window), primals, tangents)
