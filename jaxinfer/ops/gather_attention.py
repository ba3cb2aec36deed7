"""The pure-JAX paged attention every platform can run, and the metadata every attention takes.

`gather_attention` gathers the pages a chunk attends, overlays the chunk's own keys and values on
the gathered copy, attends, and writes the chunk into its cache slots. It is the path where no
kernel takes the shapes (`jaxinfer.ops.attention`), the derivative of the kernels (the CPU
kernel's and the Pallas TPU one's, which compute the same function), and the contract the kernel
adapters follow (`jaxinfer.ops.attention_pallas`). Both import it from here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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


def write_after_read(cache_layer, k, v, slots, read_value):
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


def gather_attention(q, k, v, cache_layer, meta: AttentionMetadata, scale: float, window: int = 0):
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
    cache_layer = write_after_read(cache_layer, k, v, meta.slots, keys[0, 0, 0, 0])
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
