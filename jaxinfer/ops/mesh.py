"""Tensor parallelism: the device mesh, the model's tensor-parallel layout, and placing weights on it.

The mesh has two axes, ``("dp", "tp")``: ``tp`` splits every layer over
`EngineConfig.tensor_parallel_size` devices, ``dp`` is of size 1 for now. Which
array axis goes to which mesh axis is a rules table over the parameter and cache
specs' logical axes (`RULES`): attention heads, KV heads, the MLP's intermediate
axis and the vocabulary are split on ``tp``; norms and the hidden axis are
replicated. XLA's SPMD partitioner inserts the collectives (an all-reduce after
``wo`` and ``w_down``, gathers of the vocabulary-split logits for sampling), so
the same `jaxinfer.models.transformer.forward` runs at every size. Attention is the
one part XLA cannot partition (a custom call on CPU, Pallas kernels on TPU): it
runs inside ``jax.shard_map`` over the KV-head axis (`jaxinfer.ops.attention`).

The tensor-parallel layout (`TPLayout`)
---------------------------------------
Each device must hold whole KV heads with the query heads that read them, and
the fused projections (``wqkv`` = [q | k | v] columns, ``w_gate_up`` = [gate |
up]) must split so that each device's columns are its own heads' q, k and v
(its own slice of gate and of up). So on a mesh the layout changes, once, when
the weights are placed:

- the fused columns are ordered shard-major: shard 0's [q | k | v], then shard
  1's, ... (`ModelConfig.tp_shards` tells the decoder to split them that way);
- KV heads are padded to a multiple of the shard count, or, with fewer KV heads
  than shards, replicated so each shard holds one (vLLM's rule); each shard's
  query heads are those of its KV heads (split among the shards that replicate
  one, padded to an equal count);
- the MLP's intermediate size is padded to a multiple of the shard count.

Padding heads and columns are zeros, and so are the ``wo`` / ``w_down`` rows
that read them, so they add exact zeros: the model computes the same function.
The layout is a model with more heads (`TPLayout.config`): at one shard it is
the plain model, unchanged. The KV cache follows the laid-out config, one
shard's KV heads per device.

Placing (`place_params`): each device receives only its shard (leaves that no
mesh axis splits, such as norms, are replicated). A leaf whose layout does not
change is put straight into its sharding (from host memory by
`jax.make_array_from_callback`, slice by slice, or restored by orbax into it:
`load_shardings`); a leaf that is re-laid out is read into host memory, spread
over the mesh on another axis, and permuted on the devices into its target
sharding, one leaf at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import sys
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.ops.kv_cache import kv_bytes_per_token
from jaxinfer.ops.quant import QuantizedWeight, is_quantized
from jaxinfer.ops.spec import ArraySpec, family_descs, is_spec, model_specs

DP_AXIS = "dp"
TP_AXIS = "tp"

# logical axis -> mesh axis; any axis not listed (hidden "embed", experts, pages, head_dim) is replicated
RULES = {"vocab": TP_AXIS, "qkv": TP_AXIS, "heads": TP_AXIS, "mlp": TP_AXIS, "kv_heads": TP_AXIS}

# The KV cache [pages, page_size, 2 * kv heads, head_dim]: each device holds its KV heads' pages. A latent
# cache ([pages, page_size, 1, latent]: one entry per token for every head) is whole on every device.
CACHE_SPEC = P(None, None, TP_AXIS, None)
LATENT_CACHE_SPEC = P()


def make_mesh(engine: EngineConfig, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """The ("dp", "tp") mesh of `engine` over the first dp x tp of ``devices`` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    tp, dp = engine.tensor_parallel_size, engine.data_parallel_size
    if tp * dp > len(devices):
        hint = (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices)"
                if devices and devices[0].platform == "cpu" else "")
        raise ValueError(
            f"tensor_parallel_size {tp} needs {tp * dp} devices; this process sees {len(devices)}{hint}"
        )
    if jax.process_count() > 1 and tp * dp != len(devices):
        raise ValueError(
            f"a run of {jax.process_count()} processes needs a mesh over all their {len(devices)} devices; "
            f"tensor_parallel_size {tp} x data_parallel_size {dp} is {tp * dp}"
        )
    grid = np.array(devices[: tp * dp], dtype=object).reshape(dp, tp)
    auto = jax.sharding.AxisType.Auto
    return Mesh(grid, (DP_AXIS, TP_AXIS), axis_types=(auto, auto))


def tp_size() -> int:
    """The ``tp`` axis size of the mesh being traced under (`jax.set_mesh`), 1 outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return dict(getattr(mesh, "shape", {}) or {}).get(TP_AXIS, 1)


# ---------------------------------------------------------------------------
# the tensor-parallel layout


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """Which original head (or -1, a zero pad) each laid-out head slot holds, for `shards` shards."""

    shards: int
    q_slots: tuple[int, ...]  # per query slot, shard-major
    kv_slots: tuple[int, ...]  # per KV slot, shard-major
    intermediate_size: int  # padded to a multiple of shards
    moe_intermediate_size: int
    shared_expert_intermediate_size: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig, shards: int) -> "TPLayout":
        h, kvh = cfg.num_heads, cfg.num_kv_heads
        g = h // kvh
        if kvh >= shards:  # whole KV heads per shard, padded to an equal count
            per = -(-kvh // shards)
            kv = [k if k < kvh else -1 for k in range(shards * per)]
            q = [k * g + j if k >= 0 else -1 for k in kv for j in range(g)]
        else:  # fewer KV heads than shards: each shard holds one, replicated over several shards
            kv = [s * kvh // shards for s in range(shards)]
            sharing = [kv.count(k) for k in range(kvh)]
            per_q = -(-g // min(sharing))  # query heads per shard
            q = []
            for s, k in enumerate(kv):
                rank = kv[:s].count(k)  # this shard's place among those holding head k
                q += [k * g + j if j < g else -1 for j in range(rank * per_q, (rank + 1) * per_q)]
        pad = lambda n: -(-n // shards) * shards  # noqa: E731
        return cls(shards, tuple(q), tuple(kv), pad(cfg.intermediate_size), pad(cfg.moe_intermediate_size),
                   pad(cfg.shared_expert_intermediate_size))

    @property
    def identity(self) -> bool:
        return self.shards == 1

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The laid-out model: the heads and intermediate sizes each shard computes, times shards."""
        if self.identity:
            return cfg
        return dataclasses.replace(
            cfg,
            num_heads=len(self.q_slots),
            num_kv_heads=len(self.kv_slots),
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            tp_shards=self.shards,
        )

    # index maps: laid-out position -> original position (-1: zero)

    def qkv_columns(self, cfg: ModelConfig) -> np.ndarray:
        d, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        nq, nkv = len(self.q_slots) // self.shards, len(self.kv_slots) // self.shards
        cols = []
        for s in range(self.shards):
            qs = self.q_slots[s * nq : (s + 1) * nq]
            kvs = self.kv_slots[s * nkv : (s + 1) * nkv]
            cols += [_head_cols(x, 0, d) for x in qs]
            cols += [_head_cols(x, h * d, d) for x in kvs]
            cols += [_head_cols(x, (h + kvh) * d, d) for x in kvs]
        return np.concatenate(cols)

    def wo_rows(self, cfg: ModelConfig) -> np.ndarray:
        return np.concatenate([_head_cols(x, 0, cfg.head_dim) for x in self.q_slots])

    def head_columns(self, per_head: int) -> np.ndarray:
        """Columns of a projection laid out head by head, ``per_head`` each (latent attention's query and
        its latent's up-projection: a head's columns go with its query slot)."""
        return np.concatenate([_head_cols(x, 0, per_head) for x in self.q_slots])

    def gate_up_columns(self, size: int) -> np.ndarray:
        padded = -(-size // self.shards) * self.shards
        per = padded // self.shards
        cols = []
        for s in range(self.shards):
            c = np.arange(s * per, (s + 1) * per)
            cols += [np.where(c < size, c, -1), np.where(c < size, size + c, -1)]
        return np.concatenate(cols)

    def down_rows(self, size: int) -> np.ndarray:
        r = np.arange(-(-size // self.shards) * self.shards)
        return np.where(r < size, r, -1)


def _head_cols(head: int, base: int, d: int) -> np.ndarray:
    return np.full(d, -1) if head < 0 else base + head * d + np.arange(d)


# a spec's relayout kind (`jaxinfer.ops.spec.ArraySpec.relayout`) -> its index map under a layout
INDEX_MAPS = {
    "qkv": lambda lay, cfg: lay.qkv_columns(cfg),
    "wo": lambda lay, cfg: lay.wo_rows(cfg),
    "gate_up": lambda lay, cfg: lay.gate_up_columns(cfg.intermediate_size),
    "down": lambda lay, cfg: lay.down_rows(cfg.intermediate_size),
    "expert_gate_up": lambda lay, cfg: lay.gate_up_columns(cfg.moe_intermediate_size),
    "expert_down": lambda lay, cfg: lay.down_rows(cfg.moe_intermediate_size),
    "shared_gate_up": lambda lay, cfg: lay.gate_up_columns(cfg.shared_expert_intermediate_size),
    "shared_down": lambda lay, cfg: lay.down_rows(cfg.shared_expert_intermediate_size),
    "latent_q": lambda lay, cfg: lay.head_columns(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
    "latent_heads": lambda lay, cfg: np.asarray(lay.q_slots),
}


def relayouts(descs, cfg: ModelConfig, layout: TPLayout) -> dict:
    """{(leaf name, rank): (axis, index map)} for the leaves of ``descs`` (weight descriptions,
    `jaxinfer.ops.spec.WeightDesc`) whose layout changes under ``layout``."""
    maps = {}
    for d in descs:
        if d.relayout is not None and d.present(cfg):
            axis, kind = d.relayout
            maps[(d.name, len(d.shape(cfg)))] = (axis, INDEX_MAPS[kind](layout, cfg))
    # an index map that is the identity needs no relayout (e.g. wo when heads divide evenly)
    return {k: v for k, v in maps.items() if not np.array_equal(v[1], np.arange(len(v[1])))}


def family_relayouts(cfg: ModelConfig, layout: TPLayout) -> dict:
    """`relayouts` of every weight the family of ``cfg`` describes (`jaxinfer.ops.spec.family_descs`)."""
    return relayouts(family_descs(cfg.architecture), cfg, layout)


# ---------------------------------------------------------------------------
# shardings


def sharding_for(spec: ArraySpec, mesh: Mesh) -> NamedSharding:
    """The leaf's `NamedSharding` by `RULES`; an axis the mesh axis does not divide stays replicated."""
    parts = []
    for size, axis in zip(spec.shape, spec.axes):
        m = RULES.get(axis) if axis else None
        parts.append(m if m is not None and size % mesh.shape[m] == 0 else None)
    return NamedSharding(mesh, P(*parts))


def param_shardings(cfg: ModelConfig, mesh: Mesh, dtype: Any = jnp.float32) -> Any:
    """Shardings of the laid-out parameter tree of ``cfg`` (already `TPLayout.config`)."""
    specs = model_specs(cfg, dtype)
    return jax.tree.map(lambda s: sharding_for(s, mesh), specs, is_leaf=is_spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_page_bytes(model: ModelConfig, engine: EngineConfig) -> int:
    """Bytes one KV cache page takes on each device of ``engine``'s mesh: a latent cache is whole on every
    device; per-head keys and values are split over the ``tp`` devices (the layout's padded KV heads)."""
    tp = engine.tensor_parallel_size
    per_token = kv_bytes_per_token(TPLayout.of(model, tp).config(model), engine.cache_dtype)
    return engine.page_size * (per_token if model.latent else per_token // tp)


def fit_pages(model: ModelConfig, engine: EngineConfig) -> EngineConfig:
    """``engine`` with ``num_pages`` from its ``kv_cache_memory_bytes`` (as many pages as fit, plus the reserved
    page 0), or as it is when that is not set."""
    budget = engine.kv_cache_memory_bytes
    if budget is None:
        return engine
    pages = budget // kv_page_bytes(model, engine)
    if pages < 1:
        raise ValueError(f"kv_cache_memory_bytes {budget:,} holds no page of {engine.page_size} tokens "
                         f"({kv_page_bytes(model, engine):,} bytes a page for this model)")
    return engine.replace(num_pages=int(pages) + 1)


def cache_spec(model: Optional[ModelConfig] = None) -> P:
    """How a cache layer of ``model`` splits over the mesh: by KV heads, or replicated (latent attention)."""
    return LATENT_CACHE_SPEC if model is not None and model.latent else CACHE_SPEC


def cache_sharding(mesh: Mesh, model: Optional[ModelConfig] = None) -> NamedSharding:
    return NamedSharding(mesh, cache_spec(model))


def _spread(shape: tuple[int, ...], skip_axis: int, mesh: Mesh) -> NamedSharding:
    """Split a leaf over the ``tp`` devices on its first axis (other than ``skip_axis``) they divide."""
    n = mesh.shape[TP_AXIS]
    parts: list = [None] * len(shape)
    for a, size in enumerate(shape):
        if a != skip_axis and size % n == 0:
            parts[a] = TP_AXIS
            break
    return NamedSharding(mesh, P(*parts))


def load_shardings(cfg: ModelConfig, layout: TPLayout, mesh: Mesh, dtype: Any = jnp.float32) -> Any:
    """Where to restore each leaf of the original (not laid-out) tree: its final sharding when
    the layout leaves it as it is, else None: into host memory, for `place_params` to re-lay
    out and place one leaf at a time (so the devices never hold a second copy of those leaves)."""
    specs = model_specs(cfg, dtype)
    final = param_shardings(layout.config(cfg), mesh, dtype)
    maps = family_relayouts(cfg, layout)

    def pick(path, spec, sharding):
        rank = 2 if _in_quantized(path) else len(spec.shape)
        return sharding if (leaf_name(path), rank) not in maps else None

    return jax.tree_util.tree_map_with_path(pick, specs, final, is_leaf=is_spec)


_QUANTIZED_FIELDS = frozenset(f.name for f in dataclasses.fields(QuantizedWeight))


def _key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", k)))


def _in_quantized(path) -> bool:
    """Whether ``path`` ends at a field of a `jaxinfer.ops.quant.QuantizedWeight` (no weight is named
    like one of its fields: the weights table's test holds that)."""
    return len(path) > 1 and _key_name(path[-1]) in _QUANTIZED_FIELDS


def leaf_name(path) -> str:
    """The parameter's name (a quantized weight's fields are named by their weight)."""
    return _key_name(path[-2] if _in_quantized(path) else path[-1])


def _coarse(idx: np.ndarray, unit: int, what: str) -> np.ndarray:
    """A row index map in units of ``unit`` rows (int4 byte rows, scale groups): each unit of the
    laid-out rows must be a whole unit of the original rows, or all padding."""
    whole = len(idx) % unit == 0
    if whole:
        blocks = idx.reshape(-1, unit)
        first = blocks[:, 0]
        same = np.where(first[:, None] >= 0, blocks == first[:, None] + np.arange(unit), blocks < 0)
        whole = same.all() and not (first[first >= 0] % unit).any()
    if not whole:
        raise ValueError(f"the tensor-parallel layout splits the {what} of a quantized weight ({unit} rows); "
                         f"use another tensor_parallel_size or float weights")
    return np.where(first >= 0, first // unit, -1)


def _quantized_maps(axis: int, idx: np.ndarray, w: QuantizedWeight) -> tuple:
    """The index maps of ``q``, ``scale`` and ``offset`` for a relayout of ``w`` on ``axis``."""
    if axis == 1:  # columns: the same map for every field
        return idx, idx
    q_idx = _coarse(idx, 2, "byte rows") if w.bits == 4 else idx
    k = w.shape[0]
    if w.group == k:  # one scale per column: the layout's added rows are zeros, the scale stays
        return q_idx, None
    return q_idx, _coarse(idx, w.group, "scale groups")


@functools.lru_cache(maxsize=None)
def _permute(axis: int, out_sharding: NamedSharding):
    def f(x, idx):
        taken = jnp.take(x, jnp.maximum(idx, 0), axis=axis)
        keep = jnp.expand_dims(idx >= 0, [a for a in range(x.ndim) if a != axis])
        return jnp.where(keep, taken, jnp.zeros((), x.dtype))

    return jax.jit(f, out_shardings=out_sharding)


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
    """One leaf into ``sharding``: host arrays slice by slice, device arrays by `jax.device_put`."""
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        if sharding.is_fully_addressable or not x.is_fully_addressable:
            return jax.device_put(x, sharding)
        x = np.asarray(x)  # one process's array onto a mesh of several: each takes its slices from it
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: np.ascontiguousarray(x[index]))


def place_params(params: Any, cfg: ModelConfig, layout: TPLayout, mesh: Mesh) -> Any:
    """The parameter tree of ``cfg`` (host arrays, device arrays, or restored by `load_shardings`)
    laid out by ``layout`` and placed on ``mesh``, leaf by leaf."""
    maps = family_relayouts(cfg, layout)
    floats = [x for x in jax.tree.leaves(params, is_leaf=is_quantized) if not is_quantized(x)]
    final = param_shardings(layout.config(cfg), mesh, floats[0].dtype)

    def relayout(x, axis, idx, sharding):
        staged = _put(x, _spread(np.shape(x), axis, mesh))
        # One leaf at a time: only one leaf's staging copy is alive, and only one program with
        # collectives is in flight (XLA:CPU's in-process collectives deadlock on several).
        return _permute(axis, sharding)(staged, _put(idx.astype(np.int32), replicated(mesh))).block_until_ready()

    def place(path, x, sharding):
        m = maps.get((leaf_name(path), 2 if is_quantized(x) else np.ndim(x)))
        if is_quantized(x):
            # the laid-out weight's meta (a per-column scale's group grows with padded rows)
            if m is None:
                fields = [_put(a, sh) if a is not None else None
                          for a, sh in zip((x.q, x.scale, x.offset), (sharding.q, sharding.scale, sharding.offset))]
            else:
                axis, idx = m
                q_idx, s_idx = _quantized_maps(axis, idx, x)
                fields = [relayout(x.q, axis, q_idx, sharding.q)]
                for a, sh in ((x.scale, sharding.scale), (x.offset, sharding.offset)):
                    fields.append(None if a is None else _put(a, sh) if s_idx is None else relayout(a, axis, s_idx, sh))
            return dataclasses.replace(sharding, q=fields[0], scale=fields[1], offset=fields[2])
        if m is None:
            return _put(x, sharding)
        axis, idx = m
        return relayout(x, axis, idx, sharding)

    return jax.tree_util.tree_map_with_path(place, params, final, is_leaf=is_quantized)


def per_device_bytes(tree: Any) -> dict:
    """{device: bytes of the tree's shards it holds}."""
    out: dict = {}
    for x in jax.tree.leaves(tree):
        for sh in x.addressable_shards:
            out[sh.device] = out.get(sh.device, 0) + sh.data.nbytes
    return out


def mesh_placement(engine: EngineConfig):
    """For `jaxinfer.loading.model_cache.load`: a model config -> where each stored leaf is restored on
    ``engine``'s mesh (`load_shardings`), so a restore reads each device's shard straight into it."""
    mesh = make_mesh(engine)
    return lambda cfg: load_shardings(cfg, TPLayout.of(cfg, engine.tensor_parallel_size), mesh)


def peak_host_memory_mb() -> float:
    """The process's peak resident memory so far (MB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e6 if sys.platform == "darwin" else peak / 1e3  # bytes on macOS, KiB on Linux


def placement_report(runner) -> str:
    """One line: how the parameters and the KV cache are split over the runner's mesh."""
    params = per_device_bytes(runner.params)
    cache = per_device_bytes(runner.kv_cache)
    total = sum(x.nbytes for x in jax.tree.leaves(runner.params))
    n = runner.layout.shards
    return (
        f"tensor parallel over {n} devices: parameters {max(params.values()) / 1e6:.1f} MB per device "
        f"(model {total / 1e6:.1f} MB laid out for {n}), KV cache {max(cache.values()) / 1e6:.1f} MB per device; "
        f"peak host memory {peak_host_memory_mb():.0f} MB"
    )
