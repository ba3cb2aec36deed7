"""Routed experts in place of the MLP (Qwen3-MoE, Mixtral): a router, top-k experts per token.

Routing is transformers': softmax of the router logits in float32, the ``k`` largest
probabilities, renormalised to sum to one when ``norm_topk_prob`` (always for Mixtral),
and each token's output is the weighted sum of its experts' gated MLPs.

How the experts are computed, and why
-------------------------------------
The token slots (token, choice) are sorted by expert and laid out in blocks of ``bt``
rows, each expert's slots starting a new block, so every block belongs to one expert.
Each block gathers its expert's weights and the blocks run as one batched matmul. The
number of blocks is static: at most ``S/bt + E`` for ``S = tokens * k`` slots and ``E``
experts (each expert wastes less than one block), and never more than ``S``. ``bt`` is
chosen from the static shape so the padding stays below the real work: 1 row per block
for decode (each slot reads just its expert's weights: the cost of the active experts,
which is what a memory-bound decode step pays for), up to 64 rows for long prefill
chunks (a blocked grouped matmul: the FLOPs of the active experts plus at most one
block of padding per expert).

`jax.lax.ragged_dot` is the grouped matmul JAX offers, and GPUs and TPUs lower it to
real grouped kernels; but on CPU (jax 0.10) it lowers to a dense product over every
expert, masked (`python -m benchmarks.moe` measures it against a dense step). One mechanism that costs what the active experts cost on
every backend is what this module does instead. The sort uses `jnp.argsort` and the top-k
is k rounds of argmax (k is small): `lax.top_k` is kept out of step programs on CPU
(see `jaxinfer.ops.sampler`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import activation, matmul, split_gate_up
from jaxinfer.models.weights_table import MOE, RoutedMLP
from jaxinfer.ops import invariant


MAX_BLOCK_ROWS = 64


def param_specs(cfg: ModelConfig, dtype: Any) -> RoutedMLP:
    """A routed layer's leaves as specs (the weights table's `jaxinfer.models.weights_table.MOE`)."""
    return RoutedMLP(**{d.name: d.spec(cfg, dtype) for d in MOE if d.present(cfg)})


def _top(scores: jax.Array, k: int) -> list[jax.Array]:
    """The indices of the ``k`` largest of each row ([N, M] float32 -> k arrays [N] int32), largest first:
    k rounds of argmax (no ``lax.top_k`` in step programs on CPU)."""
    out = []
    for _ in range(k):
        i = jnp.argmax(scores, axis=-1)
        out.append(i.astype(jnp.int32))
        scores = jnp.where(jax.nn.one_hot(i, scores.shape[-1], dtype=bool), -jnp.inf, scores)
    return out


def route(router_logits: jax.Array, cfg: ModelConfig, bias: Any = None) -> tuple[jax.Array, jax.Array]:
    """[N, E] float32 logits -> (weights [N, k] float32, experts [N, k] int32), largest first.

    The experts' scores are the softmax of the logits (or their sigmoid: DeepSeek-V3). The ``k`` chosen
    are the best by score, plus ``bias`` where the model has one (V3's correction bias: it moves the
    choice, never the weights), among the experts of the ``topk_groups`` best of ``expert_groups``
    groups (a group's score: its best expert's, or its best two summed); their weights are their
    scores, renormalised to sum to one (``norm_topk_prob``), times ``routed_scaling_factor``.
    """
    n, e = router_logits.shape
    logits = router_logits.astype(jnp.float32)
    scores = invariant.softmax(logits) if cfg.router_scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if cfg.topk_groups < cfg.expert_groups:
        grouped = choice.reshape(n, cfg.expert_groups, e // cfg.expert_groups)
        if cfg.group_scoring == "max":
            group_score = grouped.max(axis=-1)
        else:  # the best two of each group, summed
            first, second = _top(grouped.reshape(n * cfg.expert_groups, -1), 2)
            pick = lambda i: jnp.take_along_axis(grouped.reshape(n * cfg.expert_groups, -1), i[:, None], axis=-1)  # noqa: E731
            group_score = (pick(first) + pick(second)).reshape(n, cfg.expert_groups)
        kept = sum(jax.nn.one_hot(g, cfg.expert_groups, dtype=jnp.int32) for g in _top(group_score, cfg.topk_groups))
        keep = jnp.repeat(kept > 0, e // cfg.expert_groups, axis=-1)
        choice = jnp.where(keep, choice, -jnp.inf)
    experts = jnp.stack(_top(choice, cfg.num_experts_per_tok), axis=-1)
    w = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (invariant.row_sum(w, keepdims=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        w = w * cfg.routed_scaling_factor
    return w, experts


def block_rows(slots: int, num_experts: int) -> int:
    """Rows per block for `slots` token slots: about the mean slots per expert, a power of two."""
    target = max(1, min(MAX_BLOCK_ROWS, slots // num_experts))
    return 1 << (target.bit_length() - 1)


def routed_mlp(p: RoutedMLP, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """h: [..., hidden] -> the routed experts' output [..., hidden] float32."""
    lead, d = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, d)
    n, e, k = x.shape[0], cfg.num_experts, cfg.num_experts_per_tok
    # the router logits in the weights' dtype, as transformers has them (DeepSeek's: float32), then a float32 softmax
    router_logits = matmul(x, p.router)
    if not cfg.router_logits_float32:
        router_logits = router_logits.astype(p.router.dtype).astype(jnp.float32)
    weights, experts = route(router_logits, cfg, p.router_bias)

    s = n * k
    bt = block_rows(s, e)
    nb = min(s, (s + e * (bt - 1)) // bt)
    slot_expert = experts.reshape(s)
    order = jnp.argsort(slot_expert, stable=True)  # slots grouped by expert
    sorted_expert = slot_expert[order]
    counts = jnp.zeros((e,), jnp.int32).at[slot_expert].add(1)
    blocks = (counts + bt - 1) // bt
    block_end = jnp.cumsum(blocks)
    first_block = block_end - blocks
    first_slot = jnp.cumsum(counts) - counts
    rank = jnp.arange(s, dtype=jnp.int32) - first_slot[sorted_expert]
    row_of_sorted = first_block[sorted_expert] * bt + rank  # row in the [nb * bt] block layout
    row_of_slot = jnp.zeros((s,), jnp.int32).at[order].set(row_of_sorted)
    token_of_row = jnp.full((nb * bt,), n, jnp.int32).at[row_of_slot].set(jnp.arange(s, dtype=jnp.int32) // k)
    block_expert = jnp.minimum(jnp.searchsorted(block_end, jnp.arange(nb), side="right"), e - 1)

    xs = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[token_of_row].reshape(nb, bt, d)
    wgu = p.w_gate_up[block_expert]  # [nb, d, 2i]: each block's expert
    y = jnp.einsum("btd,bdo->bto", xs.astype(wgu.dtype), wgu, preferred_element_type=jnp.float32)
    gate, up = split_gate_up(cfg, y)
    a = activation(cfg, gate) * up
    wd = p.w_down[block_expert]
    out = jnp.einsum("bti,bid->btd", a.astype(wd.dtype), wd, preferred_element_type=jnp.float32)
    per_slot = out.reshape(nb * bt, d)[row_of_slot].reshape(n, k, d)
    weighted = per_slot * weights[..., None]
    y = weighted[:, 0]
    for j in range(1, k):  # in expert-rank order, not XLA's reduce order
        y = y + weighted[:, j]
    if p.shared_gate_up is not None:  # the shared experts, which every token runs (DeepSeek)
        gate, up = split_gate_up(cfg, matmul(x, p.shared_gate_up))
        y = y + matmul(activation(cfg, gate) * up, p.shared_down)
    return y.reshape(*lead, d)
