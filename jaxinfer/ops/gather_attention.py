"""The pure-JAX paged attention every platform can run, and the metadata every attention takes.

`ragged_gather_attention` attends a *ragged* batch (`RaggedMetadata`: every token of every request
in one flat list, with per-request offsets, page tables and lengths) over the paged cache. It is
the path where no kernel takes the shapes (`jaxinfer.ops.attention`), the derivative of the kernels
(the CPU kernel's and the Pallas TPU one's, which compute the same function), and the contract the
kernel adapters follow (`jaxinfer.ops.attention_pallas`). `gather_attention` is the same function
over ``[B, T]`` rows (`AttentionMetadata`), each row a request.

How it reads the cache: the page columns of the table are read in blocks of a few columns (each
token reads its own request's page of each column, ``page_table[request_of_token, j]``), with an
online softmax across blocks; the step's own keys/values are laid over what was read (the cache
still holds the old contents of their slots), and written into their slots after the read
(`write_after_read`). No
``[N, P * page_size, KVH, D]`` copy is ever made for a large step: the block is sized to a fixed
budget of bytes, and blocks past every token's position (or before every token's window) are
skipped at run time (`lax.cond`), so a wide page bucket costs little more than the context attended.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.ops.kv_cache import write_kv, write_latent


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedMetadata:
    """A ragged step's attention inputs; all fields are data (none is a compile key).

    positions:   [N]      int32  absolute position of each token; -1: a padding token (not written,
                                 output zeros).
    slots:       [N]      int32  flat cache slot its key/value is written to (padding: a slot of the
                                 dummy page 0).
    query_start: [R + 1]  int32  token offsets: request r owns tokens query_start[r] ..
                                 query_start[r+1] - 1 (non-decreasing; a padding request has an empty
                                 segment; tokens after query_start[R] are padding).
    page_table:  [R, P]   int32  pages of each request, in order, padded with page 0.
    kv_lens:     [R]      int32  valid keys of each request once this step's tokens are written.

    A token at position p attends its own request's keys 0..p (with a window w > 0: p - w + 1 .. p).
    A segment's real tokens are consecutive positions ending at kv_len - 1 (the Pallas TPU kernel
    places them by that; the CPU kernel and the pure-JAX path go by ``positions``). For the TPU
    kernel, requests with tokens come first and empty (padding) requests after them.
    """

    positions: jax.Array
    slots: jax.Array
    query_start: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs of ``[B, T]`` rows (each row a request); all fields are data.

    positions:  [B, T] int32  absolute position of each query token (-1 for padding).
    slots:      [B, T] int32  flat cache slot its key/value is written to
                              (padding tokens write to the dummy page 0).
    page_table: [B, P] int32  pages each row attends to, padded with page 0.
    kv_lens:    [B]    int32  valid keys per row once this chunk is written.

    `ragged` gives the same step as a `RaggedMetadata`: B requests of T tokens each.
    """

    positions: jax.Array
    slots: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array

    def ragged(self) -> RaggedMetadata:
        """The rows as a ragged batch: request b owns tokens b*T .. b*T + T - 1 (its padding tokens
        keep position -1)."""
        b, t = self.positions.shape
        return RaggedMetadata(
            positions=jnp.reshape(self.positions, (b * t,)),
            slots=jnp.reshape(self.slots, (b * t,)),
            query_start=jnp.arange(b + 1, dtype=jnp.int32) * t,
            page_table=self.page_table,
            kv_lens=self.kv_lens,
        )


NEG_INF = -1e30
# Bytes of one block of page columns (the gathered keys and values of every token, and its scores).
BLOCK_BYTES = 8 << 20


def write_after_read(cache_layer, k, v, slots, read_value):
    """Write the new keys/values to the cache with a data dependency on the read.

    Without it the read and the in-place update are unordered and XLA copies the
    whole layer first. `read_value` is any element of what was read. k, v: [..., KVH, D];
    slots: the same leading shape. ``v`` None: a latent cache, ``k`` its entries [..., 1, D].
    """
    kvh, d = k.shape[-2:]
    after_read = jnp.nan_to_num(read_value.astype(jnp.float32)) * 0.0
    if v is None:
        return write_latent(cache_layer, (k + after_read.astype(k.dtype)).reshape(-1, kvh, d), slots.reshape(-1))
    return write_kv(
        cache_layer,
        (k + after_read.astype(k.dtype)).reshape(-1, kvh, d),
        (v + after_read.astype(v.dtype)).reshape(-1, kvh, d),
        slots.reshape(-1),
    )


def request_of_token(query_start: jax.Array, tokens: jax.Array) -> jax.Array:
    """The request whose segment holds each of ``tokens`` (int32 indices; past every segment: the last
    request, whose they are not: they are padding)."""
    r = query_start.shape[0] - 1
    return jnp.clip(jnp.searchsorted(query_start[1:], tokens, side="right"), 0, r - 1).astype(jnp.int32)


def tile_tokens(num_tokens: int, num_requests: int) -> int:
    """Query tokens per work item: about half a request's share of the step (a power of two, 1 to 128),
    so decode rows go one token an item and long chunks share each page read among many tokens."""
    share = max(1, num_tokens // (2 * max(num_requests, 1)))
    return min(128, 1 << (share.bit_length() - 1))


def work_items(query_start: jax.Array, num_tokens: int, tile: int) -> tuple[jax.Array, jax.Array, int]:
    """The step's tokens cut into items, each up to ``tile`` consecutive tokens of one request: cuts at
    every multiple of ``tile`` and at every request's start. Returns (start [I], end [I], I): the items
    with tokens first, then empty ones (start = end = N); I is the most a step of this shape can need."""
    r = query_start.shape[0] - 1
    n_items = min(num_tokens, -(-num_tokens // tile) + r - 1)
    cuts = jnp.sort(jnp.concatenate([jnp.arange(0, num_tokens, tile, dtype=jnp.int32),
                                     jnp.clip(query_start, 0, num_tokens).astype(jnp.int32)]))
    lo, hi = cuts[:-1], cuts[1:]
    real = (hi > lo) & (lo >= query_start[0]) & (lo < query_start[r])
    at = jnp.where(real, jnp.cumsum(real, dtype=jnp.int32) - 1, n_items)
    start = jnp.full((n_items,), num_tokens, jnp.int32).at[at].set(lo, mode="drop")
    end = jnp.full((n_items,), num_tokens, jnp.int32).at[at].set(hi, mode="drop")
    return start, end, n_items


def columns_per_block(items: int, tile: int, pages: int, page_size: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, cache_itemsize: int) -> int:
    """Page columns read per block: as many as fit `BLOCK_BYTES` (at least one, at most all)."""
    per_column = items * page_size * (2 * num_kv_heads * head_dim * cache_itemsize + 2 * num_heads * tile * 4)
    return max(1, min(pages, BLOCK_BYTES // max(per_column, 1)))


def ragged_gather_attention(q, k, v, cache_layer, meta: RaggedMetadata, scale: float, window: int = 0,
                            value_dim: int = 0):
    """The pure-JAX path over a ragged batch: attend, then write the step's keys/values.

    q: [N, H, D]; k, v: [N, KVH, D]; cache_layer: [num_pages, page_size, 2*KVH, D].
    Returns (out [N, H, D], updated cache_layer); padding tokens come out as zeros.

    A latent cache (multi-head latent attention, `jaxinfer.ops.kv_cache`): ``v`` None, ``k`` the step's
    entries [N, 1, D], cache_layer [num_pages, page_size, 1, D]; every head's key is the whole entry and
    its value the entry's first ``value_dim`` values: out [N, H, value_dim].

    Work items are (request, up to `tile_tokens` of its consecutive tokens) (`work_items`); each
    reads its request's pages a block of columns at a time, with an online softmax.
    """
    n, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    latent = v is None
    dv = value_dim if latent else d
    parts = 1 if latent else 2  # rows of a token's entry per KV head: the latent, or a key and a value
    ps = cache_layer.shape[1]
    r, p = meta.page_table.shape
    f32 = jnp.float32
    tile = tile_tokens(n, r)
    start, end, ni = work_items(meta.query_start, n, tile)
    tok = start[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]  # [I, tile]
    real = tok < end[:, None]
    tok = jnp.where(real, tok, n)  # n: out of range (dropped on the way out)
    at = jnp.minimum(tok, n - 1)
    pos = jnp.where(real, meta.positions[at], -1)  # [I, tile]; -1: attends nothing
    lo = jnp.maximum(pos - window + 1, 0) if window > 0 else jnp.zeros_like(pos)
    req = request_of_token(meta.query_start, jnp.minimum(start, n - 1))  # [I]
    # The step's own keys, laid over what is read: the request's tokens sit at consecutive positions
    # from its segment's first token, token query_start[r] + (key position - first position).
    seg_start = meta.query_start[req]  # [I]
    seg_first = meta.positions[jnp.clip(seg_start, 0, n - 1)]  # [I]
    seg_last = jnp.max(pos, axis=1)  # [I]: the item's last position (no key after it is attended)
    cols = columns_per_block(ni, tile, p, ps, h, kvh, d, cache_layer.dtype.itemsize)
    nblocks = -(-p // cols)
    table = meta.page_table[req]  # [I, P] int32
    table = jnp.pad(table, ((0, 0), (0, nblocks * cols - p)))
    table = table.reshape(ni, nblocks, cols).transpose(1, 0, 2)  # [blocks, I, cols]
    span = cols * ps
    qg = q[at].reshape(ni, tile, kvh, g, d)
    kv_new = (k[:, :, None] if latent else jnp.stack([k, v], axis=2)).astype(cache_layer.dtype)  # as the cache holds it
    last = jnp.max(pos)  # keys past it are no token's
    first = jnp.min(jnp.where(pos >= 0, lo, jnp.iinfo(jnp.int32).max))

    def attend_block(carry, block_start, pages):
        m, l, acc = carry
        kv = cache_layer[pages].reshape(ni, span, kvh, parts, d)  # [I, span, KVH, 2 (or 1), D]
        key_pos = block_start + jnp.arange(span, dtype=jnp.int32)
        own = (key_pos[None, :] >= seg_first[:, None]) & (key_pos[None, :] <= seg_last[:, None])  # [I, span]
        src = jnp.clip(seg_start[:, None] + key_pos[None, :] - seg_first[:, None], 0, n - 1)
        kv = jnp.where(own[:, :, None, None, None], kv_new[src], kv)
        keys, values = kv[..., 0, :].astype(q.dtype), kv[..., parts - 1, :dv].astype(q.dtype)
        s = jnp.einsum("itkgd,iskd->ikgts", qg, keys, preferred_element_type=f32) * scale
        valid = (key_pos[None, None, :] <= pos[:, :, None]) & (key_pos[None, None, :] >= lo[:, :, None])
        valid = valid[:, None, None, :, :]  # [I, 1, 1, tile, span]
        s = jnp.where(valid, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        w = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
        c = jnp.exp(m - m_new)
        l = l * c + w.sum(axis=-1)
        acc = acc * c[..., None] + jnp.einsum("ikgts,iskd->ikgtd", w.astype(q.dtype), values,
                                              preferred_element_type=f32)
        return m_new, l, acc

    def step(carry, xs):
        i, pages = xs
        block_start = i * span
        needed = (block_start <= last) & (block_start + span > first)
        return jax.lax.cond(needed, lambda c: attend_block(c, block_start, pages), lambda c: c, carry), None

    stats = (ni, kvh, g, tile)
    carry = (jnp.full(stats, NEG_INF, f32), jnp.zeros(stats, f32), jnp.zeros(stats + (dv,), f32))
    if nblocks == 1:
        m, l, acc = attend_block(carry, 0, table[0])
    else:
        (m, l, acc), _ = jax.lax.scan(step, carry, (jnp.arange(nblocks, dtype=jnp.int32), table))
    out = acc * jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)[..., None]  # [I, KVH, g, tile, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(ni * tile, h, dv).astype(q.dtype)
    out = jnp.zeros((n, h, dv), q.dtype).at[tok.reshape(-1)].set(out, mode="drop")
    cache_layer = write_after_read(cache_layer, k, v, meta.slots, acc[0, 0, 0, 0, 0])
    return out, cache_layer


def gather_attention(q, k, v, cache_layer, meta: AttentionMetadata, scale: float, window: int = 0):
    """`ragged_gather_attention` over ``[B, T]`` rows: q [B, T, H, D]; k, v [B, T, KVH, D]."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    out, cache_layer = ragged_gather_attention(
        q.reshape(b * t, h, d), k.reshape(b * t, kvh, d), v.reshape(b * t, kvh, d), cache_layer, meta.ragged(),
        scale, window)
    return out.reshape(b, t, h, d), cache_layer
