"""Weight-only quantization: int8 and int4 weights with float16 scales, kept quantized on the device.

A quantized weight is a `QuantizedWeight`, a pytree node that stands where the float
``[in, out]`` matrix stood (``x @ w``). Its leaves:

- ``q``: the integers. int8: ``int8 [K, N]``, signed. int4: ``uint8 [K // 2, N]``, two rows
  per byte: row ``2j`` in the low nibble of byte row ``j``, row ``2j + 1`` in the high one;
  a nibble ``u`` is ``0..15``.
- ``scale``: ``float16 [K // group, N]``, one per ``group`` rows of each output column.
- ``offset``: ``float16 [K // group, N]`` or None.

and its value is ``w[k, n] = scale[k // group, n] * v[k, n] + offset[k // group, n]`` where
``v`` is the int8 value, or the nibble (``u``, or ``u - 8`` when there is no offset).

Columns are outputs, as in the float tree, so the tensor-parallel layout
(`jaxinfer.ops.mesh`) permutes ``q``, ``scale`` and ``offset`` columns with the same index map
and the mesh shards all three by the weight's logical axes. Rows are the contraction:
groups never straddle two output columns, and a product reads a group's scale once.

Schemes (`ModelConfig.quant`: ``"LAYERS"`` or ``"LAYERS/HEAD"``, the layers' projections and the
token embeddings with the LM head; HEAD defaults to LAYERS for int8 and to ``"int8"`` for int4):

- ``"int8"``: int8, one scale per output column (symmetric, ``group`` = K);
- ``"int8-g32"``: int8 in groups of 32 rows: GGUF ``Q8_0`` blocks, loaded as they are;
- ``"int4-g32"`` / ``"int4-g64"``: int4 with a scale and an offset (the group's minimum) per
  group: GGUF ``Q4_1`` blocks are loaded as they are, ``Q4_0`` ones exactly too (offset
  ``-8 * scale``, a float16 product by a power of two).

The head stays 8-bit under int4, as llama.cpp's Q4 files keep theirs (Q8_0 or Q6_K): the
embeddings and the LM head are the weights a 4-bit rounding hurts most (SmolLM2 with a 4-bit
head drifted from its float32 answers from the first tokens).

Quantized leaves: those whose spec has a quantization role (`jaxinfer.ops.spec.ArraySpec.quant`,
from the weights table `jaxinfer.models.weights_table`): the attention and MLP projections
(``wqkv``, ``wo``, ``w_gate_up``, ``w_down``), the token embeddings and the LM head. The head's weights are stored the other
way round, ``[vocab, hidden]`` with groups along the hidden axis (``axis`` 1: GGUF's own row
blocks, kept as they are): as ``[hidden, vocab]`` a band of output columns would read one
memory page per row (rows 49152 bytes apart for SmolLM2), and the CPU kernel reached half the
bandwidth on it; as rows it streams. A lookup dequantizes its tokens' rows, and the tied head
contracts the same rows. Norms, biases, routers and experts stay float. A weight whose
contraction size the group does not divide stays float too.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.spec import ArraySpec, is_spec, model_specs

# what a user asks for -> the scheme of a float source (a GGUF source may pick a blocked one)
MODES = ("int8", "int4")
SCHEMES = ("int8", "int8-g32", "int4-g32", "int4-g64")


@dataclasses.dataclass(frozen=True)
class Scheme:
    bits: int
    group: int  # rows per scale; 0: one scale per output column (the whole contraction)
    offset: bool

    @classmethod
    def parse(cls, name: str) -> "Scheme":
        if name not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}")
        bits = int(name[3])
        group = int(name.split("-g")[1]) if "-g" in name else 0
        return cls(bits, group, bits == 4)

    @classmethod
    def pair(cls, name: str) -> tuple["Scheme", "Scheme"]:
        """(the layers' scheme, the head's) of a `ModelConfig.quant` value."""
        layers, _, head = name.partition("/")
        lay = cls.parse(layers)
        return lay, cls.parse(head or ("int8" if lay.bits == 4 else layers))

    def group_of(self, k: int) -> int:
        return self.group or k

    def fits(self, k: int) -> bool:
        """Whether a weight contracting over ``k`` rows can take this scheme."""
        return k % self.group_of(k) == 0 and (self.bits == 8 or k % 2 == 0)


def check_mode(mode: Optional[str]) -> Optional[str]:
    """A user's ``quantization`` argument, checked: None (float weights), "int8" or "int4"."""
    if mode in (None, "", "none"):
        return None
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)} (or None), got {mode!r}")
    return mode


def default_scheme(mode: str) -> str:
    return {"int8": "int8", "int4": "int4-g32"}[mode]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A ``[K, N]`` weight as integers with float16 scales (module docstring has the layout)."""

    q: Any
    scale: Any
    offset: Any
    bits: int = dataclasses.field(metadata=dict(static=True), default=8)
    group: int = dataclasses.field(metadata=dict(static=True), default=0)
    axis: int = dataclasses.field(metadata=dict(static=True), default=0)  # the axis groups (and nibbles) run along

    @property
    def shape(self) -> tuple[int, int]:
        """The float matrix's shape as stored: ``[K, N]``, or ``[N, K]`` when ``axis`` is 1."""
        r, c = self.q.shape
        if self.bits == 4:
            return (2 * r, c) if self.axis == 0 else (r, 2 * c)
        return (r, c)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in (self.q, self.scale, self.offset)
                   if x is not None)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """The float matrix as stored (under jit, XLA fuses this into its consumer where it can)."""
        return _dequantize_axis(jnp, self.q, self.scale, self.offset, self.bits, self.group, self.axis).astype(dtype)

    def lookup(self, idx: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
        """Embedding rows ``idx`` (any shape) as ``[*idx.shape, hidden]``: the rows of a ``[vocab, hidden]``
        weight (``axis`` 1), the columns of a ``[hidden, vocab]`` one."""
        take = lambda a: None if a is None else jnp.take(a, idx.reshape(-1), axis=1 - self.axis)  # noqa: E731
        w = _dequantize_axis(jnp, take(self.q), take(self.scale), take(self.offset), self.bits, self.group, self.axis)
        return (w if self.axis == 1 else w.T).reshape(*idx.shape, -1).astype(dtype)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def _values(xp, q, bits: int, signed4: bool):
    """The integer values [K, N] (int32) of ``q``."""
    if bits == 8:
        return q.astype(xp.int32)
    u = q.astype(xp.int32)
    v = xp.stack([u & 15, u >> 4], axis=1).reshape(2 * q.shape[0], q.shape[1])
    return v - 8 if signed4 else v


def _dequantize(xp, q, scale, offset, bits: int, group: int):
    v = _values(xp, q, bits, offset is None)
    k, n = v.shape
    g = group or k
    w = v.reshape(k // g, g, n).astype(xp.float32) * scale.astype(xp.float32)[:, None, :]
    if offset is not None:
        w = w + offset.astype(xp.float32)[:, None, :]
    return w.reshape(k, n)


def _dequantize_axis(xp, q, scale, offset, bits: int, group: int, axis: int):
    if axis == 0:
        return _dequantize(xp, q, scale, offset, bits, group)
    return _dequantize(xp, q.T, scale.T, None if offset is None else offset.T, bits, group).T


def dequantize_host(w: QuantizedWeight) -> np.ndarray:
    """``w`` (numpy leaves) as a float32 numpy matrix, as stored."""
    return _dequantize_axis(np, np.asarray(w.q), np.asarray(w.scale),
                            None if w.offset is None else np.asarray(w.offset), w.bits, w.group, w.axis)


# ---------------------------------------------------------------------------
# specs


def leaf_spec(spec: ArraySpec, scheme: Scheme, axis: int = 0) -> Any:
    """The spec of a weight leaf contracted over ``axis`` (``[K, N]``, or ``[N, K]`` for axis 1) under
    ``scheme``: a `QuantizedWeight` of specs, or ``spec`` itself when the scheme does not fit K."""
    k, n = spec.shape[axis], spec.shape[1 - axis]
    if not scheme.fits(k):
        return spec
    g = scheme.group_of(k)
    qk = k // 2 if scheme.bits == 4 else k
    qdtype = jnp.uint8 if scheme.bits == 4 else jnp.int8
    q_shape, side_shape = ((qk, n), (k // g, n)) if axis == 0 else ((n, qk), (n, k // g))
    side = ArraySpec(side_shape, jnp.float16, spec.axes, init="ones")
    return QuantizedWeight(
        ArraySpec(q_shape, qdtype, spec.axes, init="zeros"),
        side,
        side if scheme.offset else None,
        scheme.bits,
        g,
        axis,
    )


def quantize_specs(specs: Any, name: str) -> Any:
    """A float spec tree with its quantized leaves replaced (``name``: `ModelConfig.quant`). Which
    leaves, and how, is each spec's quantization role (`jaxinfer.ops.spec.ArraySpec.quant`, set by
    the weights table `jaxinfer.models.weights_table`)."""
    scheme, head = Scheme.pair(name)

    def leaf(s: ArraySpec) -> Any:
        if s.quant == "layer":
            return leaf_spec(s, scheme)
        if s.quant == "embed":  # [vocab, hidden]
            return leaf_spec(s, head, axis=1)
        if s.quant == "head" and head.fits(s.shape[0]):  # [hidden, vocab] -> [vocab, hidden], when quantized
            return leaf_spec(ArraySpec(s.shape[::-1], s.dtype, s.axes[::-1]), head, axis=1)
        return s

    return jax.tree.map(leaf, specs, is_leaf=is_spec)


# ---------------------------------------------------------------------------
# quantizing on the host


def quantize(w: np.ndarray, scheme: Scheme, axis: int = 0) -> QuantizedWeight:
    """A float ``[K, N]`` numpy matrix (``[N, K]`` with ``axis`` 1) -> `QuantizedWeight` (numpy leaves),
    round to nearest.

    Symmetric (int8): scale = max |w| / 127 per group. With an offset (int4): offset = the
    group's minimum, scale = (max - min) / 15. Scales and offsets are rounded to float16
    first, and the integers computed against the rounded values.
    """
    if axis == 1:
        t = quantize(np.asarray(w).T, scheme)
        return QuantizedWeight(*[None if a is None else np.ascontiguousarray(a.T) for a in (t.q, t.scale, t.offset)],
                               t.bits, t.group, 1)
    w = np.asarray(w, np.float32)
    k, n = w.shape
    g = scheme.group_of(k)
    x = w.reshape(k // g, g, n)
    if scheme.offset:
        lo, hi = x.min(axis=1), x.max(axis=1)
        levels = (1 << scheme.bits) - 1
        scale = ((hi - lo) / levels).astype(np.float16)
        offset = lo.astype(np.float16)
        s = scale.astype(np.float32)[:, None, :]
        v = np.where(s > 0, np.rint((x - offset.astype(np.float32)[:, None, :]) / np.where(s > 0, s, 1)), 0)
        v = np.clip(v, 0, levels).astype(np.int32).reshape(k, n)
    else:
        top = (1 << (scheme.bits - 1)) - 1
        scale = (np.abs(x).max(axis=1) / top).astype(np.float16)
        offset = None
        s = scale.astype(np.float32)[:, None, :]
        v = np.clip(np.where(s > 0, np.rint(x / np.where(s > 0, s, 1)), 0), -top, top).astype(np.int32).reshape(k, n)
        if scheme.bits == 4:
            v = v + 8
    return QuantizedWeight(pack(v, scheme.bits), scale, offset, scheme.bits, g)


def pack(v: np.ndarray, bits: int) -> np.ndarray:
    """Integer values [K, N] -> ``q`` (int8, or nibbles 0..15 two rows per byte)."""
    if bits == 8:
        return np.ascontiguousarray(v.astype(np.int8))
    u = v.astype(np.uint8)
    return np.ascontiguousarray(u[0::2] | (u[1::2] << 4))


@dataclasses.dataclass
class Blocks:
    """A GGUF tensor kept in its blocks, in Hugging Face orientation ``[out, in]``.

    ``values [out, in]``: int8 (Q8_0) or the nibbles 0..15 (Q4_0, Q4_1) as uint8; ``scale``
    and ``offset`` ``[out, in // 32]`` float16 (``offset`` None for the symmetric types; the
    nibbles of Q4_0 then stand for ``u - 8``). Row transforms (llama.cpp's rotary row order,
    a slice of experts) apply to each field alike (`map_rows`).
    """

    values: np.ndarray
    scale: np.ndarray
    offset: Optional[np.ndarray]
    bits: int
    kind: str = ""  # the GGML type: "Q8_0", "Q4_0", "Q4_1"
    group: int = 32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def map_rows(self, fn) -> "Blocks":
        off = None if self.offset is None else fn(self.offset)
        return Blocks(fn(self.values), fn(self.scale), off, self.bits, self.kind, self.group)

    def dequantize(self) -> np.ndarray:
        """Float32 ``[out, in]``."""
        v = self.values.astype(np.float32)
        if self.bits == 4 and self.offset is None:
            v = v - 8
        out, k = v.shape
        w = v.reshape(out, k // self.group, self.group) * self.scale.astype(np.float32)[:, :, None]
        if self.offset is not None:
            w = w + self.offset.astype(np.float32)[:, :, None]
        return w.reshape(out, k)


def blocks_from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Blocks:
    """A GGUF tensor's raw bytes (``[rows, bytes per row]`` uint8) of type Q8_0, Q4_0 or Q4_1 -> `Blocks`.

    Block of 32 weights: Q8_0 = float16 d, int8 q[32] (w = d q); Q4_0 = float16 d, 16 bytes
    (w = d (u - 8)); Q4_1 = float16 d, float16 m, 16 bytes (w = d u + m). In the 16 bytes,
    weight j < 16 is the low nibble of byte j, weight 16 + j its high nibble.
    """
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    nb = k // 32
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[type_name]
    b = np.ascontiguousarray(raw).reshape(rows, nb, size)
    d = b[:, :, 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q8_0":
        vals = b[:, :, 2:].copy().view(np.int8).reshape(rows, k)
        blk = Blocks(vals, d, None, 8, type_name)
    else:
        head = 4 if type_name == "Q4_1" else 2
        m = b[:, :, 2:4].copy().view(np.float16)[..., 0] if type_name == "Q4_1" else None
        qs = b[:, :, head:]
        vals = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(rows, k)
        blk = Blocks(vals, d, m, 4, type_name)
    shape_out = tuple(shape[:-1])
    return Blocks(blk.values.reshape(*shape_out, k), blk.scale.reshape(*shape_out, nb),
                  None if blk.offset is None else blk.offset.reshape(*shape_out, nb), blk.bits, type_name)


BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def as_float(x: Any) -> np.ndarray:
    return x.dequantize() if isinstance(x, Blocks) else x


def weight_from_hf(parts: Sequence[Any], scheme: Optional[Scheme], put, axis: int = 0) -> Any:
    """HF-oriented ``[out_i, in]`` parts (numpy or `Blocks`) -> our ``[in, sum out_i]`` leaf, or with
    ``axis`` 1 (quantized only) a ``[sum out_i, in]`` one in the HF orientation (the head's).

    Float weights (``scheme`` None) go through ``put`` (the tree's dtype). Blocks whose
    format is the scheme's are packed as they are, with no float round trip; Q4_0 blocks
    become the int4 scheme exactly (offset -8 d). Anything else is dequantized and
    quantized once, here.
    """
    k = parts[0].shape[-1]
    if scheme is None or not scheme.fits(k):
        if axis == 1:
            raise ValueError(f"a [out, {k}] weight does not take the quantization {scheme}")
        return put(np.concatenate([as_float(p) for p in parts], axis=0).T)
    if all(isinstance(p, Blocks) for p in parts) and scheme.group == 32:
        kept = [_match(p, scheme) for p in parts]
        if all(x is not None for x in kept):
            fields = [np.concatenate([x.values for x in kept], axis=0), np.concatenate([x.scale for x in kept], axis=0),
                      np.concatenate([x.offset for x in kept], axis=0) if scheme.offset else None]
            if axis == 0:
                fields = [None if a is None else a.T for a in fields]
            q = pack(fields[0].astype(np.int32), scheme.bits) if axis == 0 else pack(fields[0].T, scheme.bits).T
            side = [None if a is None else np.ascontiguousarray(a) for a in fields[1:]]
            return QuantizedWeight(np.ascontiguousarray(q), side[0], side[1], scheme.bits, 32, axis)
    w = np.concatenate([as_float(p) for p in parts], axis=0)
    return quantize(w.T, scheme) if axis == 0 else quantize(w, scheme, axis=1)


def _match(b: Blocks, scheme: Scheme) -> Optional[Blocks]:
    """``b`` in the scheme's exact form, or None when only a requantization gets there."""
    if b.bits != scheme.bits or b.group != scheme.group:
        return None
    if scheme.offset == (b.offset is not None):
        return b
    if scheme.offset and b.offset is None and b.bits == 4:  # Q4_0 -> asymmetric: d (u - 8) = d u + (-8 d)
        return Blocks(b.values, b.scale, (b.scale.astype(np.float32) * -8).astype(np.float16), 4, b.kind)
    return None


def scheme_for(mode: Optional[str], layer_types: Sequence[str], head_types: Sequence[str] = ()) -> Optional[str]:
    """`ModelConfig.quant` for a user's ``mode``, given the GGUF block types of the source's layer
    weights and of its embeddings / LM head (empty for float tensors): Q8_0 blocks are kept."""
    if mode is None:
        return None
    q8 = lambda types: bool(types) and all(t == "Q8_0" for t in types)  # noqa: E731
    if mode == "int8":
        return "int8-g32" if q8(layer_types) and (q8(head_types) or not head_types) else "int8"
    return "int4-g32/int8-g32" if q8(head_types) else "int4-g32"


HEAD_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def describe_sources(tensors: dict, name: str) -> str:
    """What a conversion to ``name`` (`ModelConfig.quant`) does with a source's tensors: which GGUF
    blocks it keeps as they are and which it requantizes (by GGML type), and how many float
    tensors it quantizes."""
    layers, head = Scheme.pair(name)
    kept, requant = collections.Counter(), collections.Counter()
    floats = 0
    for nm, t in tensors.items():
        scheme = head if nm in HEAD_TENSORS else layers
        if isinstance(t, Blocks):
            (kept if scheme.group == 32 and _match(t, scheme) is not None else requant)[t.kind] += 1
        elif np.ndim(t) == 2:
            floats += 1
    parts = [f"GGUF blocks kept: {sum(kept.values())} ({', '.join(f'{k} {v}' for k, v in sorted(kept.items()))})"
             if kept else "", f"requantized: {', '.join(f'{k} {v}' for k, v in sorted(requant.items()))}"
             if requant else "", f"from float: {floats} tensors" if floats and not (kept or requant) else ""]
    return "; ".join(p for p in parts if p) or "nothing to quantize"


def summary(params: Any) -> dict:
    """{"quantized": bytes of quantized leaves, "float": bytes of the others, "weights": count quantized}."""
    out = {"quantized": 0, "float": 0, "weights": 0}
    for x in jax.tree.leaves(params, is_leaf=is_quantized):
        if is_quantized(x):
            out["quantized"] += x.nbytes
            out["weights"] += 1
        else:
            out["float"] += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    return out


def quantize_params(params: Any, cfg: Any, mode: str) -> tuple[Any, Any]:
    """A float parameter tree of ``cfg`` -> (config with `ModelConfig.quant` set, the quantized tree).

    The tree's quantized leaves are numpy (host) arrays; the other leaves are left as they are.
    Which leaves: those whose spec has a quantization role (`jaxinfer.ops.spec.model_specs`).
    Research code and `jaxinfer.LLM.from_params` use this; a model file is quantized while it is
    converted (`jaxinfer.models.weights_table.params_from_hf`), keeping GGUF blocks where it can.
    """
    if cfg.quant:
        raise ValueError(f"the parameters are already quantized ({cfg.quant})")
    name = default_scheme(check_mode(mode))
    scheme, head = Scheme.pair(name)
    roles = [s.quant for s in jax.tree.leaves(model_specs(cfg), is_leaf=is_spec)]
    leaves, treedef = jax.tree.flatten(params)
    if len(roles) != len(leaves):
        raise ValueError(f"params: {len(leaves)} leaves, the model's tree has {len(roles)}")

    def weight(x: Any, role: str) -> Any:
        if role == "layer" and scheme.fits(x.shape[0]):
            return quantize(np.asarray(x, np.float32), scheme)
        if role == "embed" and head.fits(x.shape[1]):  # [vocab, hidden]
            return quantize(np.asarray(x, np.float32), head, axis=1)
        if role == "head" and head.fits(x.shape[0]):  # [hidden, vocab] -> [vocab, hidden]
            return quantize(np.asarray(x, np.float32).T, head, axis=1)
        return x

    return dataclasses.replace(cfg, quant=name), jax.tree.unflatten(treedef, [weight(x, r) for x, r in zip(leaves, roles)])


def float_copy_check(k: int, n: int, rows: int, name: str, matmul: Optional[Callable[[Any, Any], Any]] = None) -> dict:
    """Compile one product of ``rows`` float32 rows with a random ``[k, n]`` weight quantized by
    ``name`` on the default device, the way a step does (``matmul``: pass `jaxinfer.models.decoder.matmul`;
    by default XLA's product, a dequantization and a float32 dot, which is that matmul's path on GPU
    and TPU), and
    report the compiled program's temporary memory: a program that materialises a float copy of
    the weight needs at least ``4 k n`` bytes of it (GPU and TPU should fuse the dequantization
    into the product: ``fused``; XLA's CPU backend does not, which is why decode's products there
    go to `jaxinfer.ops.cpu_matmul`)."""
    w = quantize(np.random.default_rng(0).normal(size=(k, n)).astype(np.float32), Scheme.parse(name))
    w = jax.tree.map(jnp.asarray, w)
    x = jnp.ones((rows, k), jnp.float32)
    compiled = jax.jit(matmul or _xla_product).lower(x, w).compile()
    mem = compiled.memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else -1
    float_bytes = 4 * k * n
    return {"scheme": name, "k": k, "n": n, "rows": rows, "temp_bytes": temp, "float_copy_bytes": float_bytes,
            "fused": 0 <= temp < float_bytes // 2, "custom_call": "custom_call" in compiled.as_text()}


def _xla_product(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    dims = (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(x, w.dequantize(jnp.float32), dims, preferred_element_type=jnp.float32)
