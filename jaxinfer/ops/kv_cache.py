"""The paged KV cache: a preallocated pytree of pages, one array per layer.

Each layer's array has shape ``[num_pages, page_size, 2 * num_kv_heads, head_dim]``
with K at even and V at odd head indices (the layout the Pallas TPU
``ragged_paged_attention`` kernel reads). A model with multi-head latent attention
(DeepSeek, `ModelConfig.latent`) caches one entry per token shared by all heads instead:
``[num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]``, the normed latent then the
roped rotary key (the key of the absorbed attention; its value is the latent part). The
layout is the family's; pages, slots, the prefix cache and preemption are the same for both.
Page 0 is a reserved dummy page:
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
from jaxinfer.ops.spec import ArraySpec, zeros

KVCache = list  # list[jax.Array], one [num_pages, page_size, 2*num_kv_heads, head_dim] (or latent) per layer

DUMMY_PAGE = 0


def token_entry(model: ModelConfig) -> tuple[int, int]:
    """One token's entry in a cache layer: (rows, values per row): ``2 * num_kv_heads`` heads of
    ``head_dim`` (keys and values), or one latent row of ``kv_lora_rank + qk_rope_head_dim``."""
    if model.latent:
        return 1, model.kv_lora_rank + model.qk_rope_head_dim
    return 2 * model.num_kv_heads, model.head_dim


def kv_bytes_per_token(model: ModelConfig, cache_dtype: Any) -> int:
    """Bytes one token's keys and values take in the cache, over every layer (e.g. DeepSeek-V3's latent:
    (512 + 64) values a layer; per-head keys and values would be 128 x (192 + 128))."""
    rows, width = token_entry(model)
    return rows * width * model.num_layers * jnp.dtype(cache_dtype).itemsize


def cache_specs(model: ModelConfig, engine: EngineConfig) -> list[ArraySpec]:
    """The cache described once: one spec per layer."""
    shape = (engine.num_pages, engine.page_size, *token_entry(model))
    axes = ("pages", "page_slot", None if model.latent else "kv_heads", "head_dim")
    return [ArraySpec(shape, jnp.dtype(engine.cache_dtype), axes, init="zeros") for _ in range(model.num_layers)]


def init_cache(model: ModelConfig, engine: EngineConfig, sharding: Any = None) -> KVCache:
    """Allocate a zeroed KV cache (optionally with a sharding per layer)."""
    specs = cache_specs(model, engine)
    if sharding is None:
        return [jnp.zeros(s.shape, s.dtype) for s in specs]
    return [zeros(s.shape, s.dtype, sharding) for s in specs]  # shard by shard, no program compiled



def cache_bytes(model: ModelConfig, engine: EngineConfig) -> int:
    return engine.num_pages * engine.page_size * kv_bytes_per_token(model, engine.cache_dtype)


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


def write_latent(cache_layer: jax.Array, entry: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter new latent entries ([N, 1, latent]) into their slots of a latent cache layer."""
    page_size = cache_layer.shape[1]
    return cache_layer.at[slots // page_size, slots % page_size].set(entry.astype(cache_layer.dtype))


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
