"""Attention over the paged KV cache: the one attention entry point.

`paged_attention` attends a chunk of queries over the pages named by the page
table (the cached context plus the chunk's own keys/values) and writes the
chunk's keys/values into their cache slots.
It serves whole-prompt prefill, chunked prefill, prefix-cache hits and
decode alike: a decode step is a chunk of length 1.

The pure-JAX path (`_gather_attention`) runs everywhere. Its cost grows with
the pages attended (``P``, a bucketed size), never with the cache's capacity.
On CPU, XLA emits its page gather element by element rather than as block
copies; that gather and the masked softmax over the gathered copy were most
of a batched step (measured on SmolLM2 at batch 32: ~100 ms of a 190 ms decode
step; 0.6 s of a 1.8 s 32 x 128-token bfloat16 prefill). So on the CPU platform
attention goes to a native kernel that reads the pages where they lie
(`jaxinfer/ops/kernels/paged_attention_cpu.cc`), for decode and prefill chunks
alike. The choice is staged with `lax.platform_dependent`, so a GPU or TPU
program never sees the CPU kernel.

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

The kernel is built by `prepare_cpu_kernel` (at model load, with its own
progress line; cached per machine), never inside a jit trace: a trace uses
the kernel only when it is already loaded, else the pure-JAX path.

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
width and pages attended are not a compile key (`reads_row_lengths`). The
pure-JAX path gathers every page in the table, so it keeps page buckets.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops import kernels, mesh
from jaxinfer.ops.attention_pallas import tpu_kernel_fits, tpu_ragged_attention
from jaxinfer.ops.kv_cache import gather_kv, write_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs; all fields are data (none is a compile key).

    positions:  [B, T] int32  absolute position of each query token (-1 for padding).
    slots:      [B, T] int32  flat cache slot its key/value is written to
                              (padding tokens write to the dummy page 0).
    page_table: [B, P] int32  pages each row attends to, padded with page 0.
    kv_lens:    [B]    int32  valid keys per row once this chunk is written.

    The CPU kernel needs only positions and page_table (it finds each slot from
    them and skips padding tokens); the pure-JAX path uses all four.
    """

    positions: jax.Array
    slots: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array


NEG_INF = -1e30


def _write_after_read(cache_layer, k, v, slots, read_value):
    """Write the new keys/values to the cache with a data dependency on the read.

    Without it the read and the in-place update are unordered and XLA copies the
    whole layer first (measured: 30 full-cache copies per CPU decode step); reading
    through the write instead makes XLA fuse the update into the gather, which
    copies too. `read_value` is any element of what was read.
    """
    b, t, kvh, d = k.shape
    after_read = jnp.nan_to_num(read_value.astype(jnp.float32)) * 0.0
    return write_kv(
        cache_layer,
        (k + after_read.astype(k.dtype)).reshape(b * t, kvh, d),
        (v + after_read.astype(v.dtype)).reshape(b * t, kvh, d),
        slots.reshape(-1),
    )


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
    """Attention on one device's heads: the platform's kernel where there is one, else pure JAX."""
    h, kvh, d = q.shape[2], k.shape[2], q.shape[3]
    kernels_by_platform = {}
    if _cpu_kernel_fits(h, kvh, d, cache_layer.dtype) and kernels.ready(CPU_SOURCE):
        kernels_by_platform["cpu"] = lambda *args: _cpu_attention(*args, scale, window)
    if _tpu_kernel_fits(h, kvh, d, cache_layer.shape[1], cache_layer.dtype):
        kernels_by_platform["tpu"] = functools.partial(tpu_ragged_attention, scale=scale, window=window)
    gather = functools.partial(_gather_attention, scale=scale, window=window)
    if not kernels_by_platform:
        return gather(q, k, v, cache_layer, meta)
    return jax.lax.platform_dependent(q, k, v, cache_layer, meta, **kernels_by_platform, default=gather)


def _tpu_kernel_fits(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, cache_dtype) -> bool:
    """Whether to stage the Pallas TPU kernel: a TPU default backend and shapes it takes."""
    return jax.default_backend() == "tpu" and tpu_kernel_fits(num_heads, num_kv_heads, head_dim, page_size,
                                                              cache_dtype)


CPU_TARGET = "jaxinfer_paged_attention"
CPU_SOURCE = "paged_attention_cpu.cc"


def _cpu_kernel_fits(num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype) -> bool:
    """Whether to offer the CPU kernel: a CPU default backend (so GPU and TPU hosts never
    build it) and the shapes and dtypes it takes; anything else uses the pure-JAX path."""
    return (
        jax.default_backend() == "cpu"
        and head_dim in (16, 32, 64, 128, 256)
        and num_heads // num_kv_heads <= 64
        and jnp.dtype(cache_dtype) in (jnp.float32, jnp.bfloat16)
    )


def prepare_cpu_kernel() -> bool:
    """Build (once per machine, then cached on disk) and register the CPU attention kernel.

    Call it before tracing a step (`ModelRunner` does, at load). Returns whether the
    kernel is available; a failed build warns once and the pure-JAX path is used.
    """
    if jax.default_backend() != "cpu" or not kernels.enabled():
        return False
    if not kernels.ready(CPU_SOURCE) and not kernels.tried(CPU_SOURCE):
        from jaxinfer import progress

        title = "loading the CPU attention kernel" if kernels.is_built(CPU_SOURCE) else (
            "building the CPU attention kernel (once per machine)")
        with progress.stage(title):
            kernels.load(CPU_SOURCE, {CPU_TARGET: "JaxinferPagedAttention"})
    return kernels.ready(CPU_SOURCE)


def start_cpu_kernel_build() -> None:
    """Begin building the CPU kernel in the background (a model load calls this first, so the
    once-per-machine compile overlaps reading the weights); `prepare_cpu_kernel` waits for it."""
    if jax.default_backend() == "cpu":
        kernels.build_in_background(CPU_SOURCE)



def reads_row_lengths(num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype, page_size: int) -> bool:
    """Whether steps traced now attend with a kernel (CPU, or Pallas on TPU) that stops at each
    row's length (so the page table can be passed at full width: one program for every length).
    Head counts are one device's."""
    cpu = _cpu_kernel_fits(num_heads, num_kv_heads, head_dim, cache_dtype) and kernels.ready(CPU_SOURCE)
    return cpu or _tpu_kernel_fits(num_heads, num_kv_heads, head_dim, page_size, cache_dtype)


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
    return jax.jvp(functools.partial(_gather_attention, scale=scale, window=window), primals, tangents)


def _gather_attention(q, k, v, cache_layer, meta: AttentionMetadata, scale: float, window: int = 0):
    """The pure-JAX path: gather the attended pages, overlay the chunk, attend, write the chunk."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    # Gather the context, then overlay the chunk's own keys/values on the gathered copy.
    keys, values = gather_kv(cache_layer, meta.page_table)  # [B, S, KVH, D]
    s = keys.shape[1]
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    at = jnp.where(meta.positions >= 0, meta.positions, s)  # padding tokens (position -1) are dropped
    keys = keys.at[rows, at].set(k.astype(keys.dtype), mode="drop")
    values = values.at[rows, at].set(v.astype(values.dtype), mode="drop")
    cache_layer = _write_after_read(cache_layer, k, v, meta.slots, keys[0, 0, 0, 0])
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores * scale
    key_pos = jnp.arange(s, dtype=jnp.int32)
    valid = (key_pos[None, None, :] <= meta.positions[:, :, None]) & (
        key_pos[None, None, :] < meta.kv_lens[:, None, None]
    )  # [B, T, S]
    if window:
        valid = valid & (key_pos[None, None, :] > meta.positions[:, :, None] - window)
    scores = jnp.where(valid[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values.astype(q.dtype))
    return out.reshape(b, t, h, d), cache_layer
