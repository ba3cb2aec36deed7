"""GGUF files of every supported llama.cpp architecture load as the Hugging Face model they came from.

The fixtures (``tests/fixtures/families/<family>/``, written by ``scripts/make_family_fixtures.py``
following llama.cpp's converter) hold one tiny model twice: safetensors + config.json, and
model.gguf. Both must load to the same `ModelConfig` and the same canonical float32 tensors.
The remaining tests write tiny GGUFs here with ``gguf.GGUFWriter``: Mixtral (llama
architecture with experts, converted here from its fixture the way llama.cpp's LlamaModel
does), llama.cpp's hard-coded rules, and refusals.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxinfer.loading import gguf_models as G
from jaxinfer.loading import weights as W
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling
from jaxinfer.gguf_file import GGUFFile
from jaxinfer.text.tokenizer import Tokenizer

FAMILIES = Path(__file__).parent / "fixtures" / "families"
GGUF_FAMILIES = sorted(p.parent.name for p in FAMILIES.glob("*/model.gguf"))
END_OF_TURN = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "qwen3_moe": "<|im_end|>",
               "gemma3": "<end_of_turn>", "mixtral": "</s>", "deepseek_v3": "<｜end▁of▁sentence｜>",
               "deepseek_v2": "<｜end▁of▁sentence｜>"}
# what a deepseek2 GGUF cannot hold: the legacy V2 file has no expert group keys (llama.cpp then routes
# without a group limit; the fixture's reference_gguf.npz holds that model's logits)
UNSTORED = {"deepseek_v2": {"expert_groups", "topk_groups"}}


def load_pair(family: str):
    d = FAMILIES / family
    g = W.load_model(W.ModelSource(d / "model.gguf", "gguf", family))
    h = W.load_model(W.ModelSource(d, "hf", family))
    return g, h


def llamacpp_attention_scalar(cfg: ModelConfig) -> float:
    """llama_model_gemma3: 1/sqrt(n_embd / n_head) for the 27B (62 layers), else 1/sqrt(head_dim)."""
    return float(cfg.hidden_size // cfg.num_heads if cfg.num_layers == 62 else cfg.head_dim)


# ------------------------------------------------------------ fixtures ----


@pytest.mark.skipif(not GGUF_FAMILIES, reason="no tests/fixtures/families/*/model.gguf")
@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_and_safetensors_give_the_same_config(family):
    g, h = load_pair(family)
    gc, hc = g.config, h.config
    if family == "gemma3":
        # llama.cpp does not store query_pre_attn_scalar: it hard-codes the attention scale. The fixture's
        # config has 24 (not head_dim), which a GGUF cannot express; check the GGUF follows llama.cpp.
        assert gc.query_pre_attn_scalar == llamacpp_attention_scalar(gc)
        gc = gc.__class__(**{**gc.__dict__, "query_pre_attn_scalar": hc.query_pre_attn_scalar})
    unstored = UNSTORED.get(family, set())
    assert {k for k in gc.__dict__ if k != "name" and getattr(gc, k) != getattr(hc, k)} == unstored
    if unstored:  # llama.cpp's reading: no group limit
        assert (gc.expert_groups, gc.topk_groups) == (1, 1) and hc.expert_groups > 1
        gc = gc.__class__(**{**gc.__dict__, **{k: getattr(hc, k) for k in unstored}})
    assert gc.__class__(**{**gc.__dict__, "name": hc.name}) == hc


@pytest.mark.skipif(not GGUF_FAMILIES, reason="no tests/fixtures/families/*/model.gguf")
@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_and_safetensors_give_the_same_tensors(family):
    g, h = load_pair(family)
    assert sorted(g.tensors) == sorted(h.tensors)
    for name, x in h.tensors.items():
        y = g.tensors[name]
        assert y.dtype == np.float32 and y.shape == x.shape, name
        if family == "gemma3" and name.endswith("norm.weight"):
            # The file holds float32(w + 1) (the converter's norm shift); w + 1 - 1 is exact in float32
            # only up to that rounding, so compare what the file stores.
            np.testing.assert_array_equal(y, (x + np.float32(1)) - np.float32(1), err_msg=name)
        else:
            np.testing.assert_array_equal(y, x, err_msg=name)


@pytest.mark.skipif(not GGUF_FAMILIES, reason="no tests/fixtures/families/*/model.gguf")
@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_end_of_turn_token_stops_generation(family):
    path = FAMILIES / family / "model.gguf"
    gf = GGUFFile(path)
    generation = G.read_model(gf, family).generation
    tok = Tokenizer.from_gguf(path, gguf_file=gf)
    names = tok.convert_ids_to_tokens(generation.eos_token_ids)
    assert END_OF_TURN[family] in names
    assert set(generation.eos_token_ids) <= set(tok.stop_token_ids) | {tok.eos_token_id}


ARCH_ENUM = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


def test_fixture_tensor_names_are_llamacpps():
    """Our canonical names map back to each GGUF tensor's name by gguf-py's own TensorNameMap."""
    for family in GGUF_FAMILIES:
        gf = GGUFFile(FAMILIES / family / "model.gguf")
        arch = G.architecture(gf)
        n = gf.get(f"{arch.name}.block_count")
        tmap = gguf.get_tensor_name_map(ARCH_ENUM[arch.name], n)
        for t in gf.tensors:
            if t.name == "rope_freqs.weight":
                continue
            stem = t.name.split(".")[-2]
            if stem in ("attn_k_b", "attn_v_b"):  # kv_b_proj's halves, named by the converter's split names
                hf = f"model.layers.{t.name.split('.')[1]}.self_attn.{stem[5]}_b_proj"
                assert tmap.get_name(hf) + ".weight" == t.name, (family, t.name, hf)
                continue
            (first, *_), suffix = G.canonical_names(arch, t.name, 1), t.name.rsplit(".", 1)[1]
            hf = first[: -len("." + suffix)]
            if stem == "exp_probs_b":  # the converter renames e_score_correction_bias to e_score_correction.bias
                hf = first.replace("e_score_correction_bias", "e_score_correction")
            if ".experts.0." in hf:  # stacks: gguf-py names the stacked HF tensor
                hf = hf.replace(".experts.0.", ".experts.")
            if arch.name == "qwen3moe" and t.name.split(".")[-2] in ("ffn_gate", "ffn_up", "ffn_down"):
                # the fixture's dense layer (mlp_only_layers): llama.cpp's qwen3moe has no such tensors,
                # the fixture names them as dense llama.cpp layers do (checked against qwen3's map)
                tmap_dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, n)
                assert tmap_dense.get_name(hf) + "." + suffix == t.name, (family, t.name, hf)
                continue
            assert tmap.get_name(hf) + "." + suffix == t.name, (family, t.name, hf)


# ------------------------------------------------------------ Mixtral ----


def convert_mixtral(src: Path, dst: Path, qtype=None) -> Path:
    """What llama.cpp's LlamaModel writes for a MixtralForCausalLM directory (weights and hparams);
    ``qtype``: quantize the matrices (experts' stacks included) to that GGML type."""
    hp = json.loads((src / "config.json").read_text())
    n_layer, n_head, n_kv = hp["num_hidden_layers"], hp["num_attention_heads"], hp["num_key_value_heads"]
    n_expert = hp["num_local_experts"]
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    w = gguf.GGUFWriter(str(dst), "llama")
    w.add_block_count(n_layer)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(n_expert)
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(hp["head_dim"])
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layer)

    def add(name, x):
        block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
        if qtype is None or x.ndim == 1 or x.shape[-1] % block:  # llama.cpp keeps those unquantized too
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    def permute(x, heads):
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    for name, x in tensors.items():
        if ".experts." in name:
            continue
        if name.endswith("q_proj.weight"):
            x = permute(x, n_head)
        elif name.endswith("k_proj.weight"):
            x = permute(x, n_kv)
        add(tmap.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(x))
    for bid in range(n_layer):
        for wid in ("w1", "w2", "w3"):
            stack = np.stack([tensors[f"model.layers.{bid}.block_sparse_moe.experts.{e}.{wid}.weight"]
                              for e in range(n_expert)])
            merged = f"layers.{bid}.feed_forward.experts.{wid}.weight"
            add(tmap.get_name(merged, try_suffixes=(".weight",)), stack)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.skipif(not (FAMILIES / "mixtral" / "config.json").is_file(), reason="no mixtral fixture")
def test_mixtral_gguf_is_llama_with_experts(tmp_path):
    path = convert_mixtral(FAMILIES / "mixtral", tmp_path / "mixtral.gguf")
    g = W.load_model(W.ModelSource(path, "gguf", "mixtral"))
    h = W.load_model(W.ModelSource(FAMILIES / "mixtral", "hf", "mixtral"))
    assert g.config == h.config and g.config.architecture == "mixtral" and g.config.norm_topk_prob
    assert sorted(g.tensors) == sorted(h.tensors)
    for name, x in h.tensors.items():
        np.testing.assert_array_equal(g.tensors[name], x, err_msg=name)
    # every tensor is read once (per layer: 2 norms, q k v o, router, 3 stacks)
    assert W.gguf_tensor_count(GGUFFile(path)) == 3 + g.config.num_layers * 10 == len(GGUFFile(path).tensors)


@pytest.mark.skipif(not (FAMILIES / "mixtral" / "config.json").is_file(), reason="no mixtral fixture")
def test_quantized_expert_stacks_split_into_the_dequantized_experts(tmp_path):
    T = gguf.GGMLQuantizationType.Q8_0
    path = convert_mixtral(FAMILIES / "mixtral", tmp_path / "mixtral-q8.gguf", qtype=T)
    g = W.load_model(W.ModelSource(path, "gguf", "mixtral"))
    h = W.load_model(W.ModelSource(FAMILIES / "mixtral", "hf", "mixtral"))
    quantized = 0
    for e in (0, g.config.num_experts - 1):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
            x = h.tensors[name]
            if x.shape[-1] % 32:  # left in float32
                np.testing.assert_array_equal(g.tensors[name], x, err_msg=name)
                continue
            want = gguf.quants.dequantize(gguf.quants.quantize(x, T), T)
            np.testing.assert_array_equal(g.tensors[name], want, err_msg=name)
            quantized += 1
    assert quantized
    assert np.abs(g.tensors["model.layers.0.self_attn.q_proj.weight"]
                  - h.tensors["model.layers.0.self_attn.q_proj.weight"]).max() < 0.05


# ------------------------------------------------- llama.cpp's rules ----


def write_gguf(path: Path, arch: str, meta: dict[str, Any], tensors: dict[str, np.ndarray] | None = None,
               tokens: list[str] | None = None) -> Path:
    """A GGUF of ``arch``: keys without a ``general.``/``tokenizer.`` prefix get the arch's."""
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in meta.items():
        key = k if k.startswith(("general.", "tokenizer.")) else f"{arch}.{k}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_array(key, v)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
    for name, x in (tensors or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


BASE = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6}
EMBED = {"token_embd.weight": np.zeros((32, 64), np.float32)}


def header_config(tmp_path, arch: str, **meta) -> ModelConfig:
    """The config a GGUF header describes (only the embedding tensor present)."""
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, {**BASE, **meta}, EMBED)
    return G.read_model(GGUFFile(path), "m").config


def test_gemma3_sliding_pattern_bases_and_scale_are_llamacpps(tmp_path):
    cfg = header_config(tmp_path, "gemma3", block_count=13, **{"attention.sliding_window": 512,
                        "rope.freq_base": 1e6, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0,
                        "attention.key_length": 32, "attention.value_length": 32})
    assert cfg.layer_types == tuple(FULL_ATTENTION if i in (5, 11) else SLIDING_ATTENTION for i in range(13))
    assert (cfg.sliding_window, cfg.local_rope_theta, cfg.rope_theta) == (512, 10000.0, 1e6)
    assert cfg.rope_scaling == RopeScaling(rope_type="linear", factor=8.0)
    assert cfg.query_pre_attn_scalar == 32.0 and cfg.head_dim == 32  # key_length, not hidden / heads
    assert cfg.norm_weight_offset == 1.0 and cfg.sandwich_norms and cfg.qk_norm and cfg.hidden_act == "gelu_tanh"
    assert cfg.embed_scale == 8.0 and cfg.final_logit_softcap is None and cfg.tie_word_embeddings


def test_gemma3_27b_scales_attention_by_hidden_over_heads(tmp_path):
    cfg = header_config(tmp_path, "gemma3", block_count=62, **{"attention.key_length": 32,
                        "attention.value_length": 32, "final_logit_softcapping": 30.0})
    assert cfg.query_pre_attn_scalar == 64 / 4 and cfg.final_logit_softcap == 30.0


def test_gemma3_without_sliding_window_is_all_global(tmp_path):
    cfg = header_config(tmp_path, "gemma3")
    assert cfg.sliding_window is None and cfg.layer_types == () and cfg.local_rope_theta == 10000.0


def test_yarn_attention_factor_is_llamacpps(tmp_path):
    cfg = header_config(tmp_path, "qwen3", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                        "rope.scaling.original_context_length": 64, "rope.scaling.yarn_beta_fast": 16.0})
    assert cfg.rope_scaling == RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                           beta_fast=16.0, beta_slow=1.0,
                                           attention_factor=0.1 * math.log(4.0) + 1.0, truncate=True)
    cfg = header_config(tmp_path, "qwen3", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                        "rope.scaling.yarn_log_multiplier": 0.5})
    assert cfg.rope_scaling.original_max_position_embeddings == 256  # none given: the context length
    assert cfg.rope_scaling.attention_factor == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))


def test_linear_rope_scaling_and_old_scale_linear_key(tmp_path):
    assert header_config(tmp_path, "llama", **{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}
                         ).rope_scaling == RopeScaling(rope_type="linear", factor=4.0)
    # a factor without a type: llama.cpp's default type is linear
    assert header_config(tmp_path, "llama", **{"rope.scale_linear": 2.0}
                         ).rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert header_config(tmp_path, "llama", **{"rope.scaling.type": "none", "rope.scaling.factor": 4.0}
                         ).rope_scaling is None


def test_qwen3moe_expert_length_falls_back_like_llamacpp(tmp_path):
    meta = {"expert_count": 8, "expert_used_count": 2, "attention.key_length": 16}
    tensors = {**EMBED, **{f"blk.{i}.ffn_gate_inp.weight": np.zeros((8, 64), np.float32) for i in range(2)}}
    path = write_gguf(tmp_path / "moe.gguf", "qwen3moe", {**BASE, **meta}, tensors)
    cfg = G.read_model(GGUFFile(path), "m").config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 128 // 2)
    assert cfg.norm_topk_prob and cfg.dense_layers == () and cfg.qk_norm and cfg.architecture == "qwen3_moe"


def test_end_of_turn_markers_count_as_eos(tmp_path):
    tokens = ["a", "<|endoftext|>", "<|im_end|>", "b"]
    path = write_gguf(tmp_path / "q.gguf", "qwen2", {**BASE, "tokenizer.ggml.eos_token_id": 1,
                                                     "general.sampling.temp": 0.7, "general.sampling.top_k": 20},
                      EMBED, tokens=tokens)
    gen = G.read_model(GGUFFile(path), "m").generation
    assert gen.eos_token_ids == (1, 2) and gen.temperature == 0.7 and gen.top_k == 20


# DeepSeek (deepseek2): MLA of 4 heads, kv_lora_rank 8, rotary 4, no-rope key 8, value 8 (the legacy lengths);
# a plain attn_q (no q-LoRA) and no experts
DS = {"attention.kv_lora_rank": 8, "rope.dimension_count": 4, "attention.key_length": 12,
      "attention.value_length": 8}
DS_Q = {"blk.0.attn_q.weight": np.zeros((48, 64), np.float32)}


def llamacpp_deepseek2_scales(factor: float, log_mul: float | None, attn_factor: float, head_k: int):
    """The rope's cos/sin factor and the softmax scale llama.cpp runs a deepseek2 yarn model with, in its
    float32 steps: ``load_arch_hparams`` (log_mul / 0.1), ``llama_context`` (yarn_attn_factor, with the
    deepseek2 special case mscale = mscale_all_dim), ggml's rope_yarn (x (1 + 0.1 ln(1 / freq_scale)) when
    ext_factor != 0) and the deepseek2 graph (attn_factor_org, mscale, kq_scale)."""
    f = np.float32
    s, freq_scale = f(factor), f(1) / f(factor)
    m_all = f(log_mul) / f(0.1) if log_mul else f(0)

    def get_mscale(scale, m):
        return f(1) if scale <= 1 else f(0.1) * m * np.log(scale) + f(1)

    if m_all != 0:
        m = m_all if m_all != f(1) else f(1)
        af = get_mscale(s, m) / get_mscale(s, m_all)
    else:
        af = get_mscale(s, f(1))
    af = af * (f(1) / (f(1) + f(0.1) * np.log(s))) * f(attn_factor)
    rope_factor = af * (f(1) + f(0.1) * np.log(f(1) / freq_scale))
    org = af * (f(1) + f(0.1) * np.log(f(1) / freq_scale))
    mscale = org * (f(1) + f(0.1) * m_all * np.log(f(1) / freq_scale))
    return float(rope_factor), float(f(1) * mscale * mscale / np.sqrt(f(head_k)))


@pytest.mark.parametrize("factor,log_mul,attn_factor", [(4.0, 0.0707, 1.0), (40.0, 0.1, 1.0), (4.0, None, 1.0),
                                                         (16.0, 0.1, 0.5)])
def test_deepseek2_yarn_scales_are_llamacpps(tmp_path, factor, log_mul, attn_factor):
    meta = {**DS, "rope.scaling.type": "yarn", "rope.scaling.factor": factor,
            "rope.scaling.original_context_length": 64}
    if log_mul is not None:
        meta["rope.scaling.yarn_log_multiplier"] = log_mul
    if attn_factor != 1.0:
        meta["rope.scaling.attn_factor"] = attn_factor
    path = write_gguf(tmp_path / "ds.gguf", "deepseek2", {**BASE, **meta}, {**EMBED, **DS_Q})
    cfg = G.read_model(GGUFFile(path), "m").config
    rope_factor, kq_scale = llamacpp_deepseek2_scales(factor, log_mul, attn_factor, 12)
    assert cfg.rope_scaling.attention_factor == pytest.approx(rope_factor, rel=1e-6)
    assert cfg.attn_scale == pytest.approx(kq_scale, rel=1e-6)
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.head_dim) == (8, 8, 4, 8)
    assert cfg.num_kv_heads == cfg.num_heads == 4 and cfg.q_lora_rank == 0 and cfg.rope_interleave
    assert cfg.architecture == "deepseek_v2" and cfg.num_experts == 0


def test_deepseek2_routing_defaults_are_llamacpps(tmp_path):
    """No gating func, weights norm, scale or group keys (older DeepSeek-V2 files): softmax, not
    renormalised, unscaled, no group limit; a sigmoid file with exp_probs_b is DeepSeek-V3's routing."""
    routers = {f"blk.{i}.ffn_gate_inp.weight": np.zeros((8, 64), np.float32) for i in (1,)}
    meta = {**DS, "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 16,
            "leading_dense_block_count": 1}
    path = write_gguf(tmp_path / "v2.gguf", "deepseek2", {**BASE, **meta}, {**EMBED, **DS_Q, **routers})
    cfg = G.read_model(GGUFFile(path), "m").config
    assert (cfg.router_scoring, cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.router_bias) == \
        ("softmax", False, 1.0, False)
    assert (cfg.expert_groups, cfg.topk_groups, cfg.shared_expert_intermediate_size) == (1, 1, 0)
    assert cfg.dense_layers == (0,) and cfg.architecture == "deepseek_v2"
    bias = {"blk.1.exp_probs_b.bias": np.zeros(8, np.float32)}
    meta.update({"expert_gating_func": 2, "expert_weights_norm": True, "expert_weights_scale": 2.5,
                 "expert_group_count": 4, "expert_group_used_count": 2, "expert_shared_count": 2})
    path = write_gguf(tmp_path / "v3.gguf", "deepseek2", {**BASE, **meta}, {**EMBED, **DS_Q, **routers, **bias})
    cfg = G.read_model(GGUFFile(path), "m").config
    assert (cfg.router_scoring, cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.router_bias) == \
        ("sigmoid", True, 2.5, True)
    assert (cfg.expert_groups, cfg.topk_groups, cfg.group_scoring, cfg.shared_expert_intermediate_size) == \
        (4, 2, "top2_sum", 32)
    assert cfg.architecture == "deepseek_v3"


# ------------------------------------------------------------ refusals ----


def refusal(tmp_path, arch: str, tensors: dict[str, np.ndarray] | None = None, **meta) -> str:
    path = write_gguf(tmp_path / "r.gguf", arch, {**BASE, **meta}, {**EMBED, **(tensors or {})})
    with pytest.raises(ValueError) as e:
        W.load_model(W.ModelSource(path, "gguf", "r"))
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_unknown_architecture_is_refused(tmp_path):
    msg = refusal(tmp_path, "phi3")
    assert "unsupported GGUF architecture 'phi3'; supported: llama" in msg and "gemma3" in msg


@pytest.mark.parametrize("arch,meta,tensors,feature", [
    ("llama", {"rope.scaling.type": "longrope"}, None, "llama: unsupported GGUF feature: rope scaling type 'longrope'"),
    ("qwen3", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_ext_factor": 0.5},
     None, "qwen3: unsupported GGUF feature: rope.scaling.yarn_ext_factor 0.5"),
    ("qwen2", {"rope.dimension_count": 8}, None, "qwen2: unsupported GGUF feature: partial rotary"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, None, "gemma3: unsupported GGUF feature: attention logit softcapping"),
    ("gemma3", {"attention.sliding_window": 8, "rope.freq_base_swa": 20000.0}, None,
     "gemma3: unsupported GGUF feature: rope.freq_base_swa 20000.0"),
    ("qwen3moe", {"expert_count": 4, "expert_used_count": 2, "expert_weights_scale": 2.5}, None,
     "qwen3moe: unsupported GGUF feature: expert_weights_scale 2.5"),
    ("qwen3", {"feed_forward_length": [128, 256]}, None, "qwen3: unsupported GGUF feature: per-layer feed_forward_length"),
    ("llama", {}, {"blk.0.attn_q.bias": np.zeros(64, np.float32)},
     "llama: unsupported GGUF feature: tensors ['blk.0.attn_q.bias']"),
    ("qwen3", {}, {"blk.0.ffn_gate_shexp.weight": np.zeros((8, 64), np.float32)},
     "qwen3: unsupported GGUF feature: tensors ['blk.0.ffn_gate_shexp.weight']"),
    ("deepseek2", {**DS, "expert_gating_func": 3}, DS_Q, "deepseek2: unsupported GGUF feature: expert_gating_func 3"),
    ("deepseek2", {**DS, "attention.temperature_scale": 0.1}, DS_Q,
     "deepseek2: unsupported GGUF feature: attention.temperature_scale 0.1"),
    ("deepseek2", {**DS, "attention.q_lora_rank": 16}, DS_Q,
     "deepseek2: unsupported GGUF feature: attention.q_lora_rank 16 but no attn_q_a tensors"),
    ("deepseek2", {**DS, "rope.scaling.type": "linear", "rope.scaling.factor": 4.0}, DS_Q,
     "deepseek2: unsupported GGUF feature: rope scaling type 'linear'"),
    ("deepseek2", {**DS, "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 16}, DS_Q,
     "deepseek2: unsupported GGUF feature: expert_count 8, leading_dense_block_count 0 but routers"),
    ("deepseek2", DS, {**DS_Q, "blk.0.attn_k_b.weight": np.zeros((4, 8, 8), np.float32)},
     "deepseek2: layer 0 has blk.0.attn_k_b.weight but no attn_v_b"),
])
def test_unsupported_features_are_refused_in_one_line(tmp_path, arch, meta, tensors, feature):
    assert feature in refusal(tmp_path, arch, tensors, **meta)
