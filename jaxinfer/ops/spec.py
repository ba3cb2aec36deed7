"""One description per array leaf: shape, dtype and logical axes; and the type of one weight's description.

A model family describes its parameters (and the KV cache describes its pages)
as a pytree of `ArraySpec`. From that one tree we derive the abstract tree
(`jax.ShapeDtypeStruct`), random initialisation for tests, shardings on a
device mesh (logical axis -> mesh axis rules), and the shape checks applied
when real weights are loaded. A parameter leaf's spec also carries the two rules
this layer applies to it: its tensor-parallel relayout (`ArraySpec.relayout`, read by
`jaxinfer.ops.mesh`) and its quantization role (`ArraySpec.quant`, read by `jaxinfer.ops.quant`).

Where those come from: `WeightDesc`, one weight described once (its spec, its Hugging Face
sources and their fusion, its GGUF names and llama.cpp row order, its relayout, its
quantization role). The tables of them, one per layer kind, are `jaxinfer.models.weights_table`'s;
everything else about a weight is derived from them. This layer reaches a model's spec tree
only through `model_specs` and `family_descs`, which the families register (`register_family`): ops never
imports `jaxinfer.models`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

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
    # a parameter's rules: (axis, index map kind of `jaxinfer.ops.mesh.TPLayout`) when a tensor-parallel
    # layout re-orders it; its quantization role: "layer" (an [in, out] projection), "embed" (the
    # [vocab, hidden] embeddings), "head" (the [hidden, vocab] LM head, stored [vocab, hidden]) or ""
    relayout: Optional[tuple[int, str]] = None
    quant: str = ""

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


def zeros(shape: tuple, dtype: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A zero array placed with ``sharding``, made from host memory shard by shard (each process its own
    shards): no XLA program is compiled for it, where ``jnp.zeros`` compiles a fill at every start (the KV
    cache and the sampler's state cost ~0.4 s of compiles a start on 2 cores)."""
    def shard(index):
        return np.zeros(tuple(len(range(*i.indices(n))) for i, n in zip(index, shape)), dtype)

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


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


# ---------------------------------------------------------------------------
# one weight, described once


QUANT_ROLES = ("", "layer", "embed", "head")
KINDS = ("vector", "linear", "experts", "embed", "head", "heads")


@dataclass(frozen=True)
class Source:
    """One Hugging Face tensor a weight is made of (fused with the others along the output axis).

    ``hf``: its canonical name relative to the layer (``self_attn.q_proj``; ``{e}`` stands for an
    expert's index) or the model (``model.embed_tokens``), without ``.weight``/``.bias``.
    ``gguf``: llama.cpp's name for it (``attn_q``; one stacked tensor for all experts).
    ``rows``: its output rows given the config (None: the whole output axis).
    ``rope_heads``: a config field (``num_heads``, ``num_kv_heads``) when llama.cpp's converter
    interleaves each head's rotary halves in its rows (``LlamaModel.permute``)."""

    hf: str
    gguf: str
    rows: Optional[Callable[[Any], int]] = None
    rope_heads: str = ""


@dataclass(frozen=True)
class WeightDesc:
    """Everything about one parameter leaf of a layer (or of the model), in one place.

    ``name``: its key in the layer's dict; ``shape(cfg)`` its shape as stored ([in, out] for a
    matrix), ``axes`` its logical axes, ``init`` "normal", "zeros" or "norm" (ones, or zeros for
    norms that scale by ``1 + w``); ``sources`` the Hugging Face tensors it fuses, in order;
    ``kind`` how they become the leaf: "vector" (1-D, concatenated), "linear" (``[out, in]``
    tensors fused on ``out``, transposed), "experts" (one linear per expert, stacked), "embed"
    (``[vocab, hidden]`` as it is), "head" (transposed; kept ``[vocab, hidden]`` when quantized),
    "heads" (one ``[heads x rows, in]`` tensor as ``[heads, rows, in]``: a per-head product's weight, kept float);
    ``suffix`` "weight" or "bias"; ``relayout`` its tensor-parallel re-ordering (axis, index map
    kind) or None; ``quant`` its quantization role (`QUANT_ROLES`); ``requires`` the `ModelConfig`
    flags it exists under (``"!flag"``: only without it)."""

    name: str
    shape: Callable[[Any], tuple[int, ...]]
    axes: tuple[Optional[str], ...]
    sources: tuple[Source, ...]
    kind: str = "linear"
    init: str = "normal"
    suffix: str = "weight"
    relayout: Optional[tuple[int, str]] = None
    quant: str = ""
    requires: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS or self.quant not in QUANT_ROLES:
            raise ValueError(f"{self.name}: kind {self.kind!r} (one of {KINDS}), quant {self.quant!r}")

    def present(self, cfg: Any) -> bool:
        return all(bool(getattr(cfg, f.lstrip("!"))) != f.startswith("!") for f in self.requires)

    def spec(self, cfg: Any, dtype: Any) -> ArraySpec:
        init = self.init
        if init == "norm":
            init = "zeros" if cfg.norm_weight_offset == 1.0 else "ones"
        return ArraySpec(tuple(self.shape(cfg)), dtype, self.axes, init=init, relayout=self.relayout,
                         quant=self.quant)

    def hf_names(self, prefix: str, expert: Optional[int] = None) -> list[str]:
        """The canonical names of its sources (one expert's, for an "experts" weight)."""
        return [f"{prefix}{s.hf.format(e=expert)}.{self.suffix}" for s in self.sources]


# ---------------------------------------------------------------------------
# a model's weights and spec tree, as its family describes them (registered by `jaxinfer.models`)

_FAMILIES: dict[str, tuple[Callable[..., Any], tuple[WeightDesc, ...]]] = {}


def register_family(architecture: str, param_specs: Callable[..., Any], descs: tuple[WeightDesc, ...]) -> None:
    """``param_specs(cfg, dtype)``: the spec tree of a model of ``architecture`` (`ModelConfig.architecture`);
    ``descs``: every weight its models may hold."""
    _FAMILIES[architecture] = (param_specs, tuple(descs))


def _family(architecture: str) -> tuple[Callable[..., Any], tuple[WeightDesc, ...]]:
    try:
        return _FAMILIES[architecture]
    except KeyError:
        known = ", ".join(sorted(_FAMILIES)) or "none: jaxinfer.models is not imported"
        raise ValueError(f"no weights description for architecture {architecture!r}; known: {known}") from None


def family_descs(architecture: str) -> tuple[WeightDesc, ...]:
    """Every weight a model of ``architecture`` may hold (`WeightDesc`)."""
    return _family(architecture)[1]


def model_specs(cfg: Any, dtype: Any = jnp.float32, quantized: bool = True) -> Any:
    """The parameter spec tree of ``cfg``; with ``quantized`` False the float tree (``cfg.quant`` dropped)."""
    fn = _family(cfg.architecture)[0]
    if not quantized and cfg.quant:
        cfg = dataclasses.replace(cfg, quant="")
    return fn(cfg, dtype)
