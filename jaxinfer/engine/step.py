"""The two jitted device entry points: `prefill` and `decode_step`.

Both are pure functions of (params, KV cache, sampler state, token ids,
attention metadata, sampling metadata); both donate the KV cache and the
sampler state so they are updated in place, and both return the drawn tokens
(and logprobs when asked) as device arrays. They share one core: a decode step
is a prefill chunk of length one.

Compile keys are the model config, the kernel choice (``kernels``, a
`jaxinfer.ops.backend.KernelChoice`: which attention and matmul kernels the
program calls, decided once after the kernels load, and the precision of XLA's
float32 products, which every product of the step takes) and the padded shapes
(batch, chunk length, and the page-table width); sampler settings, logprobs and
context lengths are data. The engine compiles them ahead of time into its
program table (`jaxinfer.engine.programs`); calling these jitted functions
directly works too: without ``kernels`` they take the host's choice at the call
(`KernelChoice.loaded`), decided before the trace, so jit's cache keys on it.

Prompt logprobs (`SamplingParams.prompt_logprobs`) come from the prefill itself:
when a row of the chunk asks for them (a data flag, `lax.cond`: a prefill without
such a row does nothing more), the hidden state at each of its chunk positions
goes through the LM head and `jaxinfer.ops.sampler.token_logprobs` — the same
functions that give a drawn token's logprob — a block of rows at a time
(`prompt_logprob_rows`), so the logits held at once stay bounded whatever the
chunk (a 4,096-token step of a 49k vocabulary would be 800 MB at once; a block
of 128 rows is 25 MB).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import chex
import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.models import get_family
from jaxinfer.ops import backend
from jaxinfer.ops.attention import AttentionMetadata, RaggedMetadata
from jaxinfer.ops.gather_attention import request_of_token
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.sampler import (
    Drafts, SamplerOutput, SamplerState, SamplingMetadata, record_prompt_if_needed, record_tokens, sample,
    token_logprobs,
)

# Prompt logprobs make at most this many bytes of float32 logits at once, in blocks of at most
# PROMPT_LOGPROB_MAX_ROWS rows (a power of two): on CPU the head's product is cheapest per row around
# 128 rows per block, and a block of a 49k vocabulary is then 25 MB.
PROMPT_LOGPROB_BYTES = 32 << 20
PROMPT_LOGPROB_MAX_ROWS = 128


def prompt_logprob_rows(vocab_size: int) -> int:
    """Rows of logits per block for prompt logprobs: the largest power of two whose float32 logits fit
    `PROMPT_LOGPROB_BYTES`, within [8, `PROMPT_LOGPROB_MAX_ROWS`] (128 for a 49k vocabulary, 32 for 262k)."""
    fit = max(1, PROMPT_LOGPROB_BYTES // (4 * vocab_size))
    return max(8, min(PROMPT_LOGPROB_MAX_ROWS, 1 << (fit.bit_length() - 1)))


def prompt_logprobs(
    params: Any, cfg: ModelConfig, hidden: jax.Array, tokens: jax.Array, last_index: jax.Array,
    sampling: SamplingMetadata,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The logprob of each chunk token given the ones before it, from the chunk's hidden states.

    hidden: [B, T, D]; tokens: [B, T]. Returns (logprob [B, T], top ids [B, T, N], top logprobs
    [B, T, N], rank [B, T]), N = ``sampling.max_logprobs``: at index j < ``last_index`` of a row
    that asked (``sampling.want_prompt_logprobs``) the logprob of token j + 1 under the
    distribution at j, its rank there and the N most likely tokens; zeros elsewhere. The row's last token is scored by the sampler
    (it is the drawn token's position) or, mid-prompt, by the next chunk (`jaxinfer.engine.scheduler`
    starts that one a token earlier). Logits are made `prompt_logprob_rows` rows at a time, and a
    block without a row that asked is skipped.
    """
    b, t, d = hidden.shape
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    scored = sampling.want_prompt_logprobs[:, None] & (jnp.arange(t)[None, :] < last_index[:, None])
    lp, ids, top, rank = scored_logprobs(params, cfg, hidden.reshape(b * t, d), targets.reshape(-1), scored.reshape(-1),
                                         sampling.max_logprobs)
    n = sampling.max_logprobs
    return lp.reshape(b, t), ids.reshape(b, t, n), top.reshape(b, t, n), rank.reshape(b, t)


def scored_logprobs(
    params: Any, cfg: ModelConfig, hidden: jax.Array, targets: jax.Array, scored: jax.Array, n: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """hidden [M, D], targets [M], scored [M] -> (logprob of each target [M], top ids [M, n], top logprobs
    [M, n], rank [M]) where ``scored``, zeros elsewhere: logits made `prompt_logprob_rows` rows at a time,
    a block without a scored row skipped."""
    rows, d = hidden.shape
    family = get_family(cfg.architecture)
    r = min(prompt_logprob_rows(cfg.vocab_size), rows)
    nb = -(-rows // r)
    pad = nb * r - rows

    def blocks(x, *tail):
        return jnp.pad(x.reshape(rows, *tail), [(0, pad)] + [(0, 0)] * len(tail)).reshape(nb, r, *tail)

    def zeros(m):
        return (jnp.zeros((m,), jnp.float32), jnp.zeros((m, n), jnp.int32), jnp.zeros((m, n), jnp.float32),
                jnp.zeros((m,), jnp.int32))

    def scored_only(sc, outs):
        return tuple(jnp.where(sc.reshape(-1, *[1] * (x.ndim - 1)), x, jnp.zeros((), x.dtype)) for x in outs)

    def block(args):
        h, tg, sc = args
        return jax.lax.cond(
            jnp.any(sc),
            lambda: scored_only(sc, token_logprobs(family.logits(params, cfg, h), tg, n, rank=True)),
            lambda: zeros(r),
        )

    def every_block():
        lp, ids, top, rank = jax.lax.map(block, (blocks(hidden, d), blocks(targets), blocks(scored)))
        m = nb * r
        return lp.reshape(m)[:rows], ids.reshape(m, n)[:rows], top.reshape(m, n)[:rows], rank.reshape(m)[:rows]

    return jax.lax.cond(jnp.any(scored), every_block, lambda: zeros(rows))


def _step_core(
    params: Any,
    kv_cache: list,
    sampler_state: SamplerState,
    tokens: jax.Array,
    attn: AttentionMetadata,
    last_index: jax.Array,
    sampling: SamplingMetadata,
    cfg: ModelConfig,
    record: bool,
    kernels: Optional[KernelChoice],
):
    # Device code reads the kernel choice from here (`backend.current`); None: the host's at trace time.
    # Its matmul precision reaches every product traced in the step (`backend.precision_scope`).
    with backend.using(kernels) if kernels is not None else contextlib.nullcontext():
        with backend.precision_scope(backend.current()):
            return _step_body(params, kv_cache, sampler_state, tokens, attn, last_index, sampling, cfg, record)


def _step_body(params, kv_cache, sampler_state, tokens, attn, last_index, sampling, cfg, record):
    b, t = tokens.shape
    chex.assert_shape(last_index, (b,))
    family = get_family(cfg.architecture)
    hidden, kv_cache = family.forward(params, cfg, tokens, kv_cache, attn)
    h_last = jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = family.logits(params, cfg, h_last)
    if record:
        valid = jnp.arange(t)[None, :] <= last_index[:, None]
        sampler_state = record_prompt_if_needed(sampler_state, tokens, attn.positions, valid, sampling)
    out, sampler_state = sample(logits, sampling, sampler_state)
    if record:  # a prefill chunk: prompt logprobs for the rows that ask
        lp, ids, top, rank = prompt_logprobs(params, cfg, hidden, tokens, last_index, sampling)
        out = dataclasses.replace(out, prompt_logprob=lp, prompt_top_ids=ids, prompt_top_logprobs=top,
                                  prompt_rank=rank)
    return out, kv_cache, sampler_state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsRows:
    """Where a ragged step makes logits, L rows (the sampling metadata's rows, in this order).

    index: [L] i32, the flat token whose hidden state gives the row's logits; request: [L] i32, the
    request the row belongs to (a request's rows are contiguous; padding rows: R or more); draft: [L]
    i32 or None: speculative decoding, the draft token that follows the row's token in its request's
    verify segment (-1: none). None where the engine does not speculate: one row per request (L = R)
    and no verification in the program.
    """

    index: jax.Array
    request: jax.Array
    draft: Optional[jax.Array] = None


def _ragged_step(
    params: Any,
    kv_cache: list,
    sampler_state: SamplerState,
    tokens: jax.Array,
    from_state: jax.Array,
    attn: RaggedMetadata,
    rows: LogitsRows,
    prompt_rows: jax.Array,
    sampling: SamplingMetadata,
    *,
    cfg: ModelConfig,
    kernels: Optional[KernelChoice] = None,
) -> tuple[SamplerOutput, list, SamplerState]:
    """One step over a ragged batch: every scheduled token of every request in one flat list, prefill
    chunks and decode rows in one forward pass (the weights read once), padded only to a token count.

    tokens: [N] int32; from_state: [N] bool, take the token instead from the one its request's slot drew
    last (``sampler_state.last_tokens``: a decode row whose input is still on device);
    attn: `RaggedMetadata` of R requests (request r owns tokens ``query_start[r]`` up to
    ``query_start[r + 1]``); rows: `LogitsRows`, the L positions whose logits draw a token (sampling has
    L rows): each request's last token, and with speculative decoding every token of a verify segment
    (a decode row's input and its drafts: `jaxinfer.ops.sampler.Drafts`); prompt_rows: [R] bool, the
    request's tokens are prompt (a prefill chunk: recorded for penalties, scored for prompt logprobs),
    not a decode row's input.

    A request's results are bitwise those of the same tokens run as a `prefill` chunk or a
    `decode_step` row where the products and attention are batch-invariant (the CPU kernels).
    Prompt logprobs come back per token ([N]): token j of a prompt row scores token j + 1.
    """
    with backend.using(kernels) if kernels is not None else contextlib.nullcontext():
        with backend.precision_scope(backend.current()):
            return _ragged_body(params, kv_cache, sampler_state, tokens, from_state, attn, rows, prompt_rows,
                                sampling, cfg)


def _ragged_body(params, kv_cache, sampler_state, tokens, from_state, attn, rows, prompt_rows, sampling, cfg):
    n = tokens.shape[0]
    r = prompt_rows.shape[0]
    chex.assert_shape((from_state, attn.positions), (n,))
    chex.assert_shape((prompt_rows, attn.kv_lens), (r,))
    chex.assert_equal_shape((rows.index, rows.request, sampling.slot_ids))

    def per_request(x, fill):  # a row-wise value every row of a request shares -> [R]
        return jnp.full((r,), fill, x.dtype).at[rows.request].set(x, mode="drop")

    num_slots = sampler_state.last_tokens.shape[0]
    slot_of, plen_of = per_request(sampling.slot_ids, num_slots), per_request(sampling.prompt_lens, 0)
    want_plp = per_request(sampling.want_prompt_logprobs, False)
    req = request_of_token(attn.query_start, jnp.arange(n, dtype=jnp.int32))  # [N]
    valid = (attn.positions >= 0) & (jnp.arange(n) < attn.query_start[r])
    slots = jnp.where(valid, slot_of[req], num_slots)
    on_device = sampler_state.last_tokens.at[slots].get(mode="fill", fill_value=0)
    tokens = jnp.where(from_state, on_device, tokens)
    family = get_family(cfg.architecture)
    hidden, kv_cache = family.forward(params, cfg, tokens[None], kv_cache, attn)
    hidden = hidden[0]  # [N, D]
    logits = family.logits(params, cfg, hidden[rows.index])
    prompt = valid & prompt_rows[req]
    sampler_state = jax.lax.cond(
        sampling.any_penalties(),
        lambda st: record_tokens(st, tokens, attn.positions, prompt, slots, plen_of[req]),
        lambda st: st,
        sampler_state,
    )
    drafts = None if rows.draft is None else Drafts(rows.draft, rows.request, r)
    out, sampler_state = sample(logits, sampling, sampler_state, drafts)
    targets = jnp.concatenate([tokens[1:], jnp.zeros((1,), tokens.dtype)])
    last = attn.query_start[jnp.minimum(req + 1, r)] - 1  # each token's request's last token
    scored = prompt & want_plp[req] & (jnp.arange(n) < last)
    lp, ids, top, rank = scored_logprobs(params, cfg, hidden, targets, scored, sampling.max_logprobs)
    out = dataclasses.replace(out, prompt_logprob=lp, prompt_top_ids=ids, prompt_top_logprobs=top, prompt_rank=rank)
    return out, kv_cache, sampler_state


def _prefill(
    params: Any,
    kv_cache: list,
    sampler_state: SamplerState,
    tokens: jax.Array,
    attn: AttentionMetadata,
    last_index: jax.Array,
    sampling: SamplingMetadata,
    *,
    cfg: ModelConfig,
    kernels: Optional[KernelChoice] = None,
) -> tuple[SamplerOutput, list, SamplerState]:
    """Run a chunk of prompt tokens and draw the next token after each row's last one.

    tokens: [B, T] int32 (a chunk starting at ``attn.positions[:, 0]``, padded);
    last_index: [B] int32, index in the chunk of each row's last real token.
    The drawn token matters only for a row whose chunk ends its prompt.
    """
    return _step_core(params, kv_cache, sampler_state, tokens, attn, last_index, sampling, cfg, True, kernels)


def _decode_step(
    params: Any,
    kv_cache: list,
    sampler_state: SamplerState,
    tokens: jax.Array,
    from_state: jax.Array,
    attn: AttentionMetadata,
    sampling: SamplingMetadata,
    *,
    cfg: ModelConfig,
    kernels: Optional[KernelChoice] = None,
) -> tuple[SamplerOutput, list, SamplerState]:
    """One token per running request; attention metadata has T = 1.

    tokens: [B] int32, each row's input token where the host has it;
    from_state: [B] bool, take the row's input instead from the token its slot drew
    last (``sampler_state.last_tokens``): the previous step's output, still on device.
    """
    b = tokens.shape[0]
    chex.assert_shape(from_state, (b,))
    on_device = sampler_state.last_tokens.at[sampling.slot_ids].get(mode="fill", fill_value=0)
    tokens = jnp.where(from_state, on_device, tokens)
    last = jnp.zeros((b,), jnp.int32)
    return _step_core(params, kv_cache, sampler_state, tokens[:, None], attn, last, sampling, cfg, False, kernels)


_JIT = dict(static_argnames=("cfg", "kernels"), donate_argnames=("kv_cache", "sampler_state"))


class _Step:
    """A jitted step whose ``kernels`` (static) defaults to the host's choice at the call,
    `KernelChoice.loaded`: decided before the trace, so jit's cache keys on it and a kernel loaded
    later gives a new program, not a stale one. Calls, ``lower`` and ``trace`` take it alike;
    anything else is the jitted function's."""

    def __init__(self, fn):
        self._jit = jax.jit(fn, **_JIT)
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__

    @staticmethod
    def _with_choice(kw: dict) -> dict:
        if kw.get("kernels") is None:
            kw = {**kw, "kernels": KernelChoice.loaded()}
        return kw

    def __call__(self, *args, **kw):
        return self._jit(*args, **self._with_choice(kw))

    def lower(self, *args, **kw):
        return self._jit.lower(*args, **self._with_choice(kw))

    def trace(self, *args, **kw):
        return self._jit.trace(*args, **self._with_choice(kw))

    def __getattr__(self, name):
        return getattr(self._jit, name)


prefill = _Step(_prefill)
decode_step = _Step(_decode_step)
ragged_step = _Step(_ragged_step)


def on_mesh(cache_sharding: Any, replicated: Any):
    """The engine's step (`ragged_step`) jitted for a device mesh: the KV cache comes back in
    ``cache_sharding`` and the rest (drawn tokens, sampler state) replicated, as they went in,
    so every step's outputs are the next step's inputs as compiled. Static: ``cfg`` and ``kernels``
    (the program table passes its `KernelChoice`)."""
    return jax.jit(_ragged_step, out_shardings=(replicated, cache_sharding, replicated), **_JIT)
