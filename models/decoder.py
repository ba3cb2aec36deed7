"""The decoder every family runs: a Llama-shaped transformer whose differences are config data.

Its parts, pure functions of arrays:

- `matmul(x, w)`: every product with a weight, in the weights' dtype, accumulated in float32;
- `rms_norm`, the rotary embedding (`rope_inv_freq`, `layer_ropes`, `apply_rope`), the MLP's
  `activation`, and the splits of the fused projections (`split_qkv`, `split_gate_up`).

Built on them: the layer walk (`jaxinfer.models.transformer`: ``forward``, ``logits``) and the
routed experts (`jaxinfer.models.moe`). The parameter tree, its Hugging Face tensors and the
converter (``param_specs``, ``hf_tensor_shapes``, ``params_from_hf``, re-exported here) are
derived from the weights table (`jaxinfer.models.weights_table`).

What a family changes is a field of `ModelConfig`, read by its module in `jaxinfer.models`:
Q/K/V biases (Qwen2), per-head Q/K norms (Qwen3, Gemma 3), norms that scale by
``1 + weight`` and the extra norms after attention and the MLP (Gemma 3), scaled
embeddings, the MLP activation, the attention scale, sliding-window layers and their
own RoPE base (Mistral, Gemma 3), RoPE scaling (llama3, linear, yarn), a final logit
soft cap, and routed experts in place of the MLP (`jaxinfer.models.moe`).

Canonical tensor names are those of Hugging Face Llama (``model.layers.N.self_attn.q_proj.weight``,
``mlp.gate_proj``...), with ``self_attn.q_norm``/``k_norm``, Gemma's
``pre_feedforward_layernorm``/``post_feedforward_layernorm``, and for experts
``mlp.gate.weight`` (router) and ``mlp.experts.E.{gate,up,down}_proj.weight``.
Loaders (`jaxinfer.loading.weights`) map every file format and family naming to these.

Layout: weights are stored ``[in, out]`` so a layer is ``x @ w``. Q, K and V are
fused into one ``wqkv`` and gate/up into one ``w_gate_up``: fewer, larger
matmuls, which is what a memory-bound decode step wants. On a device mesh their
columns are ordered per tensor-parallel shard (`split_qkv`, `split_gate_up`; the
layout is `jaxinfer.ops.mesh.TPLayout`'s), so each device's columns are its own heads;
the same code runs at every tensor-parallel size. Layers are a Python
list, so a jitted step unrolls them and each layer's cache array is updated
in place (a `lax.scan` carrying the whole cache copies it every step); it also
lets layers differ (sliding or full attention, dense or routed MLP).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.models.weights_table import hf_tensor_shapes, param_specs, params_from_hf  # noqa: F401
from jaxinfer.ops import backend, cpu_matmul, invariant
from jaxinfer.ops.quant import is_quantized

Params = dict[str, Any]


# ---------------------------------------------------------------------------
# layers


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32, scaled by ``offset + weight`` (offset 1 for Gemma's zero-centred weights).

    The mean square and the reciprocal root are the batch-invariant forms (`jaxinfer.ops.invariant`):
    a row's norm does not depend on how many rows are normalised with it."""
    xf = x.astype(jnp.float32)
    xf = xf * invariant.rsqrt(invariant.row_mean(xf * xf, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return (xf * (w + offset if offset else w)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, rs: RopeScaling | None) -> tuple[np.ndarray, float]:
    """Inverse rotary frequencies [head_dim // 2] and the cos/sin scale, for one RoPE setting.

    Scaling types follow transformers' ``modeling_rope_utils``: "llama3" (frequencies below
    the original context's band divided by ``factor``, a smooth blend in between), "linear"
    (all divided by ``factor``), "yarn" (a linear ramp between extrapolated and interpolated
    frequencies over the dimensions that rotate between ``beta_fast`` and ``beta_slow``
    times in the original context; cos and sin scaled by ``attention_factor``).
    """
    d = head_dim
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if rs is None:
        return inv.astype(np.float32), 1.0
    if rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
        return inv.astype(np.float32), 1.0
    if rs.rope_type == "linear":
        return (inv / rs.factor).astype(np.float32), 1.0
    # yarn
    def correction_dim(rotations: float) -> float:
        return d * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp
    inv = (inv / rs.factor) * (1.0 - extrapolate) + inv * extrapolate
    return inv.astype(np.float32), float(rs.attention_factor)


def layer_ropes(cfg: ModelConfig) -> list[tuple[np.ndarray, float]]:
    """Each layer's (inverse frequencies, cos/sin scale): sliding layers may have their own base."""
    full = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    local = full if cfg.local_rope_theta is None else rope_inv_freq(cfg.rope_dim, cfg.local_rope_theta, None)
    return [local if cfg.layer_window(li) else full for li in range(cfg.num_layers)]


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0,
               interleaved: bool = False) -> jax.Array:
    """Rotate the halves of each head (the Hugging Face "rotate_half" convention), or with ``interleaved``
    its adjacent pairs (2i, 2i + 1) (DeepSeek's layout, llama.cpp's NORM rope), returned as
    [rotated evens | rotated odds] as transformers' DeepSeek-V3 returns them: a query and a key
    rotated alike meet in the same order, which is all attention reads.

    x: [B, T, N, D]; positions: [B, T] int32; cos and sin are multiplied by ``scale`` (yarn).
    """
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def matmul(x: jax.Array, w: Any, w_contract: int = 0) -> jax.Array:
    """x @ w in the weights' dtype, accumulated and returned in float32.

    Where the step's kernel choice has the CPU matmul (`jaxinfer.ops.backend.KernelChoice`:
    the cpu platform with the native kernels loaded) every product goes to the native kernel
    (`jaxinfer.ops.cpu_matmul`) where it takes
    the weight: float32, bfloat16, float16 or quantized, any number of rows (decode's few,
    prefill's many). It reads each weight element once, widens it to float32 in registers
    (a quantized one: dequantizes a cache-sized panel at a time for many rows, never a
    float copy of the whole weight) and keeps the activations in float32, so with 16-bit
    weights it computes x (float32) times the exact weight values. Each output element is
    summed in one fixed order whatever the rows in the step: a row's result is bitwise the
    same alone or in any batch.

    Elsewhere (GPU, TPU, ``JAXINFER_CPU_KERNELS=0``, a multi-device mesh) XLA computes it:
    a quantized weight (`jaxinfer.ops.quant.QuantizedWeight`) is dequantized to float32 inside
    the program and multiplied (GPU and TPU fuse the dequantization into the product). With
    float32 weights this is a plain float32 matmul. With bfloat16 weights the activations
    are rounded to bfloat16 just for the product, which the hardware runs natively;
    everything between matmuls (residual stream, norms, RoPE, attention) stays float32.

    ``w_contract`` is the axis of ``w`` that meets x's last axis (1 for the tied
    embedding, stored [vocab, hidden]).

    XLA's product runs at the choice's precision (`KernelChoice.matmul_precision`: "default", the
    platform's fastest for float32, TF32 on NVIDIA GPUs; or "highest", full float32).

    In batch-invariant mode (the choice's `KernelChoice.batch_invariant`) XLA's path runs the product as a loop
    of fixed-shape row tiles (`jaxinfer.ops.invariant.tiled_dot`), so a row's result does not
    depend on the step's other rows there either.

    On XLA's path a single bfloat16 row is padded to two: XLA's CPU backend turns a one-row
    product into a matrix-vector one that it runs an order of magnitude slower than two rows
    in bfloat16.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    choice = backend.current()  # the step's kernel choice, product precision and batch-invariant mode
    if cpu_matmul.fits(rows, w, w_contract, choice):
        y = cpu_matmul.matmul(x.reshape(rows, k).astype(jnp.float32), w, w_contract)
        return y.reshape(*lead, y.shape[-1])
    if is_quantized(w):
        w = w.dequantize(jnp.float32)
    x2 = x.reshape(rows, k).astype(w.dtype)
    dims = (((1,), (w_contract,)), ((), ()))
    if choice.batch_invariant:  # batch-invariant mode: one dot shape whatever the rows
        with backend.precision_scope(choice):
            y = invariant.tiled_dot(x2, w, dims)
        return y.reshape(*lead, y.shape[-1])
    pad = rows == 1 and w.dtype != jnp.float32
    if pad:
        x2 = jnp.concatenate([x2, jnp.zeros_like(x2)])
    y = jax.lax.dot_general(x2, w, dims, precision=choice.lax_precision, preferred_element_type=jnp.float32)
    if pad:
        y = y[:1]
    return y.reshape(*lead, y.shape[-1])


def activation(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The gated MLP's activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""
    if cfg.hidden_act == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def split_gate_up(cfg: ModelConfig, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., 2i] -> gate, up [..., i]; the columns are [gate | up] per tensor-parallel shard
    (`ModelConfig.tp_shards`, see `jaxinfer.ops.mesh`), one shard: [gate | up]."""
    s = cfg.tp_shards
    y = y.reshape(*y.shape[:-1], s, 2, y.shape[-1] // (2 * s))
    lead = y.shape[:-3]
    return y[..., 0, :].reshape(*lead, -1), y[..., 1, :].reshape(*lead, -1)


def split_qkv(cfg: ModelConfig, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B, T, (H + 2 KVH) * D] -> q [B, T, H, D], k, v [B, T, KVH, D]; the columns are [q | k | v]
    per tensor-parallel shard (`ModelConfig.tp_shards`), one shard: [q | k | v]."""
    b, t, _ = qkv.shape
    s, d = cfg.tp_shards, cfg.head_dim
    nq, nkv = cfg.num_heads // s, cfg.num_kv_heads // s
    x = qkv.reshape(b, t, s, (nq + 2 * nkv) * d)
    q = x[..., : nq * d].reshape(b, t, cfg.num_heads, d)
    k = x[..., nq * d : (nq + nkv) * d].reshape(b, t, cfg.num_kv_heads, d)
    v = x[..., (nq + nkv) * d :].reshape(b, t, cfg.num_kv_heads, d)
    return q, k, v
