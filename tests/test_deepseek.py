"""DeepSeek's parts the family fixtures' logits do not show on their own: each feature moves the logits (so
the 1e-4 agreement in tests/test_families.py is earned by every one of them), the latent cache's size and
what a memory budget holds with it, and the configs refused at load.

The fixtures (tests/fixtures/families/deepseek_v3, deepseek_v2) are transformers' own tiny models;
`scripts/make_family_fixtures.py` recorded how far transformers' logits move under the same ablations.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from test_families import _forward_chunks, family
from jaxinfer.config import EngineConfig
from jaxinfer.models import config_from_hf
from jaxinfer.models.hf_config import UnsupportedFeature
from jaxinfer.ops import kv_cache, mesh

FIXTURES = Path(__file__).parent / "fixtures" / "families"


def _replace_layers(params, block: str, **leaves):
    """``params`` with the named leaves of every layer's ``block`` (where the layer has them) replaced by
    ``fn(leaf)`` for each ``name=fn``."""
    layers = []
    for layer in params.layers:
        part = getattr(layer, block)
        changes = {k: fn(getattr(part, k)) for k, fn in leaves.items() if getattr(part, k, None) is not None}
        layers.append(dataclasses.replace(layer, **{block: dataclasses.replace(part, **changes)}))
    return dataclasses.replace(params, layers=layers)


# the weights' ablations share one program; each config ablation compiles its own (the routing's own
# ablations are the numpy transcriptions below, which need no model)
ABLATIONS = {
    "latent norm": lambda cfg, p: (cfg, _replace_layers(p, "attention", kv_a_norm=jnp.ones_like)),
    "no shared expert": lambda cfg, p: (cfg, _replace_layers(p, "mlp", shared_down=jnp.zeros_like)),
    "no correction bias": lambda cfg, p: (cfg, _replace_layers(p, "mlp", router_bias=jnp.zeros_like)),
    "rope halves, not pairs": lambda cfg, p: (dataclasses.replace(cfg, rope_interleave=False), p),
    "no mscale on the softmax scale": lambda cfg, p: (dataclasses.replace(cfg, attention_mscale=1.0), p),
}


def test_every_feature_moves_the_logits_past_the_tolerance():
    """Dropping any one feature of DeepSeek-V3's puts the engine's logits far outside the 1e-4 the real model
    keeps (the routing's group limits and scaling: the transcriptions below)."""
    f = family("deepseek_v3")
    ids, greedy, want = f.cases[0]
    seq = ids + greedy
    assert np.abs(_forward_chunks(f.cfg, f.params, seq, len(seq), pad_to=40) - want).max() < 1e-4
    for label, ablate in ABLATIONS.items():
        cfg, params = ablate(f.cfg, f.params)
        err = np.abs(_forward_chunks(cfg, params, seq, len(seq), pad_to=40) - want).max()
        assert err > 1e-2, f"{label} moves the logits by only {err:.1e}"


def _numpy_route(logits: np.ndarray, cfg, bias=None) -> tuple[np.ndarray, np.ndarray]:
    """transformers' DeepSeek routers in numpy: V2 (softmax; groups by their best expert; masked to 0) and V3
    (sigmoid; the choice adds the bias; groups by their best two summed; masked to -inf; weights without the
    bias, renormalised)."""
    n, e = logits.shape
    if cfg.router_scoring == "softmax":
        s = np.exp(logits - logits.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
    else:
        s = 1 / (1 + np.exp(-logits))
    choice = s + (0 if bias is None else bias)
    g = choice.reshape(n, cfg.expert_groups, -1)
    group_score = g.max(-1) if cfg.group_scoring == "max" else np.sort(g, -1)[..., -2:].sum(-1)
    keep = np.zeros((n, cfg.expert_groups), bool)
    np.put_along_axis(keep, np.argsort(-group_score, -1)[:, : cfg.topk_groups], True, 1)
    fill = 0.0 if cfg.router_scoring == "softmax" else -np.inf
    masked = np.where(np.repeat(keep, e // cfg.expert_groups, -1), choice, fill)
    experts = np.argsort(-masked, -1, kind="stable")[:, : cfg.num_experts_per_tok]
    w = np.take_along_axis(s, experts, 1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, experts


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_routing_is_transformers_group_limited_choice(name):
    """The router against a numpy transcription of transformers' (V2 "group_limited_greedy", V3 "noaux_tc"),
    over many rows where the group limit, and for V3 the correction bias, change the experts chosen."""
    from jaxinfer.models import moe

    f = family(name)
    cfg = f.cfg
    assert cfg.expert_groups > cfg.topk_groups
    bias = np.asarray(f.params.layers[-1].mlp.router_bias) if cfg.router_bias else None
    logits = np.random.default_rng(0).normal(0, 2, (512, cfg.num_experts)).astype(np.float32)
    w, e = jax.jit(lambda x, b: moe.route(x, cfg, b))(jnp.asarray(logits), bias)
    want_w, want_e = _numpy_route(logits, cfg, bias)
    np.testing.assert_array_equal(np.asarray(e), want_e)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6)
    free = dataclasses.replace(cfg, topk_groups=cfg.expert_groups)
    assert (_numpy_route(logits, free, bias)[1] != want_e).any()  # the group limit mattered
    if bias is not None:
        assert (_numpy_route(logits, cfg)[1] != want_e).any()  # and so did the bias


def test_latent_cache_bytes_per_token_against_per_head_keys_and_values():
    """DeepSeek-V3's real shape: 512 + 64 values a token and layer, where per-head keys and values would be
    128 heads x (192 + 128): about 71 times more."""
    cfg = config_from_hf({"model_type": "deepseek_v3"}, "v3")  # transformers' defaults are V3's shape
    assert cfg.latent and kv_cache.token_entry(cfg) == (1, 576)
    latent = kv_cache.kv_bytes_per_token(cfg, "bfloat16")
    assert latent == 61 * 576 * 2
    per_head = 61 * 128 * (192 + 128) * 2
    assert per_head / latent == pytest.approx(71.1, abs=0.05)
    gqa = dataclasses.replace(cfg, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0)
    assert kv_cache.kv_bytes_per_token(gqa, "bfloat16") == 61 * 2 * 128 * 128 * 2  # the same heads, unabsorbed


def test_a_memory_budget_holds_the_sequences_its_arithmetic_says():
    """kv_cache_memory_bytes -> num_pages by the cache layout: a budget of exactly four 64-token sequences of
    the latent model runs four of them at once without a preemption, every page back after; the same budget
    holds fewer tokens of a model caching per-head keys and values, in the ratio of their bytes a token."""
    f = family("deepseek_v3")
    page = 4
    per_token = kv_cache.kv_bytes_per_token(f.cfg, "float32")
    assert per_token == f.cfg.num_layers * (32 + 8) * 4
    budget = 4 * 64 * per_token
    engine = EngineConfig(page_size=page, num_pages=2, max_num_seqs=4, batch_buckets=(4,), chunk_buckets=(64,),
                          page_buckets=(16,), max_num_batched_tokens=256, dtype="float32",
                          kv_cache_memory_bytes=budget)
    assert mesh.fit_pages(f.cfg, engine).num_pages == 4 * 64 // page + 1
    per_head = dataclasses.replace(f.cfg, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, q_lora_rank=0)
    ratio = kv_cache.kv_bytes_per_token(per_head, "float32") / per_token
    assert mesh.fit_pages(per_head, engine).num_pages - 1 == int(4 * 64 / page / ratio)
    llm = jaxinfer.LLM(str(FIXTURES / "deepseek_v3"), engine_config=engine, model_cache=False)
    try:
        assert llm.info()["kv_capacity_tokens"] == 256 and llm.info()["kv_bytes_per_token"] == per_token
        prompts = [np.random.default_rng(i).integers(0, 300, 32).tolist() for i in range(4)]
        outs = llm.generate(prompts, jaxinfer.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [32] * 4
        assert llm.engine.scheduler.num_preemptions == 0
        assert llm.engine.allocator.num_free == 4 * 64 // page
    finally:
        llm.close()


def _v3_config(**changes):
    d = json.loads((FIXTURES / "deepseek_v3" / "config.json").read_text())
    return {**d, **changes}


@pytest.mark.parametrize("changes,feature", [
    ({"attention_bias": True}, "attention_bias"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_deepseek_configs_fail_at_load_with_one_line(changes, feature):
    with pytest.raises(UnsupportedFeature) as e:
        config_from_hf(_v3_config(**changes), "v3")
    assert feature in str(e.value) and "\n" not in str(e.value)


def test_v3_multi_token_prediction_layers_are_skipped_with_a_note(tmp_path, capsys):
    """A V3 checkpoint carries its MTP layer as layer num_hidden_layers: skipped, with a note, not an error."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxinfer.loading import weights

    src = FIXTURES / "deepseek_v3"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    tensors = load_file(str(src / "model.safetensors"))
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v for k, v in tensors.items()
             if k.startswith(f"model.layers.{n - 1}.")}
    extra[f"model.layers.{n}.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"))
    loaded = weights.load_model(weights.resolve_model(str(tmp_path)))
    assert loaded.config.num_layers == n and not any(k.startswith(f"model.layers.{n}.") for k in loaded.tensors)
    assert f"layers [{n}]" in capsys.readouterr().err
