"""Every weight of the decoder, described once: one table per layer kind, and the views derived from it.

A `jaxinfer.ops.spec.WeightDesc` says all there is about one parameter leaf: its key in the
parameter tree, its shape and logical axes, its initialisation, the Hugging Face tensors it
is made of and how they fuse (q|k|v, gate|up, one per expert), llama.cpp's name for each and
whether llama.cpp's converter re-ordered its rows, its tensor-parallel relayout, and its
quantization role. The tables:

- `ATTENTION`: the fused Q/K/V projection, the output projection, Q/K/V biases, per-head Q/K norms;
- `NORMS`: the norms before attention and the MLP, and Gemma's sandwich norms after them;
- `DENSE_MLP`: the fused gate/up projection and the down projection;
- `MOE`: the router and the stacked experts (`jaxinfer.models.moe` runs them);
- `MODEL`: the embeddings, the final norm and the LM head.

Derived here: the parameter specs (`param_specs`), the Hugging Face tensors a checkpoint holds
(`hf_tensor_shapes`), the converter from them (`params_from_hf`) and the GGUF name map
(`gguf_names`). Derived elsewhere from the specs' rules: the tensor-parallel relayouts
(`jaxinfer.ops.mesh`) and the quantized tree (`jaxinfer.ops.quant.quantize_specs`,
`quantize_params`). A new weight is one `WeightDesc` in one table (and its use in the forward pass).

The parameter tree is typed: one frozen dataclass per table, made from it (`Attention`, `Norms`,
`DenseMLP`, `RoutedMLP`: a field per weight the table names, None where the config has no such
weight), a `Layer` of three of them (``attention``, ``norms``, ``mlp``), and the model's `Params`
(``embed``, ``final_norm``, ``lm_head`` (None when tied), ``layers``). All are JAX pytrees; the
forward pass reads ``layer.attention.wqkv``, and a leaf's path names its block and weight
(``params.layers[3].mlp.w_down``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.ops import quant
from jaxinfer.ops.spec import Source, WeightDesc

def _q(cfg: ModelConfig) -> int:
    return cfg.q_size


def _kv(cfg: ModelConfig) -> int:
    return cfg.kv_size


def _qkv(cfg: ModelConfig) -> int:
    return cfg.q_size + 2 * cfg.kv_size


def _ffn(cfg: ModelConfig) -> int:
    return cfg.intermediate_size


def _moe_ffn(cfg: ModelConfig) -> int:
    return cfg.moe_intermediate_size


def _shared_ffn(cfg: ModelConfig) -> int:
    return cfg.shared_expert_intermediate_size


_Q = Source("self_attn.q_proj", "attn_q", _q, rope_heads="num_heads")
_K = Source("self_attn.k_proj", "attn_k", _kv, rope_heads="num_kv_heads")
_V = Source("self_attn.v_proj", "attn_v", _kv)

_O = Source("self_attn.o_proj", "attn_output")

ATTENTION: tuple[WeightDesc, ...] = (
    WeightDesc("wqkv", lambda c: (c.hidden_size, _qkv(c)), ("embed", "qkv"), (_Q, _K, _V),
               relayout=(1, "qkv"), quant="layer", requires=("!latent",)),
    WeightDesc("wo", lambda c: (c.q_size, c.hidden_size), ("heads", "embed"), (_O,), relayout=(0, "wo"),
               quant="layer", requires=("!latent",)),
    WeightDesc("bqkv", lambda c: (_qkv(c),), ("qkv",), (_Q, _K, _V), kind="vector", init="zeros", suffix="bias",
               relayout=(0, "qkv"), requires=("attention_bias",)),
    WeightDesc("q_norm", lambda c: (c.head_dim,), (None,), (Source("self_attn.q_norm", "attn_q_norm"),),
               kind="vector", init="norm", requires=("qk_norm",)),
    WeightDesc("k_norm", lambda c: (c.head_dim,), (None,), (Source("self_attn.k_norm", "attn_k_norm"),),
               kind="vector", init="norm", requires=("qk_norm",)),
)


def _qk_head(cfg: ModelConfig) -> int:
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


# Multi-head latent attention (DeepSeek): the query through a low-rank bottleneck (or one projection), the
# key/value through one latent shared by the heads (plus a shared rotary key), the latent's up-projection
# per head (``wkv_b``: [heads, nope key rows | value rows, latent], Hugging Face's rows as they are, never
# quantized: the absorbed attention folds it into the query and the output,
# `jaxinfer.models.transformer.latent_attention`).
LATENT_ATTENTION: tuple[WeightDesc, ...] = (
    WeightDesc("wq", lambda c: (c.hidden_size, c.num_heads * _qk_head(c)), ("embed", "heads"),
               (Source("self_attn.q_proj", "attn_q"),), relayout=(1, "latent_q"), quant="layer",
               requires=("latent", "!q_lora_rank")),
    WeightDesc("wq_a", lambda c: (c.hidden_size, c.q_lora_rank), ("embed", None),
               (Source("self_attn.q_a_proj", "attn_q_a"),), quant="layer", requires=("latent", "q_lora_rank")),
    WeightDesc("q_a_norm", lambda c: (c.q_lora_rank,), (None,), (Source("self_attn.q_a_layernorm", "attn_q_a_norm"),),
               kind="vector", init="norm", requires=("latent", "q_lora_rank")),
    WeightDesc("wq_b", lambda c: (c.q_lora_rank, c.num_heads * _qk_head(c)), (None, "heads"),
               (Source("self_attn.q_b_proj", "attn_q_b"),), relayout=(1, "latent_q"), quant="layer",
               requires=("latent", "q_lora_rank")),
    WeightDesc("wkv_a", lambda c: (c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim), ("embed", None),
               (Source("self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"),), quant="layer", requires=("latent",)),
    WeightDesc("kv_a_norm", lambda c: (c.kv_lora_rank,), (None,),
               (Source("self_attn.kv_a_layernorm", "attn_kv_a_norm"),), kind="vector", init="norm",
               requires=("latent",)),
    WeightDesc("wkv_b", lambda c: (c.num_heads, c.qk_nope_head_dim + c.head_dim, c.kv_lora_rank), ("heads", None, None),
               (Source("self_attn.kv_b_proj", "attn_kv_b"),), kind="heads", relayout=(0, "latent_heads"),
               requires=("latent",)),
    WeightDesc("wo", lambda c: (c.q_size, c.hidden_size), ("heads", "embed"), (_O,), relayout=(0, "wo"),
               quant="layer", requires=("latent",)),
)


def _norm(name: str, hf: str, gguf: str, *requires: str) -> WeightDesc:
    return WeightDesc(name, lambda c: (c.hidden_size,), ("embed",), (Source(hf, gguf),), kind="vector", init="norm",
                      requires=requires)


# Llama's "post_attention_layernorm" is the norm before the MLP; Gemma names that one
# "pre_feedforward_layernorm" and uses "post_attention_layernorm" on the attention output.
NORMS: tuple[WeightDesc, ...] = (
    _norm("attn_norm", "input_layernorm", "attn_norm"),
    _norm("mlp_norm", "post_attention_layernorm", "ffn_norm", "!sandwich_norms"),
    _norm("mlp_norm", "pre_feedforward_layernorm", "ffn_norm", "sandwich_norms"),
    _norm("attn_out_norm", "post_attention_layernorm", "post_attention_norm", "sandwich_norms"),
    _norm("mlp_out_norm", "post_feedforward_layernorm", "post_ffw_norm", "sandwich_norms"),
)

DENSE_MLP: tuple[WeightDesc, ...] = (
    WeightDesc("w_gate_up", lambda c: (c.hidden_size, 2 * _ffn(c)), ("embed", "mlp"),
               (Source("mlp.gate_proj", "ffn_gate", _ffn), Source("mlp.up_proj", "ffn_up", _ffn)),
               relayout=(1, "gate_up"), quant="layer"),
    WeightDesc("w_down", lambda c: (_ffn(c), c.hidden_size), ("mlp", "embed"), (Source("mlp.down_proj", "ffn_down"),),
               relayout=(0, "down"), quant="layer"),
)

# Experts: canonical names ``mlp.experts.E.{gate,up,down}_proj`` (one tensor each), stacked by
# llama.cpp into one ``ffn_{gate,up,down}_exps`` tensor; the router is ``mlp.gate``. Routers and
# experts stay float when the model is quantized.
MOE: tuple[WeightDesc, ...] = (
    WeightDesc("router", lambda c: (c.hidden_size, c.num_experts), ("embed", None), (Source("mlp.gate", "ffn_gate_inp"),)),
    WeightDesc("w_gate_up", lambda c: (c.num_experts, c.hidden_size, 2 * _moe_ffn(c)), ("expert", "embed", "mlp"),
               (Source("mlp.experts.{e}.gate_proj", "ffn_gate_exps", _moe_ffn),
                Source("mlp.experts.{e}.up_proj", "ffn_up_exps", _moe_ffn)),
               kind="experts", relayout=(2, "expert_gate_up")),
    WeightDesc("w_down", lambda c: (c.num_experts, _moe_ffn(c), c.hidden_size), ("expert", "mlp", "embed"),
               (Source("mlp.experts.{e}.down_proj", "ffn_down_exps"),), kind="experts", relayout=(1, "expert_down")),
    # DeepSeek-V3's per-expert bias, added to the scores for choosing the experts only
    WeightDesc("router_bias", lambda c: (c.num_experts,), (None,), (Source("mlp.gate", "exp_probs_b"),),
               kind="vector", init="zeros", suffix="e_score_correction_bias", requires=("router_bias",)),
    # DeepSeek's shared experts: one gated MLP every token runs beside its routed experts
    WeightDesc("shared_gate_up", lambda c: (c.hidden_size, 2 * _shared_ffn(c)), ("embed", "mlp"),
               (Source("mlp.shared_experts.gate_proj", "ffn_gate_shexp", _shared_ffn),
                Source("mlp.shared_experts.up_proj", "ffn_up_shexp", _shared_ffn)),
               relayout=(1, "shared_gate_up"), quant="layer", requires=("shared_expert_intermediate_size",)),
    WeightDesc("shared_down", lambda c: (_shared_ffn(c), c.hidden_size), ("mlp", "embed"),
               (Source("mlp.shared_experts.down_proj", "ffn_down_shexp"),), relayout=(0, "shared_down"),
               quant="layer", requires=("shared_expert_intermediate_size",)),
)

MODEL: tuple[WeightDesc, ...] = (
    WeightDesc("embed", lambda c: (c.vocab_size, c.hidden_size), ("vocab", "embed"),
               (Source("model.embed_tokens", "token_embd"),), kind="embed", quant="embed"),
    WeightDesc("final_norm", lambda c: (c.hidden_size,), ("embed",), (Source("model.norm", "output_norm"),),
               kind="vector", init="norm"),
    WeightDesc("lm_head", lambda c: (c.hidden_size, c.vocab_size), ("embed", "vocab"), (Source("lm_head", "output"),),
               kind="head", quant="head", requires=("!tie_word_embeddings",)),
)

LAYER_KINDS = {"attention": ATTENTION, "latent_attention": LATENT_ATTENTION, "norms": NORMS, "dense_mlp": DENSE_MLP,
               "moe": MOE}
ALL: tuple[WeightDesc, ...] = ATTENTION + LATENT_ATTENTION + NORMS + DENSE_MLP + MOE + MODEL


# ---------------------------------------------------------------------------
# the typed parameter tree: one pytree type per table


def _block_type(name: str, table: tuple[WeightDesc, ...], what: str) -> type:
    """A frozen dataclass pytree with one field per weight ``table`` names (None: not in this model)."""
    names = list(dict.fromkeys(d.name for d in table))
    cls = dataclasses.make_dataclass(name, [(n, Any, dataclasses.field(default=None)) for n in names], frozen=True)
    cls.__module__ = __name__  # so it pickles and prints as this module's (make_dataclass takes module= from 3.12)
    cls.__doc__ = f"{what}: {', '.join(names)} (a leaf each; None where the config has no such weight)."
    return jax.tree_util.register_dataclass(cls)


Attention = _block_type("Attention", ATTENTION, "A layer's attention weights (the `ATTENTION` table)")
LatentAttention = _block_type("LatentAttention", LATENT_ATTENTION,
                              "A layer's latent attention weights (the `LATENT_ATTENTION` table)")
Norms = _block_type("Norms", NORMS, "A layer's norms (the `NORMS` table)")
DenseMLP = _block_type("DenseMLP", DENSE_MLP, "A dense layer's gated MLP (the `DENSE_MLP` table)")
RoutedMLP = _block_type("RoutedMLP", MOE, "A routed layer's router and stacked experts (the `MOE` table)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    """One decoder layer's weights: its attention, its norms, and its MLP (dense or routed)."""

    attention: Any
    norms: Any
    mlp: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """A model's parameter tree (the `MODEL` table's weights and the layers). ``lm_head`` is None
    when the head is tied to the embeddings. Leaves are arrays, `jaxinfer.ops.spec.ArraySpec` (a spec
    tree) or `jaxinfer.ops.quant.QuantizedWeight`; `dataclasses.replace` makes a changed copy."""

    embed: Any
    final_norm: Any
    layers: list
    lm_head: Any = None


Block = Union[Attention, LatentAttention, Norms, DenseMLP, RoutedMLP]


def attention_table(cfg: ModelConfig) -> tuple[type, tuple[WeightDesc, ...]]:
    """The attention block type and table of ``cfg``: latent attention (DeepSeek) or the fused Q/K/V one."""
    return (LatentAttention, LATENT_ATTENTION) if cfg.latent else (Attention, ATTENTION)


def build_tree(cfg: ModelConfig, leaf: Callable[[WeightDesc, str], Any]) -> Params:
    """The parameter tree of ``cfg`` with ``leaf(desc, hf_prefix)`` at each weight it holds."""

    def block(cls: type, table: tuple[WeightDesc, ...], prefix: str) -> Any:
        return cls(**{d.name: leaf(d, prefix) for d in table if d.present(cfg)})

    def layer(li: int) -> Layer:
        p = _prefix(li)
        mlp = block(RoutedMLP, MOE, p) if cfg.is_moe_layer(li) else block(DenseMLP, DENSE_MLP, p)
        return Layer(block(*attention_table(cfg), p), block(Norms, NORMS, p), mlp)

    return Params(**{d.name: leaf(d, "") for d in model_descs(cfg)}, layers=[layer(li) for li in range(cfg.num_layers)])


def layer_descs(cfg: ModelConfig, li: int) -> list[WeightDesc]:
    """The weights layer ``li`` of ``cfg`` holds, in canonical order."""
    mlp = MOE if cfg.is_moe_layer(li) else DENSE_MLP
    return [d for d in attention_table(cfg)[1] + NORMS + mlp if d.present(cfg)]


def model_descs(cfg: ModelConfig) -> list[WeightDesc]:
    return [d for d in MODEL if d.present(cfg)]


def _prefix(li: int) -> str:
    return f"model.layers.{li}."


# ---------------------------------------------------------------------------
# the parameter specs


def param_specs(cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """The parameter tree of ``cfg`` as `jaxinfer.ops.spec.ArraySpec` leaves (quantized by ``cfg.quant``)."""
    specs = build_tree(cfg, lambda d, _: d.spec(cfg, dtype))
    return quant.quantize_specs(specs, cfg.quant) if cfg.quant else specs


# ---------------------------------------------------------------------------
# Hugging Face tensors


def _source_shapes(d: WeightDesc, cfg: ModelConfig) -> list[tuple[int, ...]]:
    """The ``[out, in]`` (or 1-D) shape of each of ``d``'s sources (one expert's, for experts)."""
    shape = d.shape(cfg)
    if d.kind == "vector":
        return [(s.rows(cfg) if s.rows else shape[0],) for s in d.sources]
    if d.kind == "embed":
        return [shape]
    if d.kind == "head":
        return [shape[::-1]]
    if d.kind == "heads":
        return [(shape[0] * shape[1], shape[2])]
    k, n = shape[-2:]  # linear, experts: [.., in, out]
    return [(s.rows(cfg) if s.rows else n, k) for s in d.sources]


def _hf_entries(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    for d in model_descs(cfg):
        yield from zip(d.hf_names(""), _source_shapes(d, cfg))
    for li in range(cfg.num_layers):
        descs = layer_descs(cfg, li)
        for d in descs:
            if d.kind != "experts":
                yield from zip(d.hf_names(_prefix(li)), _source_shapes(d, cfg))
        experts = [d for d in descs if d.kind == "experts"]
        for e in range(cfg.num_experts if experts else 0):  # expert by expert: gate, up, down
            for d in experts:
                yield from zip(d.hf_names(_prefix(li), e), _source_shapes(d, cfg))


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` must hold, by canonical HF name, with its numpy shape."""
    return dict(_hf_entries(cfg))


def params_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """Convert canonical Hugging Face tensors (``[out, in]`` weights) to our parameter tree.

    The tree is in host memory (numpy arrays of ``dtype``): `jaxinfer.ops.mesh.place_params` puts it
    on the devices, each device receiving only its shard. Weights with a quantization role are
    quantized by ``cfg.quant`` (GGUF blocks of the scheme's format kept as they are).
    """
    host_dtype = np.dtype(jnp.dtype(dtype))
    scheme, head = quant.Scheme.pair(cfg.quant) if cfg.quant else (None, None)

    def raw(name: str) -> Any:
        try:
            return tensors[name]
        except KeyError:
            raise ValueError(f"weights are missing tensor {name!r}") from None

    def get(name: str) -> np.ndarray:  # a float tensor (GGUF blocks kept for quantized weights: dequantized)
        return quant.as_float(raw(name))

    def put(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).astype(host_dtype, copy=False)

    def leaf(d: WeightDesc, prefix: str) -> Any:
        if d.kind == "vector":
            names = d.hf_names(prefix)
            return put(get(names[0]) if len(names) == 1 else np.concatenate([get(n) for n in names]))
        if d.kind == "linear":  # [out, in] parts fused on out -> [in, out]
            return quant.weight_from_hf([raw(n) for n in d.hf_names(prefix)], scheme if d.quant else None, put)
        if d.kind == "experts":
            return put(np.stack([np.concatenate([get(n) for n in d.hf_names(prefix, e)], axis=0).T
                                 for e in range(cfg.num_experts)]))
        if d.kind == "heads":  # [heads x rows, in] -> [heads, rows, in]
            return put(get(d.hf_names(prefix)[0]).reshape(d.shape(cfg)))
        # the embeddings or the LM head: quantized in the HF orientation [vocab, hidden], else float
        # ([vocab, hidden] embeddings, [hidden, vocab] head)
        w = raw(d.hf_names(prefix)[0])
        if head is not None and head.fits(w.shape[1]):
            return quant.weight_from_hf([w], head, put, axis=1)
        w = quant.as_float(w)
        return put(w if d.kind == "embed" else w.T)

    return build_tree(cfg, leaf)


# ---------------------------------------------------------------------------
# GGUF names


@dataclass(frozen=True)
class GGUFName:
    """What one llama.cpp tensor stem is: its canonical stem (``{e}``: each expert of a stacked tensor),
    whether it is in a layer (``blk.N.``), the config field counting the heads whose rotary halves
    llama.cpp's converter interleaved in its rows (empty: rows as they are), and whether it is a norm."""

    hf: str
    layer: bool
    experts: bool
    rope_heads: str
    norm: bool
    suffix: str = ""  # the canonical name's suffix where it is not llama.cpp's (V3's ``e_score_correction_bias``)


@functools.lru_cache(maxsize=None)
def gguf_names(sandwich_norms: bool = False, latent: bool = False) -> dict[str, GGUFName]:
    """llama.cpp's tensor names -> `GGUFName`: layer stems (``attn_q``) and whole model names
    (``token_embd.weight``). ``sandwich_norms``: Gemma's naming, whose ``ffn_norm`` is the
    pre-feedforward norm (Llama's is ``post_attention_layernorm``); ``latent``: DeepSeek's
    (``deepseek2``), whose ``attn_q`` is the latent attention's plain query projection."""
    out: dict[str, GGUFName] = {}
    flags = {"sandwich_norms": sandwich_norms, "latent": latent}
    for d in ALL:
        if any(f.lstrip("!") in flags and flags[f.lstrip("!")] == f.startswith("!") for f in d.requires):
            continue
        layer = d not in MODEL
        for s in d.sources:
            key = s.gguf if layer else f"{s.gguf}.{d.suffix}"
            own = d.suffix if d.suffix not in ("weight", "bias") else ""
            out[key] = GGUFName(s.hf, layer, d.kind == "experts", s.rope_heads, d.init == "norm", own)
    return out


def head_tensors() -> tuple[str, ...]:
    """The canonical names of the weights quantized with the head's scheme (the embeddings, the LM head)."""
    return tuple(n for d in MODEL if d.quant in ("embed", "head") for n in d.hf_names(""))
