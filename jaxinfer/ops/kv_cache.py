"""The paged KV cache: a preallocated pytree of pages, one array per layer.

Each layer's array has shape ``[num_pages, page_size, 2 * num_kv_heads, head_dim]``
with K at even and V at odd head indices (the layout the Pallas TPU
``ragged_paged_attention`` kernel reads). Page 0 is a reserved dummy page:
padding tokens write there and padded page-table entries point there, so the
device code never needs a data-dependent branch.

A sequence's token at position ``p`` lives in page ``page_table[p // page_size]``
at offset ``p % page_size``; its flat *slot* is ``page * page_size + offset``.
Page tables and free lists live on the host (`jaxinfer.engine.page_allocator`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.ops.spec import ArraySpec

KVCache = list  # list[jax.Array], one [num_pages, page_size, 2*num_kv_heads, head_dim] per layer

DUMMY_PAGE = 0


def cache_specs(model: ModelConfig, engine: EngineConfig) -> list[ArraySpec]:
    """The cache described once: one spec per layer."""
    shape = (engine.num_pages, engine.page_size, 2 * model.num_kv_heads, model.head_dim)
    axes = ("pages", "page_slot", "kv_heads", "head_dim")
    return [ArraySpec(shape, jnp.dtype(engine.cache_dtype), axes, init="zeros") for _ in range(model.num_layers)]


def init_cache(model: ModelConfig, engine: EngineConfig, sharding: Any = None) -> KVCache:
    """Allocate a zeroed KV cache (optionally with a sharding per layer)."""
    specs = cache_specs(model, engine)
    if sharding is None:
        return [jnp.zeros(s.shape, s.dtype) for s in specs]
    return [jnp.zeros(s.shape, s.dtype, device=sharding) for s in specs]  # made in place, shard by shard



def cache_bytes(model: ModelConfig, engine: EngineConfig) -> int:
    per_layer = engine.num_pages * engine.page_size * 2 * model.num_kv_heads * model.head_dim
    return per_layer * model.num_layers * jnp.dtype(engine.cache_dtype).itemsize


def write_kv(cache_layer: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter new keys/values into their slots.

    cache_layer: [num_pages, page_size, 2*KVH, D]; k, v: [N, KVH, D]; slots: [N] int32.
    Returns the updated layer (in place when the cache is donated).
    """
    num_pages, page_size, two_kvh, d = cache_layer.shape
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], two_kvh, d).astype(cache_layer.dtype)
    # Index pages and offsets directly: scattering into a reshaped (flat-slot) view makes
    # XLA copy the whole layer before the update, a full-cache copy per step.
    return cache_layer.at[slots // page_size, slots % page_size].set(kv)


def gather_kv(cache_layer: jax.Array, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Read the pages a batch attends to.

    page_table: [B, P] int32 -> (k, v) each [B, P * page_size, KVH, D].
    """
    pages = cache_layer[page_table]  # [B, P, page_size, 2*KVH, D]
    b, p, ps, two_kvh, d = pages.shape
    pages = pages.reshape(b, p * ps, two_kvh // 2, 2, d)
    return pages[..., 0, :], pages[..., 1, :]


def slots_for(page_table: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """Host helper: flat slot index of each position given a page table.

    page_table: [P] (one sequence) or [B, P]; positions: [..., T] -> same shape as positions.
    """
    page_table = np.asarray(page_table)
    positions = np.asarray(positions)
    if page_table.ndim == 1:
        pages = page_table[positions // page_size]
    else:
        pages = np.take_along_axis(page_table, positions // page_size, axis=1)
    return (pages * page_size + positions % page_size).astype(np.int32)
