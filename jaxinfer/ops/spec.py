"""One description per array leaf: shape, dtype and logical axes.

A model family describes its parameters (and the KV cache describes its pages)
as a pytree of `ArraySpec`. From that one tree we derive the abstract tree
(`jax.ShapeDtypeStruct`), random initialisation for tests, shardings on a
device mesh (logical axis -> mesh axis rules), and the shape checks applied
when real weights are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class ArraySpec:
    """Shape, dtype and logical axis names of one array leaf."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[Optional[str], ...]
    init: str = "normal"  # "normal" | "ones" | "zeros"
    scale: float = 0.02

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


def is_spec(x) -> bool:
    return isinstance(x, ArraySpec)


def abstract(specs) -> Any:
    """The `jax.ShapeDtypeStruct` tree for a spec tree."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs, is_leaf=is_spec)


def init_random(specs, key: jax.Array, scale: Optional[float] = None) -> Any:
    """Random weights following each leaf's init rule (for tests and benchmarks).

    ``scale`` overrides the standard deviation of "normal" leaves.
    """
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, max(len(leaves), 1))
    out = []
    for s, k in zip(leaves, keys):
        if s.init == "ones":
            out.append(jnp.ones(s.shape, s.dtype))
        elif s.init == "zeros":
            out.append(jnp.zeros(s.shape, s.dtype))
        else:
            std = s.scale if scale is None else scale
            out.append((std * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype))
    return jax.tree.unflatten(treedef, out)


def partition_spec(spec: ArraySpec, rules: Mapping[str, Optional[str]]) -> jax.sharding.PartitionSpec:
    """Map logical axes to mesh axes with a rules table (unlisted axes are replicated)."""
    return jax.sharding.PartitionSpec(*[rules.get(a) if a else None for a in spec.axes])


def shardings(specs, mesh: jax.sharding.Mesh, rules: Mapping[str, Optional[str]]) -> Any:
    """`NamedSharding` tree for a spec tree on `mesh` (tensor parallelism is a rules table)."""
    return jax.tree.map(
        lambda s: jax.sharding.NamedSharding(mesh, partition_spec(s, rules)), specs, is_leaf=is_spec
    )


def check_tree(specs, arrays, what: str = "parameter") -> None:
    """Raise ValueError naming the first leaf whose shape differs from its spec."""
    spec_leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    arr_leaves, _ = jax.tree.flatten(arrays)
    if len(spec_leaves) != len(arr_leaves):
        raise ValueError(f"{what} tree has {len(arr_leaves)} leaves, expected {len(spec_leaves)}")
    for (path, s), a in zip(spec_leaves, arr_leaves):
        if tuple(a.shape) != tuple(s.shape):
            raise ValueError(
                f"{what} {jax.tree_util.keystr(path)} has shape {tuple(a.shape)}, expected {s.shape}"
            )



def nbytes(specs) -> int:
    return int(
        sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(specs, is_leaf=is_spec))
    )
