"""Ragged paged attention for NVIDIA GPUs in Pallas (the Triton lowering): the engine's ragged step as it is.

`gpu_ragged_attention` has the contract of `jaxinfer.ops.gather_attention.ragged_gather_attention`:
q [N, H, D]; k, v [N, KVH, D]; cache_layer [num_pages, page_size, 2*KVH, D] (K at even, V at odd head
indices, page 0 a dummy); meta a `RaggedMetadata`. It writes the step's keys/values into their slots
(`kv_cache.write_kv`, a scatter into the donated cache), then one ``pallas_call`` attends every token of
the step: decode rows and prefill chunks in one launch. Returns (out [N, H, D], the updated cache).

The launch
----------
The step's tokens are cut into work items (`gather_attention.work_items`): up to ``TQ`` consecutive tokens
of one request, cut at every multiple of ``TQ`` and at every request's start, so an item is a (request,
query tile) pair and the grid is ``(items, KV heads)``: the grid over (request, KV head, query tile) with
the requests' ragged tiles flattened into one axis (no empty programs for short requests). A program
holds its tile's tokens times the KV head's query heads (GQA: the ``g = H / KVH`` heads of a KV head
together, padded to a power of two, ``GP``) as one ``[TQ * GP, D]`` tile and walks the request's key blocks
with an online softmax.

Keys are read where they lie: the cache is passed whole (never copied or reshaped) with a block spec that
picks the KV head's K row (index ``2h``) or V row (``2h + 1``) of every slot, and a block of ``PPB`` pages is
read through the request's page table (``cache[pages]``, a pointer gather in Triton). The page table, the
items' request and block range, and the tokens' positions are small int32 arrays read by scalar index.

Batch invariance by construction
--------------------------------
Every output element is computed in one order whatever the batch, the chunking or the split:

* key blocks are fixed by absolute position: block j holds positions ``j * BK .. j * BK + BK - 1``
  (``BK = PPB * page_size``, a function of the page size only), and a tile walks blocks in increasing j;
* the tile shapes (``TQ * GP`` rows, ``BK`` keys, ``D``) are constants of the model's shapes, never of the
  step's: a row's q.k and p.v products are the same instruction sequence whichever rows share its tile;
* a block that holds no key of a row (it lies before the row's window or past its position, because
  another token of the tile needs it) leaves that row's state bit for bit unchanged: its scores are
  masked, its maximum stays, its correction is exp(0) = 1, its weights are exactly 0;
* there is no split of the keys (no split-K): one program reduces all of a row's blocks in order. A split
  for long contexts at small batch would have to be fixed by position too; none is made.

Causal masking and sliding windows go by each token's absolute position: a token at p attends keys
``max(0, p - window + 1) .. p`` (``window`` 0: from 0); padding tokens (position -1) attend nothing and come
out as zeros. Soft-capping (``softcap`` > 0: scores ``cap * tanh(s / cap)``, Gemma 2's rule) is supported by
the kernel; no family in the engine passes one today (`jaxinfer.ops.attention` does not).

Fit (`gpu_kernel_fits`): a float32 or bfloat16 cache; head_dim a power of two from 16 to 256 and page_size a
power of two (Triton's block shapes are powers of two); ``H % KVH == 0`` with ``H / KVH <= 64``. Others
(and the latent cache of multi-head latent attention, which is not this layout) take the pure-JAX path:
`jaxinfer.ops.attention` keeps `latent_paged_attention` on `ragged_gather_attention` on GPU.

Precision: products are accumulated in float32; float32 operands go to Triton's dot at the step's
``matmul_precision`` (None: the platform's default, TF32 on NVIDIA; ``HIGHEST``: full float32).

Proven without a GPU: `interpret=True` runs the same kernel body on CPU (tests/test_pallas_gpu_attention.py,
against a float64 reference and bitwise across batches and chunkings; `KernelChoice.gpu_interpret` runs a cuda
program's attention so on a CPU host), and the step lowered for cuda calls it as a Triton custom call
(`jaxinfer.tools.lowering.has_pallas_gpu_attention`; tests/test_cross_lowering.py) with one Triton program
(the same dots and key loop) for every step shape. Interpret mode cannot show the GPU's own orders (XLA:CPU
computes a row the same whatever its tile); the fixed tile shapes in the Triton module are what carry that.

Not done yet (no GPU has run it): the tile sizes (`ROWS`, `BLOCK_TOKENS`, warps, stages) are unmeasured
choices; a long context at a small batch runs only ``items x KV heads`` programs (batch-1 decode of Llama-3-8B:
8), which a split of the keys fixed by position (chunks of a constant number of blocks, partial softmax states
merged in chunk order) would spread over the GPU without losing invariance; it is not built.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.ops.gather_attention import RaggedMetadata, ragged_gather_attention, request_of_token, work_items
from jaxinfer.ops.kv_cache import write_kv

KERNEL_NAME = "jaxinfer_ragged_paged_attention"  # the Pallas call's name (in the Triton custom call)
ROWS = 64  # query rows of a tile: TQ tokens x GP heads (fixed, so a row's products never depend on the batch)
BLOCK_TOKENS = 64  # keys per block (at least one page): fixed by the page size, never by the step
NEG = -1e30  # a masked score; finite, so a row that has seen no key yet never computes inf - inf
NUM_WARPS = 4
NUM_STAGES = 2


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def group_pad(num_heads: int, num_kv_heads: int) -> int:
    """GP: a KV head's query heads, padded to a power of two (Triton's block shapes)."""
    return _next_pow2(num_heads // num_kv_heads)


def query_tile(num_heads: int, num_kv_heads: int) -> int:
    """TQ: tokens per tile, so that a tile holds `ROWS` query rows (at least one token)."""
    return max(1, ROWS // group_pad(num_heads, num_kv_heads))


def pages_per_block(page_size: int) -> int:
    """PPB: pages per key block, `BLOCK_TOKENS` keys (at least one page)."""
    return max(1, BLOCK_TOKENS // page_size)


def gpu_kernel_fits(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype) -> bool:
    """Whether `gpu_ragged_attention` takes these shapes (one device's heads; ``dtype`` the cache's)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return False
    if num_kv_heads < 1 or num_heads % num_kv_heads or num_heads // num_kv_heads > 64:
        return False
    return _pow2(head_dim) and 16 <= head_dim <= 256 and _pow2(page_size)


def _kernel(item_ref, table_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float, window: int,
            softcap: Optional[float], ppb: int, precision):
    """One (work item, KV head): q_ref [TQ, GP, D]; k_ref, v_ref [num_pages, page_size, D] (the KV head's K
    or V row of every slot); pos_ref [TQ] (-1: no token); item_ref [I, 3] (request, first block, last
    block); table_ref [R, blocks * PPB]; o_ref [TQ, GP, D]."""
    i = pl_program_id(0)
    tq, gp, d = q_ref.shape
    ps = k_ref.shape[1]
    bk = ppb * ps
    rows = tq * gp
    req, blk_lo, blk_hi = item_ref[i, 0], item_ref[i, 1], item_ref[i, 2]
    q = q_ref[...].reshape(rows, d)
    pos = jnp.broadcast_to(pos_ref[...][:, None], (tq, gp)).reshape(rows, 1)  # each row's token position
    lo = jnp.maximum(pos - window + 1, 0) if window > 0 else jnp.zeros_like(pos)
    f32 = jnp.float32

    def body(j, carry):
        m, l, acc = carry
        pages = table_ref[req, pl_ds(j * ppb, ppb)]  # [PPB]
        keys = k_ref[pages].reshape(bk, d).astype(q.dtype)
        values = v_ref[pages].reshape(bk, d).astype(q.dtype)
        s = pl_dot(q, keys, trans_b=True, precision=precision) * scale  # [rows, BK] float32
        if softcap:
            s = jnp.tanh(s / softcap) * softcap
        key_pos = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        valid = (key_pos <= pos) & (key_pos >= lo)  # [rows, BK]; pos -1 attends nothing
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        w = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        c = jnp.exp(m - m_new)
        l = l * c + jnp.sum(w, axis=1, keepdims=True)
        acc = acc * c + pl_dot(w.astype(q.dtype), values, precision=precision)
        return m_new, l, acc

    carry = (jnp.full((rows, 1), NEG, f32), jnp.zeros((rows, 1), f32), jnp.zeros((rows, d), f32))
    _, l, acc = lax.fori_loop(blk_lo, blk_hi + 1, body, carry)
    out = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
    o_ref[...] = out.reshape(tq, gp, d).astype(o_ref.dtype)


def pl_program_id(axis: int):
    from jax.experimental import pallas as pl  # imported when a kernel is traced, not with the package
    return pl.program_id(axis)


def pl_ds(start, size: int):
    from jax.experimental import pallas as pl
    return pl.ds(start, size)


def pl_dot(a, b, trans_b: bool = False, precision=None):
    """``a @ b`` (``b.T`` with ``trans_b``) accumulated in float32: what Pallas' own ``dot`` stages (a
    dot_general Triton lowers to ``tt.dot``), written here because JAX moves that helper between modules."""
    return lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _compiler_params():
    from jax.experimental.pallas import triton as plgpu
    params = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")  # 0.10 / older
    return params(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def gpu_ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_layer: jax.Array,
    meta: RaggedMetadata,
    scale: float,
    window: int = 0,
    *,
    softcap: Optional[float] = None,
    precision: Any = None,
    interpret: bool = False,
    debug: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """GPU attention over the paged cache with the Pallas (Triton) kernel of this module; the contract of
    `ragged_gather_attention`. The shapes must pass `gpu_kernel_fits`. ``precision``: the products' (None or
    ``lax.Precision.HIGHEST``); ``interpret``: run the kernel body on CPU (Pallas interpret mode); ``debug``:
    Pallas prints the kernel's jaxpr and, when lowered for cuda, its Triton module (the tests read it).
    Differentiating it differentiates the pure-JAX path (the kernel has no derivative rule)."""
    n, h, d = q.shape
    kvh = k.shape[1]
    if not gpu_kernel_fits(h, kvh, d, cache_layer.shape[1], cache_layer.dtype):
        raise ValueError(f"the Pallas GPU attention does not take H={h}, KVH={kvh}, D={d}, "
                         f"page_size={cache_layer.shape[1]}, cache {cache_layer.dtype} (gpu_kernel_fits)")
    if meta.positions.shape != (n,) or meta.slots.shape != (n,):
        raise ValueError(f"positions and slots must be [N] = ({n},), got {meta.positions.shape} and {meta.slots.shape}")
    return _attention(q, k, v, cache_layer, meta, float(scale), int(window), float(softcap or 0.0), precision,
                      bool(interpret), bool(debug))


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _attention(q, k, v, cache_layer, meta: RaggedMetadata, scale: float, window: int, softcap: float, precision,
               interpret: bool, debug: bool):
    from jax.experimental import pallas as pl

    cache_layer = write_kv(cache_layer, k, v, meta.slots)
    n, h, d = q.shape
    kvh = k.shape[1]
    g, gp = h // kvh, group_pad(h, kvh)
    tq = query_tile(h, kvh)
    ps = cache_layer.shape[1]
    ppb = pages_per_block(ps)
    bk = ppb * ps
    p = meta.page_table.shape[1]
    i32 = jnp.int32

    # work items: up to TQ consecutive tokens of one request (`work_items`), their tokens' positions
    start, end, ni = work_items(meta.query_start, n, tq)
    tok = start[:, None] + jnp.arange(tq, dtype=i32)[None, :]  # [I, TQ]
    real = tok < end[:, None]
    at = jnp.minimum(tok, n - 1)
    pos = jnp.where(real, meta.positions[at], -1).astype(i32)  # [I, TQ]
    lo = jnp.maximum(pos - window + 1, 0) if window > 0 else jnp.zeros_like(pos)
    last = jnp.max(pos, axis=1)  # -1 for an empty item
    first = jnp.min(jnp.where(pos >= 0, lo, jnp.iinfo(i32).max), axis=1)
    req = request_of_token(meta.query_start, jnp.minimum(start, n - 1))
    blk_lo = jnp.where(last >= 0, first // bk, 0)
    blk_hi = jnp.where(last >= 0, last // bk, -1)  # empty items walk no block
    items = jnp.stack([req, blk_lo, blk_hi], axis=1).astype(i32)  # [I, 3]
    nblocks = -(-p // ppb)
    table = jnp.pad(meta.page_table.astype(i32), ((0, 0), (0, nblocks * ppb - p)))  # [R, blocks * PPB]

    qi = jnp.where(real[..., None, None], q[at], jnp.zeros((), q.dtype)).reshape(ni, tq, kvh, g, d)
    if gp != g:
        qi = jnp.pad(qi, ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0)))

    num_pages = cache_layer.shape[0]
    kernel = functools.partial(_kernel, scale=scale, window=window, softcap=softcap or None, ppb=ppb,
                               precision=precision)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(ni, kvh),
        in_specs=[
            whole(items.shape),  # small int32 tables, indexed by the kernel
            whole(table.shape),
            pl.BlockSpec((None, tq), lambda i, j: (i, 0)),
            pl.BlockSpec((None, tq, None, gp, d), lambda i, j: (i, 0, j, 0, 0)),
            pl.BlockSpec((num_pages, ps, None, d), lambda i, j: (0, 0, 2 * j, 0)),  # K of KV head j
            pl.BlockSpec((num_pages, ps, None, d), lambda i, j: (0, 0, 2 * j + 1, 0)),  # V of KV head j
        ],
        out_specs=pl.BlockSpec((None, tq, None, gp, d), lambda i, j: (i, 0, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((ni, tq, kvh, gp, d), q.dtype),
        compiler_params=_compiler_params(),
        interpret=interpret,
        debug=debug,
        name=KERNEL_NAME,
    )(items, table, pos, qi, cache_layer, cache_layer)
    out = out[:, :, :, :g].reshape(ni * tq, h, d)
    out = jnp.zeros((n, h, d), q.dtype).at[jnp.where(real, tok, n).reshape(-1)].set(out, mode="drop")
    return out, cache_layer


@_attention.defjvp
def _attention_jvp(scale, window, softcap, precision, interpret, debug, primals, tangents):
    if softcap:
        raise NotImplementedError("derivatives of soft-capped Pallas GPU attention")
    return jax.jvp(functools.partial(ragged_gather_attention, scale=scale, window=window), primals, tangents)
