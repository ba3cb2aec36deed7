"""The sampler: one pure function run on device inside every step.

Per-request parameters are padded data arrays (`SamplingMetadata`); only a
few switches are compile keys: all-greedy, filters on (top-k / top-p / min-p),
penalties on, and the number of top logprobs returned. Randomness is derived
per row from the request's seed and the position being sampled, so a seeded
request draws the same tokens whatever else is in the batch.

Penalties (presence / frequency / repetition) need each request's token
history; it lives on device in `SamplerState`, one row per engine slot,
donated and updated in place by the step, so the host never ships
vocabulary-sized arrays.

Order, as in vLLM: penalties -> banned tokens (min_tokens) -> temperature
-> min-p -> top-k -> top-p -> draw. Logprobs are of the raw model distribution.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling_params import GREEDY_EPS

NUM_BANNED = 16  # width of the per-row banned-token list (stop ids before min_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling inputs [B]; the last four fields are static switches."""

    temperature: jax.Array  # [B] f32 (0 = greedy)
    top_k: jax.Array  # [B] i32 (0 = off)
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    repetition_penalty: jax.Array  # [B] f32
    seeds: jax.Array  # [B] u32
    sample_pos: jax.Array  # [B] i32, position of the token being drawn
    banned: jax.Array  # [B, NUM_BANNED] i32, -1 = none
    slot_ids: jax.Array  # [B] i32, row in SamplerState (out of range = padding row)
    is_output: jax.Array  # [B] bool, the drawn token is an output token (not a mid-prompt chunk)
    prompt_lens: jax.Array  # [B] i32, tokens at or past this position are earlier outputs (recompute)
    all_greedy: bool = field(default=True, metadata=dict(static=True))
    use_filters: bool = field(default=False, metadata=dict(static=True))
    use_penalties: bool = field(default=False, metadata=dict(static=True))
    num_logprobs: int = field(default=0, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Token history per engine slot, for penalties: [num_slots, vocab]."""

    output_counts: jax.Array  # i32
    prompt_mask: jax.Array  # bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # [B] i32
    logprob: Optional[jax.Array] = None  # [B] f32, logprob of the drawn token
    top_ids: Optional[jax.Array] = None  # [B, N] i32
    top_logprobs: Optional[jax.Array] = None  # [B, N] f32


def init_sampler_state(num_slots: int, vocab_size: int) -> SamplerState:
    return SamplerState(
        output_counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
        prompt_mask=jnp.zeros((num_slots, vocab_size), jnp.bool_),
    )


def record_prompt(
    state: SamplerState, tokens: jax.Array, positions: jax.Array, valid: jax.Array, md: "SamplingMetadata"
) -> SamplerState:
    """Add a prefill chunk to the token history; a row whose chunk starts at 0 is reset first.

    tokens, positions, valid: [B, T]. Tokens before the row's prompt length count as
    prompt; later ones (a preempted request being recomputed) count as outputs again.
    """
    num_slots = state.output_counts.shape[0]
    slot_ids = md.slot_ids
    reset = jnp.zeros((num_slots,), jnp.bool_).at[slot_ids].set(positions[:, 0] == 0, mode="drop")
    counts = jnp.where(reset[:, None], 0, state.output_counts)
    mask = jnp.where(reset[:, None], False, state.prompt_mask)
    rows = jnp.broadcast_to(slot_ids[:, None], tokens.shape)
    is_prompt = positions < md.prompt_lens[:, None]
    mask = mask.at[jnp.where(valid & is_prompt, rows, num_slots), tokens].set(True, mode="drop")
    counts = counts.at[jnp.where(valid & ~is_prompt, rows, num_slots), tokens].add(1, mode="drop")
    return SamplerState(counts, mask)


def _apply_penalties(logits, md: SamplingMetadata, state: SamplerState):
    counts = state.output_counts.at[md.slot_ids].get(mode="fill", fill_value=0)
    prompt = state.prompt_mask.at[md.slot_ids].get(mode="fill", fill_value=False)
    seen = prompt | (counts > 0)
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    cf = counts.astype(jnp.float32)
    return logits - md.frequency_penalty[:, None] * cf - md.presence_penalty[:, None] * (cf > 0)


def _apply_filters(logits, md: SamplingMetadata):
    """min-p, then top-k, then top-p, masking with -inf; logits are temperature-scaled."""
    b, v = logits.shape
    neg = jnp.finfo(jnp.float32).min
    probs = jax.nn.softmax(logits, axis=-1)
    max_p = jnp.max(probs, axis=-1, keepdims=True)
    logits = jnp.where(probs < md.min_p[:, None] * max_p, neg, logits)
    srt = -jnp.sort(-logits, axis=-1)  # descending
    k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, v), v)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    srt = jnp.where(srt < kth, neg, srt)
    sp = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(sp, axis=-1) - sp  # mass strictly above each sorted token
    keep = before < md.top_p[:, None]
    keep = keep.at[:, 0].set(True)
    thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    thresh = jnp.maximum(thresh, kth)
    return jnp.where(logits < thresh, neg, logits)


def _row_keys(seeds, positions):
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def sample(
    logits: jax.Array, md: SamplingMetadata, state: Optional[SamplerState]
) -> tuple[SamplerOutput, Optional[SamplerState]]:
    """logits: [B, V] float32 -> drawn tokens (and logprobs), updated penalty state."""
    b, v = logits.shape
    raw = logits
    if md.use_penalties:
        logits = _apply_penalties(logits, md, state)
    banned = jnp.where(md.banned < 0, v, md.banned)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], banned.shape)
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if md.all_greedy:
        tokens = greedy
    else:
        is_greedy = md.temperature < GREEDY_EPS
        scaled = logits / jnp.where(is_greedy, 1.0, md.temperature)[:, None]
        if md.use_filters:
            scaled = _apply_filters(scaled, md)
        keys = _row_keys(md.seeds, md.sample_pos)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
        drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        tokens = jnp.where(is_greedy, greedy, drawn)
    if md.use_penalties:
        counts = state.output_counts.at[md.slot_ids, tokens].add(md.is_output.astype(jnp.int32), mode="drop")
        state = SamplerState(counts, state.prompt_mask)
    out = SamplerOutput(tokens=tokens)
    if md.num_logprobs > 0:
        lp = jax.nn.log_softmax(raw, axis=-1)
        chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(lp, md.num_logprobs)
        out = SamplerOutput(tokens, chosen, top_ids.astype(jnp.int32), top_lp)
    return out, state


def build_metadata(
    rows: list,
    batch_size: int,
    *,
    num_slots: int,
    num_logprobs: int,
) -> SamplingMetadata:
    """Pad per-row host values into a `SamplingMetadata` of ``batch_size`` rows.

    ``rows`` holds one `RowSampling` (or None for a padding row) per batch row.
    """
    f32 = lambda: np.zeros(batch_size, np.float32)  # noqa: E731
    temp, top_p, min_p = f32(), np.ones(batch_size, np.float32), f32()
    pres, freq, rep = f32(), f32(), np.ones(batch_size, np.float32)
    top_k = np.zeros(batch_size, np.int32)
    seeds = np.zeros(batch_size, np.uint32)
    pos = np.zeros(batch_size, np.int32)
    banned = np.full((batch_size, NUM_BANNED), -1, np.int32)
    slots = np.full(batch_size, num_slots, np.int32)
    is_out = np.zeros(batch_size, np.bool_)
    plens = np.zeros(batch_size, np.int32)
    all_greedy, filters, penalties = True, False, False
    for i, r in enumerate(rows):
        if r is None:
            continue
        sp = r.params
        temp[i], top_p[i], min_p[i], top_k[i] = sp.temperature, sp.top_p, sp.min_p, sp.top_k
        pres[i], freq[i], rep[i] = sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
        seeds[i], pos[i], slots[i], is_out[i] = r.seed, r.sample_pos, r.slot, r.is_output
        plens[i] = r.prompt_len if r.prompt_len is not None else r.sample_pos
        if r.banned:
            ids = list(r.banned)[:NUM_BANNED]
            banned[i, : len(ids)] = ids
        all_greedy &= sp.greedy
        filters |= sp.uses_filters
        penalties |= sp.uses_penalties
    return SamplingMetadata(
        temperature=temp,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=pres,
        frequency_penalty=freq,
        repetition_penalty=rep,
        seeds=seeds,
        sample_pos=pos,
        banned=banned,
        slot_ids=slots,
        is_output=is_out,
        prompt_lens=plens,
        all_greedy=bool(all_greedy),
        use_filters=bool(filters),
        use_penalties=bool(penalties),
        num_logprobs=int(num_logprobs),
    )


@dataclasses.dataclass
class RowSampling:
    """Host-side sampling inputs of one batch row."""

    params: object  # SamplingParams
    seed: int
    sample_pos: int
    slot: int
    is_output: bool = True
    banned: tuple = ()
    prompt_len: Optional[int] = None  # None: everything before sample_pos is prompt
