"""The layer walk every family runs: embeddings, each layer's attention and MLP (dense or routed), the head.

- `forward(params, cfg, tokens, kv_cache, attn)`: hidden states, updating the paged cache;
- `logits(params, cfg, hidden)`: the LM head.

The parameter tree is the weights table's typed `Params` of `Layer` blocks
(`jaxinfer.models.weights_table`); the parts are the
decoder's (`jaxinfer.models.decoder`) and the routed experts `jaxinfer.models.moe`'s.
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.models import moe
from jaxinfer.models.decoder import activation, apply_rope, layer_ropes, matmul, rms_norm, split_gate_up, split_qkv
from jaxinfer.models.weights_table import Attention, DenseMLP, LatentAttention, Layer, Norms, Params
from jaxinfer.ops import backend
from jaxinfer.ops.attention import (
    AttentionMetadata,
    RaggedMetadata,
    latent_paged_attention,
    paged_attention,
    ragged_paged_attention,
)
from jaxinfer.ops.quant import is_quantized

Metadata = Union[AttentionMetadata, RaggedMetadata]


def dense_mlp(p: DenseMLP, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    gate, up = split_gate_up(cfg, matmul(h, p.w_gate_up))
    return matmul(activation(cfg, gate) * up, p.w_down)


def attention(p: Attention, cfg: ModelConfig, li: int, h: jax.Array, cache_layer, attn: Metadata, rope):
    """The attention block on normed inputs h [B, T, hidden]: (its output before the residual, the cache).

    ``attn``: `AttentionMetadata` for B rows of T tokens, or `RaggedMetadata` for one flat list of
    requests' tokens (h [1, N, hidden]: a ragged step, `jaxinfer.engine.step.ragged_step`)."""
    b, t, _ = h.shape
    ragged = isinstance(attn, RaggedMetadata)
    positions = attn.positions[None] if ragged else attn.positions
    eps, off = cfg.rms_norm_eps, cfg.norm_weight_offset
    qkv = matmul(h, p.wqkv)
    if cfg.attention_bias:
        qkv = qkv + p.bqkv.astype(jnp.float32)
    q, k, v = split_qkv(cfg, qkv)
    if cfg.qk_norm:
        q = rms_norm(q, p.q_norm, eps, off)
        k = rms_norm(k, p.k_norm, eps, off)
    inv_freq, rope_scale = rope
    q = apply_rope(q, positions, inv_freq, rope_scale)
    k = apply_rope(k, positions, inv_freq, rope_scale)
    window = cfg.layer_window(li)
    if ragged:
        o, cache_layer = ragged_paged_attention(q[0], k[0], v[0], cache_layer, attn, scale=cfg.attn_scale, window=window)
        o = o[None]
    else:
        o, cache_layer = paged_attention(q, k, v, cache_layer, attn, scale=cfg.attn_scale, window=window)
    return matmul(o.reshape(b, t, cfg.q_size), p.wo), cache_layer


# transformers' DeepSeek builds the query's and the latent's RMSNorms with their default epsilon, not the config's
LATENT_NORM_EPS = 1e-6


def latent_attention(p: LatentAttention, cfg: ModelConfig, li: int, h: jax.Array, cache_layer, attn: Metadata, rope):
    """Multi-head latent attention (DeepSeek-V2/V3) on normed inputs h [B, T, hidden], in the absorbed form.

    As transformers computes it: each head's query is [nope | rope] (through ``wq_a`` -> norm -> ``wq_b``,
    or ``wq``); the token's latent c (``wkv_a``'s first ``kv_lora_rank`` outputs, normed) gives each head
    its no-rope key ``W_uk[h] c`` and its value ``W_uv[h] c`` (``wkv_b``), and ``wkv_a``'s last
    ``qk_rope_head_dim`` outputs, roped, are one rotary key shared by the heads. Scores are
    ``q_nope . W_uk[h] c + q_rope . k_rope``. Absorbed: the query becomes ``[W_uk[h]^T q_nope | q_rope]``
    and the key ``[c | k_rope]``, the same for every head, so the cache holds that entry once per token
    (`jaxinfer.ops.kv_cache`) and attention reads only it; the output is the heads' weighted latents
    times ``W_uv[h]``, then ``wo``. Prefill and decode run this same form (a token's numbers do not
    depend on whether it was prefilled, in a chunk of any size, or decoded).
    """
    b, t, _ = h.shape
    ragged = isinstance(attn, RaggedMetadata)
    positions = attn.positions[None] if ragged else attn.positions
    nh, dn, dr, lat, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.head_dim
    if cfg.q_lora_rank:
        q = matmul(rms_norm(matmul(h, p.wq_a), p.q_a_norm, LATENT_NORM_EPS), p.wq_b)
    else:
        q = matmul(h, p.wq)
    q = q.reshape(b, t, nh, dn + dr)
    kv = matmul(h, p.wkv_a)  # [B, T, latent + rope]
    c = rms_norm(kv[..., :lat], p.kv_a_norm, LATENT_NORM_EPS)
    inv_freq, rope_scale = rope
    q_rope = apply_rope(q[..., dn:], positions, inv_freq, rope_scale, cfg.rope_interleave)
    k_rope = apply_rope(kv[:, :, None, lat:], positions, inv_freq, rope_scale, cfg.rope_interleave)
    # per head [nope key rows | value rows] x latent; float32 products on CPU (XLA's bfloat16 dot is slow
    # there), the weights' own dtype elsewhere, accumulated in float32
    choice = backend.current()
    wdt = jnp.float32 if choice.platform == "cpu" else p.wkv_b.dtype
    w = p.wkv_b.astype(wdt)
    mix = dict(precision=choice.lax_precision, preferred_element_type=jnp.float32)
    q_lat = jnp.einsum("bthd,hdl->bthl", q[..., :dn].astype(wdt), w[:, :dn], **mix)
    query = jnp.concatenate([q_lat, q_rope], axis=-1).reshape(b * t, nh, lat + dr)
    entry = jnp.concatenate([c[:, :, None, :], k_rope], axis=-1).reshape(b * t, 1, lat + dr)
    meta = attn if ragged else attn.ragged()
    o_lat, cache_layer = latent_paged_attention(query, entry, cache_layer, meta, scale=cfg.attn_scale, value_dim=lat)
    o = jnp.einsum("nhl,hvl->nhv", o_lat.astype(wdt), w[:, dn:], **mix)
    return matmul(o.reshape(b, t, nh * dv), p.wo), cache_layer


def _layer(p: Layer, cfg: ModelConfig, li: int, x: jax.Array, cache_layer, attn: Metadata, rope):
    eps, off = cfg.rms_norm_eps, cfg.norm_weight_offset
    n: Norms = p.norms
    mix = latent_attention if cfg.latent else attention
    a, cache_layer = mix(p.attention, cfg, li, rms_norm(x, n.attn_norm, eps, off), cache_layer, attn, rope)
    if cfg.sandwich_norms:
        a = rms_norm(a, n.attn_out_norm, eps, off)
    x = x + a
    h = rms_norm(x, n.mlp_norm, eps, off)
    m = moe.routed_mlp(p.mlp, cfg, h) if cfg.is_moe_layer(li) else dense_mlp(p.mlp, cfg, h)
    if cfg.sandwich_norms:
        m = rms_norm(m, n.mlp_out_norm, eps, off)
    return x + m, cache_layer


def forward(
    params: Params, cfg: ModelConfig, tokens: jax.Array, kv_cache: list, attn: Metadata
) -> tuple[jax.Array, list]:
    """tokens: [B, T] int32 -> (hidden [B, T, hidden_size] float32, updated kv_cache).

    With `RaggedMetadata`, tokens are [1, N]: every request's tokens in one flat list.

    The residual stream is float32 whatever the weights' dtype.
    """
    embed = params.embed
    if is_quantized(embed):
        x = embed.lookup(tokens, jnp.float32)
    else:
        x = embed[tokens].astype(jnp.float32)
    if cfg.embed_scale != 1.0:  # in the embeddings' dtype, as transformers rounds it (bfloat16: 50.5, not 50.6)
        scale_dtype = jnp.float32 if is_quantized(embed) else embed.dtype
        x = x * jnp.asarray(cfg.embed_scale, scale_dtype).astype(jnp.float32)
    ropes = [(jnp.asarray(f), s) for f, s in layer_ropes(cfg)]
    new_cache = []
    for li, (p, cache_layer) in enumerate(zip(params.layers, kv_cache)):
        x, cache_layer = _layer(p, cfg, li, x, cache_layer, attn, ropes[li])
        new_cache.append(cache_layer)
    return rms_norm(x, params.final_norm, cfg.rms_norm_eps, cfg.norm_weight_offset), new_cache


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden: [..., hidden_size] -> float32 logits [..., vocab]."""
    if cfg.tie_word_embeddings:
        out = matmul(hidden, params.embed, w_contract=1)
    else:
        head = params.lm_head  # quantized: [vocab, hidden] (jaxinfer.ops.quant)
        out = matmul(hidden, head, w_contract=1 if is_quantized(head) else 0)
    out = out.astype(jnp.float32)
    if cfg.final_logit_softcap:
        out = jnp.tanh(out / cfg.final_logit_softcap) * cfg.final_logit_softcap
    return out
