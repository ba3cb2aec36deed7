"""The sampler: one pure function run on device inside every step.

Per-request parameters are padded data arrays (`SamplingMetadata`), and so
is every switch: whether any row samples, uses filters (top-k / top-p /
min-p), penalties or logprobs is read from the data on device, and each costly
stage runs under a `lax.cond` only when some row needs it. No sampler setting
is a compile key; the one static value is the engine's `max_logprobs` (the
width of the top-logprobs output, the same for every step: rows cut it to
their own count on the host). Randomness is derived per row from the
request's seed and the position being sampled, so a seeded request draws the
same tokens whatever else is in the batch.

Penalties (presence / frequency / repetition) need each request's token
history; it lives on device in `SamplerState`, one row per engine slot,
donated and updated in place by the step, so the host never ships
vocabulary-sized arrays. The state also keeps each slot's last drawn token,
so a decode step feeds the previous step's tokens without a host round trip.

Structured output (`jaxinfer.engine.structured`) arrives as data too: ``allowed``, an int32 bitmask
``[B, ceil(vocab / 32)]`` per row (bit t of a row allows token t), computed on the host by the
grammar engine from the tokens drawn so far. It is applied first, before every other stage; a row
without a constraint is all ones, and a step where every row is all ones skips the stage.

Order, as in vLLM: allowed-token mask -> logit bias -> penalties -> banned tokens (min_tokens) ->
temperature -> min-p -> top-k -> top-p -> draw (greedy rows take the argmax after
the bias, penalties and bans). Logprobs are of the raw model distribution: before the grammar's mask
too (vLLM reports them after it), so they are what a trainer scoring the text would compute.

``logit_bias`` (OpenAI's: token id -> bias added to its logit) is a padded
per-row list of `MAX_LOGIT_BIAS` (token id, bias) pairs, id -1 for none: data
of a fixed width, so a request with a bias runs the same program as any other.

Speculative decoding (`Drafts`): a request's rows are a segment — the distribution after its input
token and after each of its k draft tokens — and row j verifies draft j + 1 (a single chosen token,
so p_draft = 1 at it). A greedy row accepts while the draft is its argmax. A sampled row draws its token
exactly as a plain decode row at that position would (Gumbel-max with the request's seed and the
position, from the row's distribution after every stage above) and accepts the draft when the draw is
the draft. That is the standard rejection rule for a one-hot draft (Leviathan et al., 2023; vLLM's
``min(1, p/q)`` with q = 1): the draft is accepted with probability p_target(draft), and after a rejection
the token drawn follows p_target without the draft, renormalised. Each segment keeps its rows up to its
first non-accepting row (or its last row, the bonus draw): every kept row but the last emits its draft,
the last its own draw. So greedy output is the argmax chain, sampled output has exactly the target's
distribution, and since every kept row draws what plain decoding would draw there, a seeded request
draws the same tokens with and without speculation, whatever it drafted (bitwise where the verify
rows' logits are those of plain decode rows: the CPU kernels). A row's penalties count the drafts
before it in its segment (``SamplingMetadata.prior``) as outputs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import field
from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer.ops import invariant
from jaxinfer.sampling_params import GREEDY_EPS

NUM_BANNED = 16  # width of the per-row banned-token list (stop ids before min_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling inputs [B]; `max_logprobs` (the engine's) is the only static field."""

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
    want_logprobs: jax.Array  # [B] bool, the row's request asked for logprobs
    want_prompt_logprobs: jax.Array  # [B] bool, the row's request asked for prompt logprobs (prefill)
    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] i32, token ids of the row's logit_bias, -1 = none
    bias_values: jax.Array  # [B, MAX_LOGIT_BIAS] f32, the bias added to each of those logits
    # [B, ceil(V / 32)] i32 allowed-token bitmask (structured output; all ones = no constraint).
    # None (metadata built without a vocabulary size, e.g. by research code): no such stage.
    allowed: Optional[jax.Array] = None
    # [B, K] i32: the draft tokens before this row in its request's verify segment (speculative decoding),
    # counted as outputs by the penalties; -1 = none. None (no speculation configured): no such stage.
    prior: Optional[jax.Array] = None
    max_logprobs: int = field(default=0, metadata=dict(static=True))

    # Stage switches, read from the data on device (padding rows hold neutral values).
    def sampling_rows(self) -> jax.Array:
        return self.temperature >= GREEDY_EPS

    def any_sampling(self) -> jax.Array:
        return jnp.any(self.sampling_rows())

    def any_filters(self) -> jax.Array:
        uses = (self.top_k > 0) | (self.top_p < 1.0) | (self.min_p > 0.0)
        return jnp.any(uses & self.sampling_rows())

    def any_constrained(self) -> jax.Array:
        return jnp.any(self.allowed != -1)

    def any_bias(self) -> jax.Array:
        return jnp.any(self.bias_ids >= 0)

    def any_penalties(self) -> jax.Array:
        return jnp.any(
            (self.repetition_penalty != 1.0) | (self.presence_penalty != 0.0) | (self.frequency_penalty != 0.0)
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Per engine slot: token history for penalties [num_slots, vocab], last drawn token [num_slots]."""

    output_counts: jax.Array  # i32
    prompt_mask: jax.Array  # bool
    last_tokens: jax.Array  # i32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # [B] i32
    logprob: Optional[jax.Array] = None  # [B] f32, logprob of the drawn token
    top_ids: Optional[jax.Array] = None  # [B, N] i32
    top_logprobs: Optional[jax.Array] = None  # [B, N] f32
    # prefill only (`jaxinfer.engine.step`): at chunk index j < last_index, the logprob of the chunk's token j + 1
    # and the top N at j, for rows that asked for prompt logprobs (others hold zeros)
    prompt_logprob: Optional[jax.Array] = None  # [B, T] f32
    prompt_top_ids: Optional[jax.Array] = None  # [B, T, N] i32
    prompt_top_logprobs: Optional[jax.Array] = None  # [B, T, N] f32
    prompt_rank: Optional[jax.Array] = None  # [B, T] i32, rank of token j + 1 at j (1: the likeliest)
    # speculative decoding (`Drafts`): the row's token is an output (the rows of its segment up to the first
    # rejection); None where every row's token is
    emitted: Optional[jax.Array] = None  # [B] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafts:
    """What each row verifies (speculative decoding): ``token`` [B] i32, the draft that follows the row's
    input in its request's segment (-1: none: the segment's last row, or a plain row); ``segment`` [B] i32,
    the row's request (a segment's rows are contiguous; padding rows: any value >= ``num_segments``)."""

    token: jax.Array
    segment: jax.Array
    num_segments: int = field(metadata=dict(static=True))


def init_sampler_state(num_slots: int, vocab_size: int) -> SamplerState:
    return SamplerState(
        output_counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
        prompt_mask=jnp.zeros((num_slots, vocab_size), jnp.bool_),
        last_tokens=jnp.zeros((num_slots,), jnp.int32),
    )


def record_prompt(
    state: SamplerState, tokens: jax.Array, positions: jax.Array, valid: jax.Array, md: "SamplingMetadata"
) -> SamplerState:
    """Add a prefill chunk to the token history; a row whose chunk starts at 0 is reset first.

    tokens, positions, valid: [B, T]. Tokens before the row's prompt length count as
    prompt; later ones (a preempted request being recomputed) count as outputs again.
    """
    rows = jnp.broadcast_to(md.slot_ids[:, None], tokens.shape)
    prompt_lens = jnp.broadcast_to(md.prompt_lens[:, None], tokens.shape)
    return record_tokens(state, tokens.reshape(-1), positions.reshape(-1), valid.reshape(-1), rows.reshape(-1),
                         prompt_lens.reshape(-1))


def record_tokens(state: SamplerState, tokens: jax.Array, positions: jax.Array, valid: jax.Array, slots: jax.Array,
                  prompt_lens: jax.Array) -> SamplerState:
    """Add tokens to their slots' histories; all [M], one entry per token (a flat list of any rows' tokens).

    A slot with a valid token at position 0 (its prompt starts in this step) is reset first; a token
    before its request's prompt length counts as prompt, a later one (a preempted request being
    recomputed) as an output again. Slots out of range (padding) and invalid tokens are dropped."""
    num_slots = state.output_counts.shape[0]
    starts = jnp.where(valid & (positions == 0), slots, num_slots)
    reset = jnp.zeros((num_slots,), jnp.bool_).at[starts].set(True, mode="drop")
    counts = jnp.where(reset[:, None], 0, state.output_counts)
    mask = jnp.where(reset[:, None], False, state.prompt_mask)
    is_prompt = positions < prompt_lens
    mask = mask.at[jnp.where(valid & is_prompt, slots, num_slots), tokens].set(True, mode="drop")
    counts = counts.at[jnp.where(valid & ~is_prompt, slots, num_slots), tokens].add(1, mode="drop")
    return dataclasses.replace(state, output_counts=counts, prompt_mask=mask)


def record_prompt_if_needed(state, tokens, positions, valid, md: "SamplingMetadata") -> SamplerState:
    """`record_prompt`, run only when some row of the chunk uses penalties."""
    return jax.lax.cond(
        md.any_penalties(),
        lambda st: record_prompt(st, tokens, positions, valid, md),
        lambda st: st,
        state,
    )


def _apply_allowed(logits, allowed):
    """Set the logits of tokens a row's bitmask does not allow to -inf (bit t of word t // 32)."""
    b, v = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # arithmetic shift: bit 31 too
    ok = bits.reshape(b, -1)[:, :v] != 0
    return jnp.where(ok, logits, -jnp.inf)


def _apply_bias(logits, md: SamplingMetadata):
    """Add each row's logit_bias to its logits (ids -1, the padding, are dropped)."""
    b, v = logits.shape
    ids = jnp.where(md.bias_ids < 0, v, md.bias_ids)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    return logits.at[rows, ids].add(md.bias_values, mode="drop")


def _apply_penalties(logits, md: SamplingMetadata, state: SamplerState):
    counts = state.output_counts.at[md.slot_ids].get(mode="fill", fill_value=0)
    if md.prior is not None:  # a verify row: the drafts before it in its segment are outputs too
        b, v = logits.shape
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], md.prior.shape)
        counts = counts.at[rows, jnp.where(md.prior < 0, v, md.prior)].add(1, mode="drop")
    prompt = state.prompt_mask.at[md.slot_ids].get(mode="fill", fill_value=False)
    seen = prompt | (counts > 0)
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    cf = counts.astype(jnp.float32)
    return logits - md.frequency_penalty[:, None] * cf - md.presence_penalty[:, None] * (cf > 0)


# top-k and top-p find their cut by bisection over the logits' values (`_cut_by_search`): 64 passes over
# the rows, several times cheaper on a CPU than sorting every row of a large vocabulary. (A first look
# among the best 256 logits with `lax.top_k` was faster still when the cut lay there, but programs holding
# it crashed when reloaded from the program cache on the pure-JAX path, jax 0.10.2.)


def _sortable(x):
    """float32 -> uint32 keys in the same order (negative floats reversed below the positive ones)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _unsortable(key):
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _least(pred, lo, hi):
    """The least uint32 c in [lo, hi] with pred(c) [B], for a pred false then true (true at hi): 32 halvings."""

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return jnp.where(pred(lo), lo, hi)


def _cut_by_search(logits, lse, md: SamplingMetadata, v: int):
    """The top-k / top-p threshold logit [B, 1] of each row, found by bisection over the logits' values.

    top-k: the least value with fewer than k logits above it is the k-th largest. top-p: the
    least value whose strictly-greater tokens hold less than top_p of the mass left by top-k.
    """
    neg = jnp.finfo(jnp.float32).min
    # -0.0 as +0.0: they compare equal as floats (the final mask keeps both), so they must be one key here,
    # or a top-k cut at 0 counts the -0.0 tokens out of the mass top-p divides (found by hypothesis)
    keys = _sortable(jnp.where(logits == 0.0, 0.0, logits))
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)
    probs = jnp.exp(logits - lse[:, None])
    has_k = (md.top_k > 0) & (md.top_k < v)
    kth = _least(lambda c: jnp.sum(keys > c[:, None], axis=-1) < md.top_k, lo, hi)
    kth = jnp.where(has_k, kth, lo)
    mass = jnp.where(keys >= kth[:, None], probs, 0.0)
    total = invariant.row_sum(mass)
    pth = _least(lambda c: invariant.row_sum(jnp.where(keys > c[:, None], mass, 0.0)) < md.top_p * total, lo, hi)
    key = jnp.maximum(kth, jnp.where(md.top_p < 1.0, pth, lo))
    return jnp.where((has_k | (md.top_p < 1.0))[:, None], _unsortable(key)[:, None], neg)


def _apply_filters(logits, md: SamplingMetadata):
    """min-p, then top-k, then top-p, masking with the lowest float; logits are temperature-scaled."""
    b, v = logits.shape
    neg = jnp.finfo(jnp.float32).min
    probs = invariant.softmax(logits)
    max_p = jnp.max(probs, axis=-1, keepdims=True)
    logits = jnp.where(probs < md.min_p[:, None] * max_p, neg, logits)
    thresh = _cut_by_search(logits, invariant.logsumexp(logits), md, v)
    return jnp.where(logits < thresh, neg, logits)


def _row_keys(seeds, positions):
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def sample(logits: jax.Array, md: SamplingMetadata, state: SamplerState,
           drafts: Optional[Drafts] = None) -> tuple[SamplerOutput, SamplerState]:
    """logits: [B, V] float32 -> drawn tokens (and top logprobs), updated sampler state.

    One program for every mix of settings: each stage below that some rows may
    not need (logit bias, penalties, filters, the random draw, logprobs) sits under
    a `lax.cond` on a flag read from the data, so it costs nothing when no row
    needs it and never selects another compiled program.

    ``drafts``: the rows verify speculative tokens (the module's docstring); the output's ``emitted``
    says which rows' tokens are outputs, and the state counts only those.
    """
    b, v = logits.shape
    raw = logits
    if md.allowed is not None:
        logits = jax.lax.cond(
            md.any_constrained(), lambda lg: _apply_allowed(lg, md.allowed), lambda lg: lg, logits
        )
    logits = jax.lax.cond(md.any_bias(), lambda lg: _apply_bias(lg, md), lambda lg: lg, logits)
    logits = jax.lax.cond(
        md.any_penalties(), lambda lg: _apply_penalties(lg, md, state), lambda lg: lg, logits
    )
    banned = jnp.where(md.banned < 0, v, md.banned)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], banned.shape)
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(lg):
        is_greedy = ~md.sampling_rows()
        scaled = lg / jnp.where(is_greedy, 1.0, md.temperature)[:, None]
        scaled = jax.lax.cond(md.any_filters(), lambda x: _apply_filters(x, md), lambda x: x, scaled)
        keys = _row_keys(md.seeds, md.sample_pos)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
        drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(is_greedy, greedy, drawn)

    # every row draws what plain decoding draws at its position (greedy rows the argmax)
    tokens = jax.lax.cond(md.any_sampling(), draw, lambda lg: greedy, logits)
    emitted, last = None, jnp.ones((b,), jnp.bool_)
    if drafts is not None:
        # a verify row accepts its draft when it drew it (a sampled row: with probability p(d); else its
        # draw follows p without d); each segment keeps its rows up to its first that does not accept (a
        # rejection, or its last row): each kept row's token is its draw (the draft, but at the last)
        ok = (drafts.token >= 0) & (tokens == drafts.token)
        seg = jnp.clip(drafts.segment, 0, drafts.num_segments)
        j = jnp.arange(b, dtype=jnp.int32)
        stop = jnp.full((drafts.num_segments + 1,), b, jnp.int32).at[seg].min(jnp.where(ok, b, j))[seg]
        emitted = (j <= stop) & (drafts.segment < drafts.num_segments)
        last = j == stop
    num_slots = state.last_tokens.shape[0]
    out_slots = jnp.where(md.is_output & (True if emitted is None else emitted), md.slot_ids, num_slots)
    counts = jax.lax.cond(
        md.any_penalties(),
        lambda c: c.at[out_slots, tokens].add(1, mode="drop"),
        lambda c: c,
        state.output_counts,
    )
    last_slots = jnp.where(last, out_slots, num_slots)  # a segment's last emitted token feeds its next step
    state = SamplerState(counts, state.prompt_mask, state.last_tokens.at[last_slots].set(tokens, mode="drop"))
    n = md.max_logprobs
    if n == 0:
        return SamplerOutput(tokens=tokens, emitted=emitted), state

    def none(raw_logits):
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, n), jnp.int32), jnp.zeros((b, n), jnp.float32)

    top = functools.partial(token_logprobs, tokens=tokens, n=n)
    chosen, top_ids, top_lp = jax.lax.cond(jnp.any(md.want_logprobs), top, none, raw)
    return SamplerOutput(tokens, chosen, top_ids, top_lp, emitted=emitted), state


def token_logprobs(raw_logits: jax.Array, tokens: jax.Array, n: int, *, rank: bool = False) -> tuple:
    """The logprob of ``tokens`` [R] under each row of ``raw_logits`` [R, V] (float32, the model's own
    distribution: no bias, penalty or temperature), and the row's ``n`` most likely (ids, logprobs);
    with ``rank``, also each token's rank [R] (1 + how many tokens are likelier), as vLLM reports it.

    The one definition of a reported logprob: the drawn tokens' (`sample`) and the prompt tokens'
    (`jaxinfer.engine.step`) both come from here, so scoring a finished sequence as a prompt gives back
    what was reported while it was drawn.
    """
    lp = invariant.log_softmax(raw_logits)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    r = raw_logits.shape[0]
    if n == 0:
        top_ids, top_lp = jnp.zeros((r, 0), jnp.int32), jnp.zeros((r, 0), jnp.float32)
    else:
        top_lp, top_ids = jax.lax.top_k(lp, n)
        top_ids = top_ids.astype(jnp.int32)
    if not rank:
        return chosen, top_ids, top_lp
    ranks = 1 + jnp.sum(lp > chosen[:, None], axis=-1, dtype=jnp.int32)
    return chosen, top_ids, top_lp, ranks
