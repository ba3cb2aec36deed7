"""The Llama family (Llama 2/3.x, SmolLM2, TinyLlama, Mistral without sliding window).

Pure functions over a parameter pytree:

- `param_specs(cfg)`: the parameter tree described once (shapes, dtypes, logical axes);
- `params_from_hf(tensors, cfg, dtype)`: Hugging Face-named numpy tensors -> parameter tree;
- `forward(params, cfg, tokens, kv_cache, attn)`: hidden states, updating the paged cache;
- `logits(params, cfg, hidden)`: the LM head;
- `matmul(x, w)`: every product with a weight, in the weights' dtype, accumulated in float32.

Layout: weights are stored ``[in, out]`` so a layer is ``x @ w``. Q, K and V are
fused into one ``wqkv`` and gate/up into one ``w_gate_up``: fewer, larger
matmuls, which is what a memory-bound decode step wants. Layers are a Python
list, so a jitted step unrolls them and each layer's cache array is updated
in place (a `lax.scan` carrying the whole cache copies it every step).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.attention import AttentionMetadata, paged_attention
from jaxinfer.config import ModelConfig
from jaxinfer.spec import ArraySpec

Params = dict[str, Any]


def param_specs(cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    d, i = cfg.hidden_size, cfg.intermediate_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    layer = {
        "attn_norm": ArraySpec((d,), dtype, ("embed",), init="ones"),
        "wqkv": ArraySpec((d, qkv), dtype, ("embed", "qkv")),
        "wo": ArraySpec((cfg.q_size, d), dtype, ("heads", "embed")),
        "mlp_norm": ArraySpec((d,), dtype, ("embed",), init="ones"),
        "w_gate_up": ArraySpec((d, 2 * i), dtype, ("embed", "mlp")),
        "w_down": ArraySpec((i, d), dtype, ("mlp", "embed")),
    }
    specs: Params = {
        "embed": ArraySpec((cfg.vocab_size, d), dtype, ("vocab", "embed")),
        "layers": [dict(layer) for _ in range(cfg.num_layers)],
        "final_norm": ArraySpec((d,), dtype, ("embed",), init="ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ArraySpec((d, cfg.vocab_size), dtype, ("embed", "vocab"))
    return specs


def params_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """Convert Hugging Face Llama tensors (``[out, in]`` weights) to our parameter tree."""

    def get(name: str) -> np.ndarray:
        try:
            return tensors[name]
        except KeyError:
            raise ValueError(f"weights are missing tensor {name!r}") from None

    def put(x: np.ndarray) -> jax.Array:
        return jnp.asarray(np.ascontiguousarray(x), dtype=dtype)

    layers = []
    for li in range(cfg.num_layers):
        p = f"model.layers.{li}."
        wq = get(p + "self_attn.q_proj.weight")
        wk = get(p + "self_attn.k_proj.weight")
        wv = get(p + "self_attn.v_proj.weight")
        layers.append(
            {
                "attn_norm": put(get(p + "input_layernorm.weight")),
                "wqkv": put(np.concatenate([wq, wk, wv], axis=0).T),
                "wo": put(get(p + "self_attn.o_proj.weight").T),
                "mlp_norm": put(get(p + "post_attention_layernorm.weight")),
                "w_gate_up": put(
                    np.concatenate([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], axis=0).T
                ),
                "w_down": put(get(p + "mlp.down_proj.weight").T),
            }
        )
    params: Params = {
        "embed": put(get("model.embed_tokens.weight")),
        "layers": layers,
        "final_norm": put(get("model.norm.weight")),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = put(get("lm_head.weight").T)
    return params


# ---------------------------------------------------------------------------
# layers


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse rotary frequencies [head_dim // 2], with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is not None:
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate the halves of each head (the Hugging Face "rotate_half" convention).

    x: [B, T, N, D]; positions: [B, T] int32.
    """
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def matmul(x: jax.Array, w: jax.Array, w_contract: int = 0) -> jax.Array:
    """x @ w in the weights' dtype, accumulated and returned in float32.

    ``w_contract`` is the axis of ``w`` that meets x's last axis (1 for the tied
    embedding, stored [vocab, hidden]). With float32 weights this is a plain float32
    matmul. With bfloat16 weights the activations are rounded to bfloat16 just for
    the product, which XLA's CPU backend runs natively (AVX512-BF16 where present:
    about twice float32's rate, measured); everything between matmuls (residual
    stream, norms, RoPE, attention) stays float32.

    A single bfloat16 row is padded to two: XLA's CPU backend turns a one-row
    product into a matrix-vector one that it runs ~12x slower than two rows in
    bfloat16 (measured, 30 SmolLM2 layers and head: 127 ms vs 10 ms).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    x2 = x.reshape(rows, k).astype(w.dtype)
    pad = rows == 1 and w.dtype != jnp.float32
    if pad:
        x2 = jnp.concatenate([x2, jnp.zeros_like(x2)])
    dims = (((1,), (w_contract,)), ((), ()))
    y = jax.lax.dot_general(x2, w, dims, preferred_element_type=jnp.float32)
    if pad:
        y = y[:1]
    return y.reshape(*lead, y.shape[-1])


def _layer(p: Params, cfg: ModelConfig, x: jax.Array, cache_layer, attn: AttentionMetadata, inv_freq):
    b, t, _ = x.shape
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    qkv = matmul(h, p["wqkv"])
    q = qkv[..., : cfg.q_size].reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = qkv[..., cfg.q_size : cfg.q_size + cfg.kv_size].reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[..., cfg.q_size + cfg.kv_size :].reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    q = apply_rope(q, attn.positions, inv_freq)
    k = apply_rope(k, attn.positions, inv_freq)
    o, cache_layer = paged_attention(q, k, v, cache_layer, attn, scale=cfg.head_dim**-0.5)
    x = x + matmul(o.reshape(b, t, cfg.q_size), p["wo"])
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    gate, up = jnp.split(matmul(h, p["w_gate_up"]), 2, axis=-1)
    x = x + matmul(jax.nn.silu(gate) * up, p["w_down"])
    return x, cache_layer


def forward(
    params: Params, cfg: ModelConfig, tokens: jax.Array, kv_cache: list, attn: AttentionMetadata
) -> tuple[jax.Array, list]:
    """tokens: [B, T] int32 -> (hidden [B, T, hidden_size] float32, updated kv_cache).

    The residual stream is float32 whatever the weights' dtype.
    """
    x = params["embed"][tokens].astype(jnp.float32)
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    new_cache = []
    for p, cache_layer in zip(params["layers"], kv_cache):
        x, cache_layer = _layer(p, cfg, x, cache_layer, attn, inv_freq)
        new_cache.append(cache_layer)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), new_cache


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden: [..., hidden_size] -> float32 logits [..., vocab]."""
    if cfg.tie_word_embeddings:
        out = matmul(hidden, params["embed"], w_contract=1)
    else:
        out = matmul(hidden, params["lm_head"])
    return out.astype(jnp.float32)
