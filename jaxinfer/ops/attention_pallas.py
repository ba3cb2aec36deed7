"""Accelerator attention kernels behind the same contract as the pure-JAX path.

Each adapter here is ``fn(q, k, v, cache_layer, meta, scale, window) -> (out, cache_layer)``
exactly like `jaxinfer.ops.gather_attention.ragged_gather_attention`: q [N, H, D]; k, v [N, KVH, D];
cache_layer [num_pages, page_size, 2*KVH, D] (K at even, V at odd head indices, page 0 a
dummy); meta a `RaggedMetadata`. The step's keys/values are written to ``meta.slots``
first (`kv_cache.write_kv`) and then attended with the cached context.

TPU: `jax.experimental.pallas.ops.tpu.ragged_paged_attention`
--------------------------------------------------------------
Signature (the same in JAX 0.10.2 and 0.11.1)::

    ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
        sm_scale=1.0, sliding_window=None, soft_cap=None, mask_value=DEFAULT_MASK_VALUE,
        k_scale=None, v_scale=None, num_kv_pages_per_block=None,
        num_queries_per_block=None, vmem_limit_bytes=None)

    q            [max_num_batched_tokens, H, D]  every sequence's queries, back to back
    kv_pages     [total_num_pages, page_size, 2*KVH, D]  K at even, V at odd heads
    kv_lens      i32[max_num_seqs]               keys of each sequence (chunk included)
    page_indices i32[max_num_seqs, pages_per_seq]
    cu_q_lens    i32[max_num_seqs + 1]           sequence s owns q[cu[s]:cu[s+1]]
    num_seqs     i32[1]                          how many of the rows above are real

``kv_pages`` is our cache layer as it is: no copy, no reshape. The kernel reads only
attention; it writes nothing, so the adapter writes the chunk first. A sequence's queries
are the *last* ``q_len`` of its ``kv_len`` keys (query i sits at ``kv_len - q_len + i``),
the causal mask follows from that, and ``sliding_window`` masks keys with
``q_pos - window >= k_pos``: the same rule as ours (``q - k < window``). The kernel stops at
each sequence's ``kv_len``, so, like the CPU kernel, it does not need page-table buckets.

Our ragged layout is the kernel's, so the adapter (`tpu_ragged_attention`) passes it as it is:
``cu_q_lens`` = ``meta.query_start``, ``kv_lens`` = ``meta.kv_lens``, ``page_indices`` =
``meta.page_table``, ``sm_scale`` = scale, ``sliding_window`` = window or None, and
``num_seqs`` = the requests with tokens. What the layout must be for it (the ragged step builds it
so; `RaggedMetadata`):

* a request's tokens are its real ones, at consecutive positions ending at ``kv_len - 1``
  (padding tokens only after ``query_start[R]``);
* requests with tokens come first, empty (padding) requests after them. This is required, not
  cosmetic: the kernel prefetches the next sequence's first key block while it finishes a
  sequence, and a sequence with no keys never waits for that copy, so an empty sequence inside
  ``num_seqs`` would shift the double buffer and feed the next sequence stale keys. When every
  request is empty, one dummy sequence (one query, one key, the first page of its table) keeps
  the pipeline balanced.

Padding tokens (``positions < 0``) come out as zeros whatever the kernel left there.

``[B, T]`` rows (`jaxinfer.ops.attention.paged_attention`, the library's prefill and decode
steps) keep a row's padding tokens inside its T, so on TPU they are first packed into that
layout (`rows_as_ragged`: real rows first, their real tokens back to back; a q-sized gather in
and out, `to_ragged` / `from_ragged`).
* Block sizes: the kernel's tuned table for the TPU generation the step's kernel choice names
  (`jaxinfer.ops.backend.KernelChoice.tpu_kind`, decided once on the host or named when lowering
  for a TPU elsewhere: `tpu_block_sizes`), always passed to the kernel explicitly, so the trace
  never reads the devices (the kernel's own lookup reads ``jax.devices()`` and raises
  ``NotImplementedError('TPU version must be 4 or higher.')`` off a TPU); explicit defaults when
  no generation is named (interpret mode).

Constraints (`tpu_kernel_fits`; an unfit shape raises while *tracing*, on any backend, so
check it before staging the TPU branch):

* ``head_dim % 128 == 0``: the kernel keeps its softmax statistics 128 lanes wide and
  broadcasts them over head_dim (``assert shape[1] % arr.shape[1] == 0``). SmolLM2 and
  Qwen2.5-0.5B (head_dim 64) do not fit; Llama 3, Mistral, Gemma 3 (128, 256) do.
* ``2*KVH`` must tile for the cache dtype: with ``packing = 32 // bits`` (1 for float32,
  2 for bfloat16), ``2*KVH % packing == 0`` and ``2*KVH / packing`` in {1, 2, 4, 8} or a
  multiple of 8 (else ``ValueError: Not implemented: num_combined_kv_heads=...``). float32:
  KVH in {1, 2, 4} or a multiple of 4; bfloat16: KVH in {1, 2, 4, 8} or a multiple of 8.
  SmolLM2 (KVH 3) fails here too.
* ``H % KVH == 0``; q and cache dtype float32 or bfloat16 (the quantized-cache scales are
  not wired).
* page_size: no rule in the kernel; its tuned table covers 16..256 (configs/tpu.json uses
  32).
* Not checked here (no batch size in the signature): the page table goes to SMEM as scalar
  prefetch, ``B * P`` int32 next to ``kv_lens`` and ``cu_q_lens``, and SMEM is 1 MiB per
  core on v4 to v6e. 64 rows x 1024 pages is 256 KiB; 256 x 1024 would not fit, so a
  full-width table needs ``B * P * 4`` well under 1 MiB (else keep page buckets).

On CPU the kernel cannot be interpreted by JAX 0.10.2 (nor by the 0.11.1 interpreter code):
TPU interpret mode fails on the kernel's ``ref.reshape`` of its DMA buffer
(``AttributeError: 'ReshapeTransform' object has no attribute 'indices'``), and the generic
HLO interpreter on an integer ``ref.at[i]`` in a masked store
(``AttributeError: 'TypedInt' object has no attribute 'shape'``). ``interpret=True`` is
kept so the tests run it as soon as JAX can; until then the tests check the adapter's
mapping with a jittable stand-in for the kernel (checked against the kernel's own pure-JAX
reference, ``ref_ragged_paged_attention``) passed as ``kernel=``, and lower the real
kernel to a Mosaic TPU program on CPU (an abstract TPU device).

GPU: `jax.experimental.pallas.ops.gpu.paged_attention` and `decode_attention` -- no adapter
--------------------------------------------------------------------------------------------
Decision: neither is wired. The GPU path is our own Pallas kernel for the ragged step's layout as it
is (`jaxinfer.ops.attention_pallas_gpu`, chosen for cuda by `KernelChoice.gpu_attention`); the
reasons JAX's two could not serve follow. Both kernels interpret on
CPU (``interpret=True``), so testing is not the obstacle: the layout is. Both modules are
also deprecated in JAX 0.11 (importing them warns ``... is deprecated.``). The reasons:

* ``paged_attention(q [B, H, D], k_pages, v_pages, block_tables [B, pages], lengths [B])``
  reads ``k_pages`` and ``v_pages`` as two separate arrays ``[KVH, total_pages, page_size,
  D]``: head-major, K and V apart. Our layer is ``[pages, page_size, 2*KVH, D]`` with K/V
  interleaved; ``cache[:, :, 0::2].transpose(2, 0, 1, 3)`` is a strided copy of the whole
  layer, not a view. Per decode step that reads and writes the full cache once per layer:
  ``2 * num_pages * page_size * 2*KVH * D * bytes`` per layer. Llama-3-8B in bfloat16
  holds 128 KiB of K/V per token, so a large cache would move twice its size every step,
  many times what the attention itself reads for a batch of ordinary contexts. That is the
  full-cache copy per step the design forbids
  (cost growing with capacity), and keeping a second, head-major copy doubles memory and
  every write. It also attends one query per row (decode only: no causal mask inside a
  prefill chunk), has no window start (only ``lengths``), and needs ``pages_per_seq``
  divisible by ``k_splits * pages_per_compute_block`` and ``block_h % 16 == 0``.
* The only zero-copy view found is a hack: view the layer as ``[1, pages*page_size*KVH, 1,
  2*D]`` (each row one token's ``[K_h | V_h]``), pass it as both k_pages and v_pages with a
  token-granular block table per (row, KV head) and zero-padded queries ``[q | 0]``, and
  keep the second half of the output. It is exact, but every key and value is read twice
  at double width (2x the bytes and FLOPs of the ideal), pages shrink to one token (a
  table of ``B * KVH * context`` entries per step), and it still covers decode only. Not a
  clean adapter, so not built.
* ``decode_attention.gqa(q [B, H, D], k, v [B, S, KVH, D], start_idx, kv_seq_len)`` reads
  contiguous per-row K/V (it swaps them to ``[B, KVH, S, D]`` itself): an adapter would
  first gather the attended pages into a contiguous copy, which is exactly the gather that
  dominates the pure-JAX path, then transpose that copy again. No full-cache copy, but no
  gain either; decode only as well.

A GPU kernel that reads pages in place needs either a kernel for this layout (the TPU
kernel's layout) or a GPU-specific cache layout in `kv_cache.cache_specs` (and in
`write_kv` / `gather_kv`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxinfer.ops.gather_attention import AttentionMetadata, RaggedMetadata, ragged_gather_attention
from jaxinfer.ops.kv_cache import write_kv

TPU_LANES = 128  # the kernel's softmax statistics are this wide; head_dim must be a multiple
_DEFAULT_KV_TOKENS_PER_BLOCK = 128  # explicit block sizes off a TPU (the kernel's own default
_DEFAULT_QUERIES_PER_BLOCK = 32  # is 128 pages x 32 queries; its v4 default 32 x 32)


# -- TPU: ragged paged attention ------------------------------------------------------------


def tpu_kernel_fits(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype) -> bool:
    """Whether `tpu_ragged_attention` takes these shapes (``dtype``: the cache's, which the
    queries share): the rules in the module docstring, checked here so that an unfit model
    never stages the TPU branch (the kernel raises while tracing it)."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return False
    if num_kv_heads < 1 or num_heads % num_kv_heads or page_size < 1:
        return False
    if head_dim < TPU_LANES or head_dim % TPU_LANES:
        return False
    packing = 32 // (dtype.itemsize * 8)
    combined = 2 * num_kv_heads
    if combined % packing:
        return False
    tiles = combined // packing
    return tiles in (1, 2, 4, 8) or tiles % 8 == 0


def rows_as_ragged(meta: AttentionMetadata) -> tuple[RaggedMetadata, jax.Array]:
    """``[B, T]`` rows as the kernel's ragged layout: (the `RaggedMetadata`, token_index [B, T]).

    Real rows (with a real token) become requests 0..n-1 in their order and padding rows go
    after them; each row's real tokens are packed back to back in row order. ``token_index`` is
    where each row token goes in the flat ``[B*T]`` list (padding tokens: ``B*T``, out of range).
    Each row's real tokens must sit at consecutive positions (the runner's rows do); their count
    is the row's query length and its last position + 1 its kv length.
    """
    positions = meta.positions
    b, t = positions.shape
    i32 = jnp.int32
    valid = positions >= 0
    q_lens = valid.sum(axis=1, dtype=i32)  # [B]
    kv_lens = jnp.where(q_lens > 0, positions.max(axis=1) + 1, 0).astype(i32)
    starts = jnp.cumsum(q_lens, dtype=i32) - q_lens  # each row's first flat token
    rank = jnp.cumsum(valid, axis=1, dtype=i32) - 1  # a real token's index within its row
    token_index = jnp.where(valid, starts[:, None] + rank, b * t).astype(i32)
    order = jnp.argsort(q_lens == 0, stable=True)  # real rows first, in their order
    flat = jnp.full((b * t,), -1, i32).at[token_index.reshape(-1)].set(positions.reshape(-1), mode="drop")
    slots = jnp.zeros((b * t,), i32).at[token_index.reshape(-1)].set(meta.slots.reshape(-1), mode="drop")
    ragged = RaggedMetadata(
        positions=flat,
        slots=slots,
        query_start=jnp.concatenate([jnp.zeros((1,), i32), jnp.cumsum(q_lens[order], dtype=i32)]),
        page_table=meta.page_table[order].astype(i32),
        kv_lens=kv_lens[order],
    )
    return ragged, token_index


def to_ragged(x: jax.Array, token_index: jax.Array) -> jax.Array:
    """[B, T, ...] -> [B*T, ...]: real tokens packed at ``token_index``, the rest zeros."""
    b, t = token_index.shape
    flat = jnp.zeros((b * t,) + x.shape[2:], x.dtype)
    return flat.at[token_index.reshape(-1)].set(x.reshape((b * t,) + x.shape[2:]), mode="drop")


def from_ragged(y: jax.Array, token_index: jax.Array) -> jax.Array:
    """[N, ...] -> [B, T, ...]: each real token's row of ``y``; padding tokens get zeros."""
    b, t = token_index.shape
    n = y.shape[0]
    picked = y[jnp.clip(token_index, 0, n - 1)]  # [B, T, ...]
    valid = (token_index < min(n, b * t)).reshape((b, t) + (1,) * (y.ndim - 1))
    return jnp.where(valid, picked, jnp.zeros((), y.dtype))


def kernel_sequences(meta: RaggedMetadata) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(cu_q_lens [R + 1], kv_lens [R], num_seqs [1]) for the kernel: the metadata's own, with
    ``num_seqs`` the requests with tokens (they come first), and, when there is none, one dummy
    sequence of one query and one key (the kernel's pipeline needs a sequence to run)."""
    i32 = jnp.int32
    qs = meta.query_start.astype(i32)
    real = (qs[1:] > qs[:-1]).sum(dtype=i32)
    none = real == 0
    dummy_cu = jnp.minimum(jnp.arange(qs.shape[0], dtype=i32), 1)  # [0, 1, 1, ...]
    cu_q_lens = jnp.where(none, dummy_cu, qs)
    kv_lens = meta.kv_lens.astype(i32).at[0].set(jnp.where(none, 1, meta.kv_lens[0]))
    return cu_q_lens, kv_lens, jnp.maximum(real, 1).reshape(1)


def tpu_generation(tpu_kind: str) -> int:
    """The TPU generation a device kind names ("TPU v5 lite" -> 5, "TPU v5p" -> 5, "TPU7x" -> 7);
    -1 for "" (none named)."""
    digits = "".join(c if c.isdigit() else " " for c in tpu_kind).split()
    return int(digits[0]) if tpu_kind and digits else -1


def tpu_block_sizes(tpu_kind: str, q_dtype, kv_dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                    page_size: int, num_tokens: int, pages_per_seq: int) -> tuple[int, int]:
    """(kv pages, queries) per block of the Pallas kernel on the TPU ``tpu_kind`` names: the kernel's
    tuned table for that device, looked up here from the kernel choice's value instead of by the kernel
    from ``jax.devices()`` while tracing; "" (no TPU named): the explicit defaults."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned

    generation = tpu_generation(tpu_kind)
    if generation < 4:  # none named (the kernel has no tuned sizes below v4 either)
        return (max(1, min(pages_per_seq, _DEFAULT_KV_TOKENS_PER_BLOCK // page_size)),
                min(num_tokens, _DEFAULT_QUERIES_PER_BLOCK))
    heads_blk, combined_blk = rpa.get_min_heads_per_blk(num_heads, 2 * num_kv_heads, q_dtype, kv_dtype)
    key = tuned.simplify_key((q_dtype, kv_dtype, heads_blk, combined_blk // 2, head_dim, page_size, num_tokens,
                              pages_per_seq))
    bkv, bq = (32, 32) if generation == 4 else (128, 32)
    if generation > 4:
        bkv, bq = tuned.TUNED_BLOCK_SIZES.get(" ".join(tpu_kind.split()[:2]), {}).get(key, (bkv, bq))
    return min(pages_per_seq, bkv), min(num_tokens, bq)


def pallas_tpu_kernel(
    *,
    page_size: int,
    pages_per_seq: int,
    num_tokens: int,
    interpret: Any = False,
    num_kv_pages_per_block: Optional[int] = None,
    num_queries_per_block: Optional[int] = None,
    vmem_limit_bytes: Optional[int] = None,
) -> Callable:
    """The Pallas kernel with its block sizes bound, optionally under TPU interpret mode.

    ``interpret``: False, True (``pltpu.InterpretParams()``) or an ``InterpretParams``.
    Block sizes left None are explicit defaults (``128 // page_size`` pages and 32 queries, capped
    by the shapes; `tpu_block_sizes` gives a TPU generation's tuned ones): the kernel is never left
    to read the devices while it is traced.
    """
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    if num_kv_pages_per_block is None:
        num_kv_pages_per_block = max(1, min(pages_per_seq, _DEFAULT_KV_TOKENS_PER_BLOCK // page_size))
    if num_queries_per_block is None:
        num_queries_per_block = min(num_tokens, _DEFAULT_QUERIES_PER_BLOCK)
    call = functools.partial(
        ragged_paged_attention,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )
    if not interpret:
        return call
    params = interpret if isinstance(interpret, pltpu.InterpretParams) else pltpu.InterpretParams()

    def interpreted(*args, **kwargs):
        with pltpu.force_tpu_interpret_mode(params):
            return call(*args, **kwargs)

    return interpreted


def tpu_ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_layer: jax.Array,
    meta: RaggedMetadata,
    scale: float,
    window: int = 0,
    *,
    interpret: Any = False,
    num_kv_pages_per_block: Optional[int] = None,
    num_queries_per_block: Optional[int] = None,
    vmem_limit_bytes: Optional[int] = None,
    kernel: Optional[Callable] = None,
    tpu_kind: str = "",
) -> tuple[jax.Array, jax.Array]:
    """TPU attention over the paged cache with Pallas ragged paged attention, fed our ragged layout.

    Same contract as `ragged_gather_attention`, with the layout rules in the module docstring; the
    shapes must pass `tpu_kernel_fits`. Writes the step's keys/values to ``meta.slots``, then
    attends. ``interpret`` runs the kernel in TPU interpret mode (CPU); block sizes left None are the
    tuned ones of the TPU ``tpu_kind`` names (the step's `KernelChoice.tpu_kind`; `tpu_block_sizes`).
    ``kernel`` replaces the Pallas call by any function with its signature
    and keywords ``sm_scale``, ``sliding_window`` (the tests pass a pure-JAX stand-in).
    Differentiating it differentiates the pure-JAX path (the Pallas kernel has no derivative rule).
    Returns (out [N, H, D], updated cache_layer).
    """
    n, h, d = q.shape
    if meta.positions.shape != (n,) or meta.slots.shape != (n,):
        raise ValueError(f"positions and slots must be [N] = ({n},), got {meta.positions.shape} and {meta.slots.shape}")
    if kernel is None:
        tuned = tpu_block_sizes(tpu_kind, q.dtype, cache_layer.dtype, h, cache_layer.shape[2] // 2, d,
                                cache_layer.shape[1], n, meta.page_table.shape[1])
        num_kv_pages_per_block = num_kv_pages_per_block or tuned[0]
        num_queries_per_block = num_queries_per_block or tuned[1]
        kernel = pallas_tpu_kernel(
            page_size=cache_layer.shape[1],
            pages_per_seq=meta.page_table.shape[1],
            num_tokens=n,
            interpret=interpret,
            num_kv_pages_per_block=num_kv_pages_per_block,
            num_queries_per_block=num_queries_per_block,
            vmem_limit_bytes=vmem_limit_bytes,
        )
    return _ragged_attention(q, k, v, cache_layer, meta, float(scale), int(window), kernel)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6, 7))
def _ragged_attention(q, k, v, cache_layer, meta: RaggedMetadata, scale: float, window: int, kernel: Callable):
    cache_layer = write_kv(cache_layer, k, v, meta.slots)
    cu_q_lens, kv_lens, num_seqs = kernel_sequences(meta)
    out = kernel(
        q,
        cache_layer,
        kv_lens,
        meta.page_table.astype(jnp.int32),
        cu_q_lens,
        num_seqs,
        sm_scale=scale,
        sliding_window=window if window > 0 else None,
    )
    # Tokens past the real ones hold whatever the kernel left there (scratch; NaN in interpret
    # mode): selected away, never multiplied.
    real = (meta.positions >= 0)[:, None, None]
    return jnp.where(real, out, jnp.zeros((), out.dtype)).astype(q.dtype), cache_layer


@_ragged_attention.defjvp
def _ragged_attention_jvp(scale, window, kernel, primals, tangents):
    return jax.jvp(functools.partial(ragged_gather_attention, scale=scale, window=window), primals, tangents)
