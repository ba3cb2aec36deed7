"""Every model family against transformers, on tiny random-weight models made by transformers.

`scripts/make_family_fixtures.py` built one tiny model per family with transformers' own
classes (sliding windows small enough that the prompts cross them, 8 experts top-2 for the
MoE families), saved it as safetensors (and GGUF where llama.cpp defines the architecture),
and recorded transformers' float32 logits at every position of prompt + 32 greedy tokens.

For each family: logits within 1e-4 at every position, through one prefill of the whole
sequence and through the paged cache in small chunks (windows and pages crossed
mid-chunk); greedy tokens identical through the engine with chunked prefill, a
prefix-cache hit and preemption-recompute; GGUF and safetensors give identical logits;
bfloat16 tracks float32. No torch needed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from conftest import Oracle
from jaxinfer.ops import kv_cache
from jaxinfer.loading import weights
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.models import config_from_hf, get_family, moe
from jaxinfer.models.hf_config import UnsupportedFeature
from jaxinfer.ops.spec import is_spec

FAMILY_DIR = Path(__file__).parent / "fixtures" / "families"
FAMILIES = sorted(p.name for p in FAMILY_DIR.iterdir() if (p / "reference.npz").is_file()) if FAMILY_DIR.is_dir() else []
WITH_GGUF = [f for f in FAMILIES if (FAMILY_DIR / f / "model.gguf").is_file()]
PAGE = 4
GREEDY = jaxinfer.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


class Family:
    """One fixture model loaded from its safetensors in float32, with transformers' reference."""

    def __init__(self, name: str):
        self.name = name
        self.dir = FAMILY_DIR / name
        loaded = weights.load_model(weights.resolve_model(str(self.dir)))
        self.cfg: ModelConfig = loaded.config
        self.family = get_family(self.cfg.architecture)
        self.tensors = loaded.tensors
        self.params = self.family.params_from_hf(loaded.tensors, self.cfg)
        ref = np.load(self.dir / "reference.npz")
        self.cases = []
        for i in range(2):
            ids, greedy = ref[f"ids_{i}"].tolist(), ref[f"greedy_{i}"].tolist()
            self.cases.append((ids, greedy, ref[f"logits_{i}"]))

    def forward_chunks(self, params, tokens: list[int], chunk: int) -> np.ndarray:
        """Logits at every position, feeding `tokens` through a paged cache `chunk` tokens at a time."""
        return _forward_chunks(self.cfg, params, tokens, chunk)


_fwd = jax.jit(lambda fam, params, cfg, tokens, cache, attn: fam.forward(params, cfg, tokens, cache, attn),
               static_argnums=(0, 2))


def _forward_chunks(cfg, params, tokens, chunk, pad_to=80):
    """Logits at every position of `tokens`, fed through a paged cache `chunk` tokens at a time.

    The sequence is padded to `pad_to` tokens (padding has position -1: attends nothing,
    writes nothing) so every chunk has one shape and each family compiles few programs.
    """
    family = get_family(cfg.architecture)
    n = len(tokens)
    total = max(pad_to, n)
    total += -total % chunk
    num_pages = -(-total // PAGE)
    eng = EngineConfig(page_size=PAGE, num_pages=num_pages + 2, dtype="float32")
    cache = kv_cache.init_cache(cfg, eng)
    # scattered pages, as the allocator hands them out
    table = np.asarray(list(range(num_pages + 1, 1, -1))[:num_pages], np.int32)[None]
    padded = np.zeros(total, np.int32)
    padded[:n] = tokens
    positions = np.where(np.arange(total) < n, np.arange(total), -1).astype(np.int32)
    out = []
    for start in range(0, total, chunk):
        ids = padded[start : start + chunk][None]
        pos = positions[start : start + chunk][None]
        slots = np.where(pos >= 0, kv_cache.slots_for(table, np.maximum(pos, 0), PAGE), 0).astype(np.int32)
        attn = AttentionMetadata(pos, slots, table, np.array([min(n, start + chunk)], np.int32))
        h, cache = _fwd(family, params, cfg, jnp.asarray(ids), cache, attn)
        out.append(np.asarray(_logits(family, params, cfg, h[0])))
    return np.concatenate(out)[:n]


_logits = jax.jit(lambda fam, params, cfg, h: fam.logits(params, cfg, h), static_argnums=(0, 2))


_LOADED: dict[str, Family] = {}


def family(name: str) -> Family:
    if name not in _LOADED:
        _LOADED[name] = Family(name)
    return _LOADED[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers_at_every_position(name):
    f = family(name)
    for ids, greedy, want in f.cases:
        seq = ids + greedy
        whole = f.forward_chunks(f.params, seq, len(seq))  # one prefill of the whole sequence
        chunked = f.forward_chunks(f.params, seq, 5)  # 5-token chunks over 4-token pages
        for got, how in ((whole, "one prefill"), (chunked, "5-token chunks")):
            err = np.abs(got - want).max()
            assert err < 1e-4, f"{name} ({how}): max |logit error| {err:.2e}"
        # each greedy token is the argmax where transformers chose it
        assert whole[len(ids) - 1 : -1].argmax(-1).tolist() == greedy


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_weights_track_float32(name):
    """bfloat16 weights: the mean logit error stays within 5% of the mean logit, and the top-1 is
    float32's wherever float32's margin is over 0.1, but for at most one position in a routed family.
    (Not a max-error bound: in the MoE families a bfloat16 router can swap a near-tied expert, which
    moves that one position's logits; transformers' own bfloat16 DeepSeek does so at one position of
    each fixture, its routers scoring with the bfloat16-rounded weights.)"""
    f = family(name)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), f.params)
    ids, greedy, want = f.cases[1]
    got = f.forward_chunks(bf16, ids + greedy, 16)
    rel = np.abs(got - want).mean() / np.abs(want).mean()
    assert rel < 0.05, f"{name}: bfloat16 mean logit error {rel:.1%} of the mean logit"
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.1
    assert clear.sum() >= len(clear) // 2
    swapped = int((got.argmax(-1) != want.argmax(-1))[clear].sum())
    assert swapped <= (1 if f.cfg.num_experts else 0), f"{name}: {swapped} clear top-1 tokens changed"


@pytest.mark.parametrize("name", WITH_GGUF)
def test_gguf_and_safetensors_give_identical_logits(name):
    """Same config and bit-identical logits. Two exceptions, by llama.cpp's design, where a GGUF has
    no key for what the HF config says: Gemma 3's ``query_pre_attn_scalar`` (llama.cpp uses key_length;
    the fixture's 24 differs from its head_dim 16 so the HF path is seen to use it), and DeepSeek-V2's
    group limit (the legacy file has no group keys, so llama.cpp routes without one: the file is the
    HF model with n_group = topk_group = 1, whose transformers logits are reference_gguf.npz). The
    GGUF's own values are put into the HF config before the logits are compared."""
    import dataclasses

    unstored = {"gemma3": {"query_pre_attn_scalar"}, "deepseek_v2": {"expert_groups", "topk_groups"}}.get(name, set())
    f = family(name)
    loaded = weights.load_model(weights.resolve_model(str(f.dir / "model.gguf")))
    cfg = loaded.config
    differs = {k for k in cfg.__dict__ if k != "name" and getattr(cfg, k) != getattr(f.cfg, k)}
    assert differs == unstored, differs
    hf_cfg = dataclasses.replace(f.cfg, **{k: getattr(cfg, k) for k in unstored}, name=cfg.name)
    assert hf_cfg == cfg
    params = get_family(cfg.architecture).params_from_hf(loaded.tensors, cfg)
    ids, greedy, want = f.cases[1]
    a = _forward_chunks(cfg, params, ids + greedy, 16)
    b = _forward_chunks(hf_cfg, f.params, ids + greedy, 16)
    assert np.array_equal(a, b)
    if name == "deepseek_v2":
        want = np.load(f.dir / "reference_gguf.npz")["logits_1"]
    if name != "gemma3":
        assert np.abs(a - want).max() < 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_tokens_through_chunks_preemption_and_prefix_hits(name):
    """The 40-token prompt goes in 8-token chunks; four long requests share 40 pages of 4
    tokens (they need ~60), so some are preempted and recomputed; then a repeat is a prefix hit.
    A model whose every layer slides (Mistral) gives back the pages behind its window, so four
    requests fit in 40 pages: it is preempted in a second engine of 13 pages (less than one
    sequence's 18, which only a model that gives pages back can serve).

    With speculative decoding on (prompt lookup's programs, `Oracle` drafts along transformers' own greedy
    continuation, partly spoiled): the two reference requests verify drafts, accepting some and rejecting
    some, the other two decode plainly; the tokens are transformers' either way."""
    f = family(name)
    (short, g_short, _), (long, g_long, _) = f.cases
    batch = [long, short, long[::-1], long[3:] + long[:3]]
    eng = EngineConfig(page_size=PAGE, num_pages=41, max_num_seqs=4, dtype="float32", batch_buckets=(4,),
                       chunk_buckets=(8,), page_buckets=(32,), max_num_batched_tokens=32, name="families",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    for num_pages in (41, 14) if f.cfg.kv_window else (41,):
        llm = jaxinfer.LLM(str(f.dir), engine_config=eng.replace(num_pages=num_pages))
        llm.engine.speculator.proposer = Oracle({tuple(long): g_long, tuple(short): g_short})
        outs = llm.generate(batch, GREEDY)
        assert llm.engine.speculator.stats.num_accepted_tokens > 0
        assert outs[0].outputs[0].token_ids == g_long
        assert outs[1].outputs[0].token_ids == g_short
        if num_pages == 14 or not f.cfg.kv_window:
            assert llm.engine.scheduler.num_preemptions > 0
        if num_pages == 41:
            # (a window model gives back its head pages early; in the busy batch they were reused)
            assert llm.generate([long], GREEDY)[0].outputs[0].token_ids == g_long
            hits = llm.engine.allocator.hits
            again = llm.generate([long], GREEDY)
            assert again[0].outputs[0].token_ids == g_long
            assert llm.engine.allocator.hits > hits, "the repeated prompt should have hit the prefix cache"
        llm.engine.allocator.check_all_free()
        llm.close()


@pytest.mark.parametrize("name", FAMILIES)
def test_both_config_generations_read_the_same(name):
    d = FAMILY_DIR / name
    v5 = config_from_hf(json.loads((d / "config.json").read_text()), "m")
    if (d / "config_v4.json").is_file():
        v4 = config_from_hf(json.loads((d / "config_v4.json").read_text()), "m")
        assert v4 == v5


@pytest.mark.parametrize(
    "patch,feature",
    [
        ({"model_type": "gpt_neox"}, "unsupported model_type 'gpt_neox'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope scaling type 'longrope'"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)
def test_unsupported_configs_fail_at_load_with_one_line(patch, feature):
    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    with pytest.raises(ValueError) as e:
        config_from_hf({**base, **patch})
    msg = str(e.value)
    assert feature in msg and "\n" not in msg


def test_gemma3_refuses_attention_softcapping():
    d = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
         "sliding_window": 4, "attn_logit_softcapping": 50.0}
    with pytest.raises(UnsupportedFeature, match="gemma3: unsupported config feature: attn_logit_softcapping=50.0"):
        config_from_hf(d)


def _dense_experts_reference(p, cfg, h):
    """Every expert on every token, weighted by the top-k routing (mask elsewhere): the plain formula."""
    logits = h @ np.asarray(p.router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, : cfg.num_experts_per_tok]
    w = np.take_along_axis(probs, top, -1)
    if cfg.norm_topk_prob:
        w /= w.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    wgu, wd = np.asarray(p.w_gate_up, np.float64), np.asarray(p.w_down, np.float64)
    for e in range(cfg.num_experts):
        gate, up = np.split(h @ wgu[e], 2, axis=-1)
        y = (gate / (1 + np.exp(-gate)) * up) @ wd[e]
        weight = np.where(top == e, w, 0.0).sum(-1, keepdims=True)
        out += weight * y
    return out


@pytest.mark.parametrize("tokens,normalize", [(1, True), (3, False), (40, True), (300, True)])
def test_routed_experts_match_the_dense_formula(tokens, normalize):
    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=normalize)
    rng = np.random.default_rng(tokens)
    p = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape).astype(np.float32) * 0.3),
                     moe.param_specs(cfg, jnp.float32), is_leaf=is_spec)
    h = rng.standard_normal((tokens, 32)).astype(np.float32)
    got = np.asarray(jax.jit(lambda p, h: moe.routed_mlp(p, cfg, h))(p, jnp.asarray(h)))
    np.testing.assert_allclose(got, _dense_experts_reference(p, cfg, h.astype(np.float64)), rtol=1e-4, atol=1e-4)


END_OF_TURN = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "qwen3_moe": "<|im_end|>",
               "gemma3": "<end_of_turn>", "mistral": "</s>", "mixtral": "</s>",
               "deepseek_v2": "<｜end▁of▁sentence｜>", "deepseek_v3": "<｜end▁of▁sentence｜>"}


@pytest.mark.parametrize("name", FAMILIES)
def test_end_of_turn_token_is_a_stop_token_by_the_models_own_config(name):
    """generation_config.json names the family's end-of-turn token; every request the processor
    builds stops on it (that a stop id ends a request is the engine's own test)."""
    f = family(name)
    from jaxinfer.text.tokenizer import load_tokenizer
    from jaxinfer.engine.processor import InputProcessor

    tok = load_tokenizer(str(f.dir))
    loaded = weights.load_model(weights.resolve_model(str(f.dir)))
    proc = InputProcessor(tok, vocab_size=f.cfg.vocab_size, max_model_len=256, max_logprobs=0,
                          generation=loaded.generation)
    eot = tok.token_to_id(END_OF_TURN[name])
    assert eot is not None and eot in loaded.generation.eos_token_ids and eot in proc.eos_token_ids
    req = proc.process(None, jaxinfer.SamplingParams(max_tokens=4), messages=[{"role": "user", "content": "hi"}])
    assert eot in req.stop_token_ids


@pytest.mark.parametrize("name", [f for f in ("gemma3", "llama3", "qwen3_moe") if f in FAMILIES])
def test_cli_generate_names_the_family_and_its_size(name, tmp_path):
    """`jaxinfer generate --model DIR` end to end: the model's own tokenizer and chat template
    (Qwen3's with enable_thinking off), the family and its size named on load. (Three families
    with different templates and features; every family runs end to end through `LLM(path)` above.)"""
    import subprocess
    import sys

    cfg = family(name).cfg
    kwargs = ["--chat-template-kwargs", '{"enable_thinking": false}'] if name.startswith("qwen3") else []
    env = dict(os.environ, JAXINFER_MODEL_CACHE=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "generate", "--model", str(FAMILY_DIR / name), "--max-tokens", "4",
         "--temperature", "0", "--dtype", "float32", "--verbose", "--json", *kwargs, "hello"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert out.returncode == 0, out.stderr
    assert f"{cfg.architecture}, {cfg.num_layers} layers" in out.stderr, out.stderr
    if cfg.num_experts:
        assert "8 experts, top 2" in out.stderr
    if cfg.sliding_window:
        assert f"sliding window {cfg.sliding_window}" in out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) >= 1


def test_a_multimodal_gemma3_config_reads_its_sparse_text_config_with_transformers_defaults():
    """gemma-3-4b-it's config.json: the text_config has only the keys that differ from
    Gemma3TextConfig's defaults. The expected values are what transformers' Gemma3Config gives
    for this dict (checked with transformers 5.23): 8 heads over 4 KV heads of 256, scale 256,
    vocabulary 262208, tied, every 6th layer global, local RoPE 1e4, global 1e6 linear x8."""
    d = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
         "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                         "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                         "sliding_window": 1024},
         "vision_config": {"model_type": "siglip_vision_model"}}
    c = config_from_hf(d)
    assert (c.architecture, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim) == ("gemma3", 262208, 8, 4, 256)
    assert (c.query_pre_attn_scalar, c.max_position_embeddings, c.tie_word_embeddings) == (256, 131072, True)
    assert [c.layer_window(i) for i in range(7)] == [1024] * 5 + [0, 1024]
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling.rope_type, c.rope_scaling.factor) == (1e6, 1e4, "linear", 8)
    assert c.final_logit_softcap is None and c.embed_scale == 2560**0.5


def test_qwen3_moe_slides_every_layer_and_qwen3_from_max_window_layers():
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "use_sliding_window": True,
            "sliding_window": 64, "max_window_layers": 2}
    moe = config_from_hf({**base, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 16})
    dense = config_from_hf({**base, "model_type": "qwen3"})
    assert [moe.layer_window(i) for i in range(4)] == [64] * 4
    assert [dense.layer_window(i) for i in range(4)] == [0, 0, 64, 64]
    off = config_from_hf({**base, "model_type": "qwen3", "use_sliding_window": False})
    assert off.sliding_window is None and all(off.layer_window(i) == 0 for i in range(4))
