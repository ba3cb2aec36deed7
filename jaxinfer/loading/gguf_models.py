"""GGUF files of llama.cpp's architectures as jaxinfer models: a `ModelConfig` and canonical tensors.

A GGUF written by llama.cpp's converter (``convert_hf_to_gguf.py``, since split into
``conversion/*.py``) holds a Hugging Face model under llama.cpp's own tensor names, layout and
metadata keys, and llama.cpp's loader (``src/llama-model.cpp``, ``src/models/<arch>.cpp``)
fills in what the file leaves out by rules of its own. This module undoes the one and mirrors
the other, per ``general.architecture``, so that a GGUF and the safetensors of one model give
the same `ModelConfig` (``jaxinfer.models.config_from_hf``) and the same canonical tensors (the
naming of `jaxinfer.models.decoder`), hence the same logits.

Supported architectures (`ARCHITECTURES`) and what each needs undone or filled in:

- ``llama`` (also the non-llama.cpp name ``mistral``): the converter permutes the rows of the
  Q and K projections (``LlamaModel.permute``: each head's two rotary halves interleaved, for
  llama.cpp's adjacent-pair RoPE); undone with `jaxinfer.loading.llamacpp.unpermute_rotary`. Llama 3
  RoPE scaling is stored as a ``rope_freqs`` tensor of per-frequency divisors (computed from
  the HF config's factor, low/high frequency factors and an original context of 8192), from
  which the parameters are recovered. With ``expert_count`` it is Mixtral: ``ffn_gate_inp``
  (router) and ``ffn_{gate,up,down}_exps`` stacks, routing always renormalised (llama.cpp's
  ``build_moe_ffn(..., norm_w=true)``). llama.cpp ignores a sliding window on this
  architecture, and so does this loader.
- ``qwen2``: Q/K/V biases (``attn_{q,k,v}.bias``), rows not permuted (Qwen2Model is not a
  LlamaModel).
- ``qwen3``: per-head ``attn_q_norm`` / ``attn_k_norm``, a head_dim of its own
  (``attention.key_length``).
- ``qwen3moe``: Qwen3 attention with routed experts in every layer: ``expert_count``,
  ``expert_used_count``, ``expert_feed_forward_length`` (llama.cpp's fallback when absent:
  ``feed_forward_length / expert_used_count``), softmax routing renormalised over the top k
  (hard-coded ``norm_w=true`` in llama.cpp's qwen3moe graph; an explicit
  ``expert_weights_norm`` key is honoured). The converter stacks the per-expert matrices into
  ``[n_expert, rows, cols]`` tensors; they are split back into
  ``mlp.experts.E.{gate,up,down}_proj.weight``.
- ``gemma3``: the converter adds 1 to every ``*norm.weight`` (Gemma3RMSNorm scales by
  ``1 + w``), q_norm and k_norm included; 1 is subtracted back. ``ffn_norm`` is the
  pre-feedforward norm here, ``post_attention_norm`` and ``post_ffw_norm`` the sandwich
  norms. llama.cpp hard-codes the rest (``llama_model_gemma3`` hparams): sliding-window
  attention only when ``attention.sliding_window`` is set and non-zero, every 6th layer
  global (``set_swa_pattern(6)``: layer ``i`` slides unless ``(i + 1) % 6 == 0``), local
  layers' RoPE base 10000 unscaled, the global layers with ``rope.freq_base`` and the file's
  scaling (linear for the 4B and larger); the attention scale is
  ``(hidden_size / head_count) ** -0.5`` for the 27B (62 layers) and
  ``key_length ** -0.5`` otherwise (Gemma's query_pre_attn_scalar); embeddings scaled by
  sqrt(hidden_size); tanh GELU; ``final_logit_softcapping`` when the file has it.
- ``deepseek2`` (DeepSeek-V2/V3, `jaxinfer.models.deepseek`; converter ``DeepseekV2Model`` in
  ``conversion/deepseek.py``, loader ``llama_model_deepseek2::load_arch_hparams`` /
  ``load_arch_tensors`` and its graph in ``src/models/deepseek2.cpp``, routing in
  ``llm_graph_context::build_moe_ffn``, ``src/llama-graph.cpp``): multi-head latent attention
  (``attention.kv_lora_rank``; ``attention.q_lora_rank`` with ``attn_q_a``/``attn_q_a_norm``/
  ``attn_q_b``, or absent with a plain ``attn_q``; ``rope.dimension_count`` is qk_rope_head_dim;
  RoPE on adjacent pairs, LLAMA_ROPE_TYPE_NORM, i.e. ``rope_interleave``). Newer files are in the
  absorbed layout (``llama_hparams::is_mla``): ``attention.key_length_mla`` = qk_nope + qk_rope and
  ``value_length_mla`` = v_head_dim (the plain lengths are kv_lora_rank + qk_rope and kv_lora_rank),
  ``head_count_kv`` 1, and ``kv_b_proj`` split per head into ``attn_k_b`` (numpy [heads,
  kv_lora_rank, qk_nope], the key rows transposed) and ``attn_v_b`` ([heads, v_head,
  kv_lora_rank]), joined back here (`kv_b_from_split`); older files have the per-head lengths
  under ``key_length``/``value_length`` and one ``attn_kv_b``. The un-absorbed view the model
  config takes: ``num_kv_heads`` = heads, ``head_dim`` = v_head_dim. Experts after
  ``leading_dense_block_count`` dense layers: ``expert_feed_forward_length``,
  ``expert_shared_count`` shared experts (``ffn_*_shexp``) of that size each,
  ``expert_gating_func`` (1 softmax, 2 sigmoid; absent: softmax, llama.cpp's fallback for older
  V2 files), ``exp_probs_b.bias`` (V3's ``e_score_correction_bias``), ``expert_weights_norm``
  (absent: false), ``expert_weights_scale`` (routed_scaling_factor; 0 or absent: none),
  ``expert_group_count`` / ``expert_group_used_count`` (absent or 1: no group limit; a group
  scores the sum of its best two, V3's noaux_tc: V2's group_limited_greedy, which scores the
  group max, has no GGUF form). Sigmoid gating or a correction bias makes the model
  ``deepseek_v3``, else ``deepseek_v2``. YaRN: ``rope.scaling.yarn_log_multiplier`` is 0.1 x
  mscale_all_dim ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: divided back by the loader) and llama.cpp
  takes mscale equal to it, so the rope's attention factor is ``rope.scaling.attn_factor``
  (times mscale(factor) when there is no multiplier) and the softmax scale is multiplied by
  (that factor x mscale(factor, mscale_all_dim))^2 (`_deepseek2_yarn`). Refused: another
  gating function, Mistral-Large's ``attention.temperature_scale``, rope scaling other than
  yarn, routers not in exactly the layers after the dense ones.

Every architecture: RoPE scaling from ``rope.scaling.type`` (llama.cpp's default "linear"
when only a factor is given) with ``rope.scaling.factor`` (or the old ``rope.scale_linear``);
yarn with ``rope.scaling.original_context_length`` (default: the context length),
``yarn_beta_fast`` / ``yarn_beta_slow`` (32 / 1) and llama.cpp's attention factor
(``0.1 ln(factor) + 1``, divided by the same with ``yarn_log_multiplier`` when set, times
``rope.scaling.attn_factor``; ``llama_context`` recomputes it, ignoring ``yarn_attn_factor``).
End-of-generation tokens as llama.cpp's vocabulary collects them: ``eos_token_id``,
``eot_token_id``, ``eom_token_id``, and the end-of-turn markers found by their text.

Anything a file asks for that the engine does not implement is refused with one line that
names the architecture and the feature (`UnsupportedGGUF`, a ValueError).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Optional

import numpy as np

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, GenerationDefaults, ModelConfig, RopeScaling
from jaxinfer.gguf_file import GGUFFile, GGUFTensorInfo
from jaxinfer.loading.llamacpp import llama3_rope_divisors, unpermute_rotary
from jaxinfer.models import get_family
from jaxinfer.models.hf_config import layer_type_fields, mscale_of
from jaxinfer.models.weights_table import gguf_names

__all__ = [
    "ARCHITECTURES",
    "GGUFModel",
    "TensorRead",
    "UnsupportedGGUF",
    "architecture",
    "canonical_names",
    "dequantize",
    "generation_defaults",
    "kv_b_from_split",
    "read_model",
    "tensor_count",
]


class UnsupportedGGUF(ValueError):
    """A GGUF file of an architecture, or asking for a feature, the engine does not implement."""


# --------------------------------------------------------------------------- #
# Architectures
# --------------------------------------------------------------------------- #

# llama.cpp's tensor names (gguf-py/gguf/constants.py TENSOR_NAMES) -> canonical names: the weights
# table's (`jaxinfer.models.weights_table.gguf_names`); which of them a file may hold is its config's.
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"


# DeepSeek's kv_b_proj as the converter splits it for the absorbed attention (DeepseekV2Model.modify_tensors):
# per head, its no-rope key rows transposed (attn_k_b: numpy [heads, kv_lora_rank, qk_nope]) and its value
# rows (attn_v_b: [heads, v_head, kv_lora_rank]); older files hold the whole attn_kv_b.
_KV_B = "self_attn.kv_b_proj"
_SPLIT_KV_B = ("attn_k_b", "attn_v_b")


@dataclass(frozen=True)
class Arch:
    """How llama.cpp stores one architecture, and what its loader hard-codes."""

    name: str  # general.architecture
    family: str  # ModelConfig.architecture (dense models; MoE may differ, see _moe_fields)
    fields: Callable[["_Header", dict[str, Any]], dict[str, Any]]  # the architecture's own ModelConfig fields
    permuted_qk: bool = False  # the converter permuted Q/K rows (LlamaModel.permute)
    norm_shift: float = 0.0  # the converter added this to every *norm.weight (Gemma: 1)
    default_eps: float = 1e-6
    sandwich_norms: bool = False  # Gemma's norms: ffn_norm is the pre-feedforward one, two more after
    latent: bool = False  # multi-head latent attention (deepseek2): its own head sizes, attn_k_b/attn_v_b

    @property
    def names(self) -> dict:
        """llama.cpp tensor names -> `jaxinfer.models.weights_table.GGUFName`, in this architecture's naming."""
        return gguf_names(self.sandwich_norms, self.latent)


def _llama_fields(h: "_Header", f: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp: with experts this is Mixtral, every layer routed, always renormalised.
    if not h.get_int("expert_count", 0):
        return {}
    moe = _moe_fields(h, f, ffn=f["intermediate_size"], norm_default=True)
    return {"architecture": "mixtral", **moe}


def _qwen2_fields(h: "_Header", f: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True}


def _qwen3_fields(h: "_Header", f: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True}


def _qwen3moe_fields(h: "_Header", f: dict[str, Any]) -> dict[str, Any]:
    used = h.get_int("expert_used_count", 0)
    ffn = h.get_int("expert_feed_forward_length", 0) or (f["intermediate_size"] // used if used else 0)
    return {"qk_norm": True, **_moe_fields(h, f, ffn=ffn, norm_default=True)}


def _gemma3_fields(h: "_Header", f: dict[str, Any]) -> dict[str, Any]:
    arch, n = h.arch, f["num_layers"]
    if h.get_float("attn_logit_softcapping", 0.0):
        raise h.refuse("attention logit softcapping")
    window = h.get_int("attention.sliding_window", 0)
    derived = [SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(n)]
    pattern = h.get("attention.sliding_window_pattern")
    if window and pattern is not None and _swa_flags(pattern, n) != [t == SLIDING_ATTENTION for t in derived]:
        raise h.refuse(f"attention.sliding_window_pattern {pattern!r} (llama.cpp runs gemma3 with every 6th layer global)")
    local_theta = h.get("rope.freq_base_swa")
    if window and local_theta is not None and _f32(local_theta) != 10000.0:
        raise h.refuse(f"rope.freq_base_swa {_f32(local_theta)} (llama.cpp runs gemma3's local layers with 10000)")
    if f["rope_scaling"] is not None and f["rope_scaling"].rope_type == "llama3":
        raise h.refuse("Llama-3 rope_freqs")
    # llama_model_gemma3: 1/sqrt(n_embd / n_head) for the 27B (62 layers), else 1/sqrt(head_dim).
    scalar = f["hidden_size"] // f["num_heads"] if n == 62 else f["head_dim"]
    softcap = h.get_float("final_logit_softcapping", 0.0)
    return dict(
        layer_type_fields({}, arch, n, window or None, derived),
        local_rope_theta=10000.0,
        qk_norm=True,
        query_pre_attn_scalar=float(scalar),
        norm_weight_offset=1.0,
        sandwich_norms=h.spec.sandwich_norms,
        embed_scale=float(f["hidden_size"]) ** 0.5,
        hidden_act="gelu_tanh",
        final_logit_softcap=softcap or None,
    )


# llama.cpp's llama_expert_gating_func_type (src/llama-hparams.h); 0 (none) reads as softmax for deepseek2
_GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}


def _deepseek2_fields(h: "_Header", f: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3 (`jaxinfer.models.deepseek`) as ``llama_model_deepseek2::load_arch_hparams`` reads the
    file and its graph (``src/models/deepseek2.cpp``) and ``build_moe_ffn`` compute it."""
    n, heads = f["num_layers"], f["num_heads"]
    if h.get_float("attention.temperature_scale", 0.0):
        raise h.refuse(f"attention.temperature_scale {h.get_float('attention.temperature_scale')} "
                       "(Mistral-Large's attention temperature)")
    kv_lora = h.get_int("attention.kv_lora_rank")
    q_lora = h.get_int("attention.q_lora_rank", 0)
    # llama.cpp reads q_lora_rank (required but for the "lite" models) and makes attn_q_a/attn_q_b when it is
    # set, else attn_q; the converter writes it only when set, so the query tensors tell
    if not (h.has_stem("attn_q_a") if q_lora else h.has_stem("attn_q")):
        raise h.refuse(f"attention.q_lora_rank {q_lora} but no {'attn_q_a' if q_lora else 'attn_q'} tensors")
    rope = h.get_int("rope.dimension_count")  # n_rot: the rotary dims of the query and of the shared key
    k_mla, v_mla = h.get_int("attention.key_length_mla", 0), h.get_int("attention.value_length_mla", 0)
    if k_mla and v_mla:  # the absorbed layout (llama_hparams::is_mla): the plain lengths are the latent's
        qk_head, v_head = k_mla, v_mla
        k_len, v_len = h.get_int("attention.key_length", 0), h.get_int("attention.value_length", 0)
        if (k_len, v_len) != (kv_lora + rope, kv_lora):
            raise h.refuse(f"attention.key_length {k_len} / value_length {v_len} with *_mla lengths "
                           f"(expected kv_lora_rank + rope {kv_lora + rope} / kv_lora_rank {kv_lora})")
    else:  # older files: the per-head lengths under the plain keys, one attn_kv_b
        qk_head = h.get_int("attention.key_length", 0) or f["hidden_size"] // heads
        v_head = h.get_int("attention.value_length", 0) or qk_head
    if rope <= 0 or rope % 2 or qk_head <= rope:
        raise h.refuse(f"rope.dimension_count {rope} with key heads of {qk_head} dims (needs even, fewer)")
    out: dict[str, Any] = dict(
        num_kv_heads=heads,  # the un-absorbed view: every head its own key and value
        head_dim=v_head,
        kv_lora_rank=kv_lora,
        q_lora_rank=q_lora,
        qk_nope_head_dim=qk_head - rope,
        qk_rope_head_dim=rope,
        rope_interleave=True,  # LLAMA_ROPE_TYPE_NORM: adjacent pairs
    )
    out.update(_deepseek2_yarn(h, f["rope_scaling"]))

    experts, lead = h.get_int("expert_count", 0), h.get_int("leading_dense_block_count", 0)
    routed = set(range(lead, n))
    if h.routed_layers != (routed if experts else set()):
        raise h.refuse(f"expert_count {experts}, leading_dense_block_count {lead} but routers "
                       f"(ffn_gate_inp) in layers {sorted(h.routed_layers)}")
    gating = h.get_int("expert_gating_func", 0)
    if gating not in _GATING:
        raise h.refuse(f"expert_gating_func {gating} (supported: 1 softmax, 2 sigmoid)")
    bias = h.has_stem("exp_probs_b")
    v3 = _GATING[gating] == "sigmoid" or bias
    out["architecture"] = "deepseek_v3" if v3 else "deepseek_v2"
    if not experts:
        return out
    if bias and {li for li in routed if h.has_stem("exp_probs_b", li)} != routed:
        raise h.refuse("exp_probs_b in some routed layers only")
    ffn = h.get_int("expert_feed_forward_length")
    groups = h.get_int("expert_group_count", 0)
    groups = groups if groups > 1 else 1  # build_moe_ffn groups only when n_expert_groups > 1
    out.update(
        num_experts=experts,
        num_experts_per_tok=h.get_int("expert_used_count"),
        moe_intermediate_size=ffn,
        norm_topk_prob=bool(h.get("expert_weights_norm", False)),
        dense_layers=tuple(range(min(lead, n))),
        shared_expert_intermediate_size=h.get_int("expert_shared_count", 0) * ffn,
        router_scoring=_GATING[gating],
        router_bias=bias,
        expert_groups=groups,
        topk_groups=h.get_int("expert_group_used_count", 1) if groups > 1 else 1,
        # llama.cpp scores a group by the sum of its best two (V3's noaux_tc); without groups: unused
        group_scoring="top2_sum" if groups > 1 else "max",
        # build_moe_ffn scales by expert_weights_scale when it is non-zero
        routed_scaling_factor=h.get_float("expert_weights_scale", 0.0) or 1.0,
        router_logits_float32=True,
    )
    return out


def _deepseek2_yarn(h: "_Header", scaling: Optional[RopeScaling]) -> dict[str, Any]:
    """``rope_scaling`` and ``attention_mscale`` as llama.cpp's deepseek2 computes them.

    ``yarn_log_multiplier`` is 0.1 x ``mscale_all_dim`` (the converter's factor, divided back out by
    ``load_arch_hparams``); ``llama_context`` sets the rope's attention factor to
    ``attn_factor / (1 + 0.1 ln s)`` with a multiplier (mscale taken equal to mscale_all_dim), else
    ``attn_factor`` (``get_mscale(s, 1)`` cancelled), and ggml's YaRN rope multiplies cos/sin by
    ``1 + 0.1 ln s`` again: R = ``attn_factor`` (times ``mscale(s)`` without a multiplier). The graph
    scales the softmax by ``(R * mscale(s, mscale_all_dim)) ** 2 / sqrt(qk_nope + qk_rope)``.
    """
    if scaling is None:
        if h.get_float("rope.scaling.attn_factor", 1.0) != 1.0:
            raise h.refuse("rope.scaling.attn_factor without yarn rope scaling")
        return dict(attention_mscale=1.0)
    if scaling.rope_type != "yarn":
        raise h.refuse(f"rope scaling type {scaling.rope_type!r} (llama.cpp's deepseek2 scales with yarn)")
    s = scaling.factor
    log_mul = h.get("rope.scaling.yarn_log_multiplier")
    # the decimal the converter wrote (0.1 x mscale_all_dim), shifted back: 0.0707 -> 0.707
    m_all = float(Decimal(str(np.float32(log_mul))) * 10) if log_mul else 0.0
    r = h.get_float("rope.scaling.attn_factor", 1.0) * (1.0 if m_all else mscale_of(s))
    return dict(rope_scaling=dataclasses.replace(scaling, attention_factor=r),
                attention_mscale=(r * mscale_of(s, m_all)) ** 2)


ARCHITECTURES: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("llama", "llama", _llama_fields, permuted_qk=True, default_eps=1e-5),
        Arch("mistral", "llama", _llama_fields, permuted_qk=True, default_eps=1e-5),
        Arch("qwen2", "qwen2", _qwen2_fields),
        Arch("qwen3", "qwen3", _qwen3_fields),
        Arch("qwen3moe", "qwen3_moe", _qwen3moe_fields),
        Arch("gemma3", "gemma3", _gemma3_fields, norm_shift=1.0, sandwich_norms=True),
        Arch("deepseek2", "deepseek_v2", _deepseek2_fields, latent=True),
    )
}


def architecture(gf: GGUFFile) -> Arch:
    """The file's `Arch`; `UnsupportedGGUF` for an architecture this engine does not run."""
    name = gf.get("general.architecture")
    if name not in ARCHITECTURES:
        raise UnsupportedGGUF(
            f"{gf.path}: unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def canonical_names(arch: Arch, name: str, num_experts: int = 0) -> Optional[list[str]]:
    """The canonical names a GGUF tensor holds (several for a stack of experts); None if unknown.
    Whether the model holds them is its config's (`_plan` checks them against it)."""
    names = arch.names
    g = names.get(name)
    if g is not None and not g.layer:
        return [f"{g.hf}.{name.rsplit('.', 1)[1]}"]
    m = _LAYER_TENSOR.match(name)
    if not m:
        return None
    layer, stem, kind = m.groups()
    if arch.latent and stem in _SPLIT_KV_B and kind == "weight":
        # the absorbed layout's halves of kv_b_proj: attn_k_b's read joins attn_v_b to it (`_plan`)
        return [f"model.layers.{layer}.{_KV_B}.weight"] if stem == "attn_k_b" else []
    g = names.get(stem)
    if g is None or not g.layer or (g.experts and kind != "weight") or (g.suffix and kind != "bias"):
        return None
    prefix = f"model.layers.{layer}."
    if g.suffix:  # llama.cpp's ``exp_probs_b.bias``: DeepSeek-V3's ``mlp.gate.e_score_correction_bias``
        return [f"{prefix}{g.hf}.{g.suffix}"]
    if g.experts:
        return [f"{prefix}{g.hf.format(e=e)}.weight" for e in range(num_experts)]
    return [f"{prefix}{g.hf}.{kind}"]


# --------------------------------------------------------------------------- #
# Header
# --------------------------------------------------------------------------- #


def _f32(v: Any) -> float:
    """A GGUF float32 as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def _swa_flags(pattern: Any, n: int) -> list[bool]:
    """``attention.sliding_window_pattern`` as one flag per layer (True: sliding)."""
    if isinstance(pattern, list):
        return [bool(x) for x in pattern]
    p = int(pattern)
    return [p > 0 and i % p < p - 1 for i in range(n)]


class _Header:
    """The ``<arch>.*`` keys of a file, read the way llama.cpp reads them."""

    def __init__(self, gf: GGUFFile, arch: Arch):
        self.gf, self.arch, self.spec = gf, arch.name, arch
        # layers with a router: the routed ones of a mixture of experts
        self.stems: dict[str, set[int]] = {}  # layer tensor stem -> the layers holding it
        for t in gf.tensors:
            if m := _LAYER_TENSOR.match(t.name):
                self.stems.setdefault(m.group(2), set()).add(int(m.group(1)))
        self.routed_layers = self.stems.get("ffn_gate_inp", set())

    def has_stem(self, stem: str, layer: Optional[int] = None) -> bool:
        """Whether the file holds ``blk.N.<stem>.*`` (for layer ``layer``, or for any layer)."""
        layers = self.stems.get(stem, set())
        return bool(layers) if layer is None else layer in layers

    def refuse(self, feature: str) -> UnsupportedGGUF:
        return UnsupportedGGUF(f"{self.gf.path}: {self.arch}: unsupported GGUF feature: {feature}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.gf.get(f"{self.arch}.{key}", default)

    def _scalar(self, key: str, default: Any) -> Any:
        v = self.get(key)
        if v is None:
            return default
        if isinstance(v, list):  # a per-layer array: fine when every layer agrees
            if not v:
                return default
            if len(set(v)) != 1:
                raise self.refuse(f"per-layer {key} {v}")
            v = v[0]
        return v

    def get_int(self, key: str, default: Optional[int] = None) -> int:
        v = self._scalar(key, default)
        if v is None:
            raise ValueError(f"{self.gf.path}: GGUF header lacks {self.arch}.{key}")
        return int(v)

    def get_float(self, key: str, default: Optional[float] = None) -> float:
        v = self._scalar(key, default)
        if v is None:
            raise ValueError(f"{self.gf.path}: GGUF header lacks {self.arch}.{key}")
        return _f32(v)


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


def _moe_fields(h: _Header, f: dict[str, Any], *, ffn: int, norm_default: bool) -> dict[str, Any]:
    scale = h.get_float("expert_weights_scale", 0.0)
    if scale not in (0.0, 1.0):  # build_moe_ffn scales the routing weights unless 0 or 1
        raise h.refuse(f"expert_weights_scale {scale}")
    if h.get_int("expert_shared_count", 0):
        raise h.refuse(f"shared experts (expert_shared_count {h.get_int('expert_shared_count')})")
    gating = h.get("expert_gating_func")
    if gating not in (None, 0, 1):  # none / softmax
        raise h.refuse(f"expert_gating_func {gating} (only softmax routing)")
    norm = h.get("expert_weights_norm")
    dense = tuple(sorted(li for li in range(f["num_layers"]) if li not in h.routed_layers))
    lead = h.get_int("leading_dense_block_count", 0)
    if lead and dense != tuple(range(lead)):
        raise h.refuse(f"leading_dense_block_count {lead} but dense layers {list(dense)}")
    return dict(
        num_experts=h.get_int("expert_count"),
        num_experts_per_tok=h.get_int("expert_used_count"),
        moe_intermediate_size=ffn,
        norm_topk_prob=norm_default if norm is None else bool(norm),
        dense_layers=dense,
    )


def _rope_fields(h: _Header, head_dim: int, max_pos: int, rope_freqs: Optional[np.ndarray]) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` as llama.cpp's loader and ``llama_context`` read them."""
    theta = h.get_float("rope.freq_base", 10000.0)
    stype = h.get("rope.scaling.type")
    factor = h.get("rope.scaling.factor")
    if not factor:
        factor = h.get("rope.scale_linear")
    factor = _f32(factor) if factor else 0.0
    if stype in (None, ""):
        stype = "linear"  # llama.cpp's default type; without a factor it scales nothing
    if stype not in ("none", "linear", "yarn"):
        raise h.refuse(f"rope scaling type {stype!r} (supported: none, linear, yarn, Llama-3 rope_freqs)")
    scaling = None
    if stype == "linear" and factor not in (0.0, 1.0):
        scaling = RopeScaling(rope_type="linear", factor=factor)
    elif stype == "yarn":
        scaling = _yarn(h, factor, max_pos)
    if rope_freqs is not None:
        llama3 = _llama3_from_rope_freqs(h, rope_freqs, head_dim, theta)
        if llama3 is not None and scaling is not None:
            raise h.refuse(f"rope_freqs together with rope scaling type {stype!r}")
        scaling = scaling or llama3
    return dict(rope_theta=theta, rope_scaling=scaling)


def _yarn(h: _Header, factor: float, max_pos: int) -> RopeScaling:
    if not factor:
        raise h.refuse("yarn rope scaling without rope.scaling.factor")
    ext = h.get("rope.scaling.yarn_ext_factor")
    if ext is not None and _f32(ext) not in (-1.0, 1.0):  # negative: not set (llama.cpp then uses 1)
        raise h.refuse(f"rope.scaling.yarn_ext_factor {_f32(ext)}")

    def mscale(scale: float, m: float = 1.0) -> float:  # transformers' get_mscale, llama_context's too
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    log_mul = h.get_float("rope.scaling.yarn_log_multiplier", 0.0)
    attention_factor = mscale(factor) / mscale(factor, log_mul) if log_mul else mscale(factor)
    attn = h.get_float("rope.scaling.attn_factor", 1.0)
    if attn != 1.0:
        attention_factor *= attn
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=h.get_int("rope.scaling.original_context_length", 0) or max_pos,
        beta_fast=h.get_float("rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=h.get_float("rope.scaling.yarn_beta_slow", 1.0),
        attention_factor=attention_factor,
        truncate=True,  # ggml_rope_yarn_corr_dims floors and ceils
    )


def _llama3_from_rope_freqs(h: _Header, rope_freqs: np.ndarray, head_dim: int, theta: float) -> Optional[RopeScaling]:
    """Llama-3 scaling from llama.cpp's ``rope_freqs`` tensor of per-frequency divisors (None if all 1).

    The factor is its largest value; the other three are searched: low and high among the
    values Meta's releases and fine-tunes use, the original context among powers of two (the
    converter takes a top-level ``original_max_position_embeddings``, default 8192). The
    divisors depend only on orig/low and orig/high, so low = 1, the usual value, is tried first.
    """
    freqs = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if freqs.shape[0] != head_dim // 2:
        raise ValueError(f"{h.gf.path}: rope_freqs has {freqs.shape[0]} entries, expected head_dim/2 = {head_dim // 2}")
    if np.allclose(freqs, 1.0):
        return None
    fmax = float(freqs.max())
    orig = h.get_int("rope.scaling.original_context_length", 0)
    origs = dict.fromkeys(([orig] if orig else []) + [8192, 4096, 2048, 16384, 32768, 65536, 131072]
                          + [2 ** k for k in range(4, 21)])
    for low in (1.0, 2.0, 0.5):
        for o in origs:
            for high in (4.0, 8.0, 2.0, 16.0):
                if high <= low:
                    continue
                cand = RopeScaling(factor=fmax, low_freq_factor=low, high_freq_factor=high,
                                   original_max_position_embeddings=o)
                if np.allclose(llama3_rope_divisors(head_dim, theta, cand), freqs, rtol=1e-4, atol=1e-5):
                    return cand
    raise h.refuse(f"a rope_freqs tensor that is not Llama-3 rope scaling (factor {fmax}, usual low/high factors)")


def _model_config(h: _Header, tensors: dict[str, GGUFTensorInfo], name: str,
                  rope_freqs: Optional[np.ndarray]) -> ModelConfig:
    gf, arch = h.gf, h.spec
    hidden = h.get_int("embedding_length")
    heads = h.get_int("attention.head_count")
    kv_heads = h.get_int("attention.head_count_kv", 0) or heads
    head_dim = h.get_int("attention.key_length", 0) or hidden // heads  # llama.cpp's n_embd_head_k
    value_dim = h.get_int("attention.value_length", 0) or head_dim
    if value_dim != head_dim and not arch.latent:  # latent attention: its fields function sets the heads
        raise h.refuse(f"value heads of {value_dim} dims and key heads of {head_dim}")
    rot = h.get_int("rope.dimension_count", 0) or head_dim
    if rot != head_dim and not arch.latent:
        raise h.refuse(f"partial rotary (rope.dimension_count {rot} != head_dim {head_dim})")

    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ValueError(f"{gf.path}: GGUF has no token_embd.weight tensor")
    rows = int(emb.shape[-1])  # ne = [hidden, vocab]
    vocab = h.get_int("vocab_size", 0) or rows
    if vocab != rows:
        raise ValueError(f"{gf.path}: vocab size {vocab} from the header != token_embd rows {rows}")

    max_pos = h.get_int("context_length", 0) or 4096
    f: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=h.get_int("feed_forward_length", 0),
        num_layers=h.get_int("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=h.get_float("attention.layer_norm_rms_epsilon", arch.default_eps),
        tie_word_embeddings="output.weight" not in tensors,
        architecture=arch.family,
        name=name,
    )
    f.update(_rope_fields(h, head_dim, max_pos, rope_freqs))
    f.update(arch.fields(h, f))
    return ModelConfig(**f)


# llama.cpp marks these end-of-generation by their text (llama_vocab::impl::load); the end-of-text
# markers of that list (<|endoftext|>, <|end_of_text|>...) are left to the eos id, as a config does.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
_SAMPLING = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "penalty_repeat"}


def generation_defaults(gf: GGUFFile) -> GenerationDefaults:
    """Stop tokens (eos, eot, eom ids; end-of-turn markers by text) and ``general.sampling.*``."""
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = gf.get(key)
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    tokens = gf.get("tokenizer.ggml.tokens") or []
    wanted = set(_END_OF_TURN)
    for i, t in enumerate(tokens):
        if t in wanted and i not in eos:
            eos.append(i)
    sampling: dict[str, Any] = {}
    for field, key in _SAMPLING.items():
        v = gf.get(f"general.sampling.{key}")
        if v is not None:
            sampling[field] = int(v) if field == "top_k" else _f32(v)
    return GenerationDefaults(eos_token_ids=tuple(eos), **sampling)


# --------------------------------------------------------------------------- #
# Tensors
# --------------------------------------------------------------------------- #

Transform = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class TensorRead:
    """One GGUF tensor and the canonical tensors it becomes, each with its transform."""

    tensor: GGUFTensorInfo
    outputs: tuple[tuple[str, Transform], ...]


@dataclass
class GGUFModel:
    """What a GGUF file holds, in jaxinfer's terms; `reads` are done by `jaxinfer.loading.weights`."""

    arch: Arch
    config: ModelConfig
    generation: GenerationDefaults
    reads: list[TensorRead]


def _supported_types():
    import gguf

    T = gguf.GGMLQuantizationType
    names = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
    return {getattr(T, n) for n in names if hasattr(T, n)}


def _check_type(gf: GGUFFile, t: GGUFTensorInfo, supported) -> None:
    if t.tensor_type not in supported:
        raise ValueError(
            f"{gf.path}: tensor {t.name!r} has unsupported GGML type {t.tensor_type.name}; "
            f"supported: {', '.join(sorted(s.name for s in supported))}"
        )


def dequantize(gf: GGUFFile, t: GGUFTensorInfo) -> np.ndarray:
    """A tensor as float32 in numpy order (float types may be views of the file mapping)."""
    import gguf

    _check_type(gf, t, _supported_types())
    x = gguf.quants.dequantize(gf.tensor_data(t), t.tensor_type)
    return x.reshape(t.np_shape)


def _minus(shift: float) -> Transform:
    return lambda x: x.astype(np.float32, copy=False) - np.float32(shift)


def _unpermute(n_heads: int) -> Transform:
    return lambda x: unpermute_rotary(x, n_heads)


def _expert(e: int) -> Transform:
    return lambda x: x[e]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def kv_b_from_split(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """``self_attn.kv_b_proj.weight`` [heads x (qk_nope + v_head), kv_lora_rank] from llama.cpp's
    ``attn_k_b`` [heads, kv_lora_rank, qk_nope] and ``attn_v_b`` [heads, v_head, kv_lora_rank] (numpy order):
    each head's no-rope key rows, then its value rows."""
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} are not the halves of one "
                         "kv_b_proj ([heads, kv_lora_rank, qk_nope] and [heads, v_head, kv_lora_rank])")
    heads, rank = k_b.shape[:2]
    merged = np.concatenate([np.swapaxes(k_b, 1, 2), v_b], axis=1)  # [heads, qk_nope + v_head, rank]
    return np.ascontiguousarray(merged.reshape(-1, rank))


def _with_v_b(gf: GGUFFile, v_b: GGUFTensorInfo) -> Transform:
    return lambda k_b: kv_b_from_split(k_b.astype(np.float32, copy=False), dequantize(gf, v_b))


def _plan(h: _Header, cfg: ModelConfig, tensors: list[GGUFTensorInfo]) -> list[TensorRead]:
    arch, path = h.spec, h.gf.path
    want = get_family(cfg.architecture).hf_tensor_shapes(cfg)
    names_of = arch.names
    by_name = {t.name: t for t in tensors}
    reads, unexpected = [], []
    for t in tensors:
        if t.name == _ROPE_FREQS:
            continue
        names = canonical_names(arch, t.name, cfg.num_experts)
        if names is None or not all(n in want for n in names):
            unexpected.append(t.name)
            continue
        m = _LAYER_TENSOR.match(t.name)
        if arch.latent and m and m.group(2) in _SPLIT_KV_B:
            other = "attn_v_b" if m.group(2) == "attn_k_b" else "attn_k_b"
            partner = by_name.get(f"blk.{m.group(1)}.{other}.weight")
            if partner is None or f"blk.{m.group(1)}.attn_kv_b.weight" in by_name:
                raise UnsupportedGGUF(f"{path}: {arch.name}: layer {m.group(1)} has {t.name} but "
                                      f"{'also attn_kv_b' if partner is not None else 'no ' + other}")
            if names:  # attn_k_b, read with its attn_v_b
                reads.append(TensorRead(t, ((names[0], _with_v_b(h.gf, partner)),)))
            continue
        g = names_of[m.group(2) if m else t.name]
        outputs = []
        for e, hf in enumerate(names):
            fn: Transform = _identity
            if g.experts:
                if len(t.shape) != 3 or t.shape[-1] != cfg.num_experts:
                    raise ValueError(f"{path}: {t.name} has ggml shape {list(t.shape)}, "
                                     f"expected {cfg.num_experts} experts last")
                fn = _expert(e)
            elif arch.permuted_qk and g.rope_heads:
                fn = _unpermute(getattr(cfg, g.rope_heads))
            elif arch.norm_shift and g.norm:
                fn = _minus(arch.norm_shift)
            outputs.append((hf, fn))
        reads.append(TensorRead(t, tuple(outputs)))
    if unexpected:
        more = f" (and {len(unexpected) - 8} more)" if len(unexpected) > 8 else ""
        raise UnsupportedGGUF(f"{path}: {arch.name}: unsupported GGUF feature: tensors {unexpected[:8]}{more}")
    return reads


def read_model(gf: GGUFFile, name: str) -> GGUFModel:
    """The config, generation defaults and tensor reads of a parsed GGUF file (no tensor data read
    except a ``rope_freqs`` vector); `UnsupportedGGUF` for what the engine does not implement."""
    arch = architecture(gf)
    h = _Header(gf, arch)
    by_name = {t.name: t for t in gf.tensors}
    supported = _supported_types()
    for t in gf.tensors:
        _check_type(gf, t, supported)
    rope_freqs = dequantize(gf, by_name[_ROPE_FREQS]) if _ROPE_FREQS in by_name else None
    cfg = _model_config(h, by_name, name, rope_freqs)
    return GGUFModel(arch, cfg, generation_defaults(gf), _plan(h, cfg, gf.tensors))


def tensor_count(gf: GGUFFile) -> int:
    """How many GGUF tensors a load reads (for progress totals): all but ``rope_freqs`` (and ``attn_v_b``,
    read with its ``attn_k_b``); 0 for an architecture this engine does not run."""
    name = gf.get("general.architecture")
    if name not in ARCHITECTURES:
        return 0
    arch = ARCHITECTURES[name]
    return sum(1 for t in gf.tensors if canonical_names(arch, t.name, 1))
