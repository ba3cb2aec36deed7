"""The ragged step (`jaxinfer.engine.step.ragged_step`): prefill chunks and decode rows in one forward pass.

The same work is done twice from the same state: as today's two programs (a `[B, T]` prefill of the
chunks and a `[B, 1]` decode of the running rows) and as one ragged step over a flat token list.
With the CPU kernels (every product and attention batch-invariant) the drawn tokens, their logprobs,
the prompt logprobs, the written KV cache and the sampler state are bitwise equal; on the pure-JAX
path they agree to float32 rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, tiny_params
from jaxinfer.engine import step
from jaxinfer.engine.sampling import RowSampling, build_metadata
from jaxinfer.ops import backend, kv_cache
from jaxinfer.ops.attention import AttentionMetadata, RaggedMetadata
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.sampler import init_sampler_state
from jaxinfer.config import EngineConfig
from jaxinfer.sampling_params import SamplingParams

PAGE = 4
SLOTS = 6
ENGINE = EngineConfig(page_size=PAGE, num_pages=64, max_num_seqs=SLOTS, max_logprobs=4)
LOGPROBS = 3


@dataclasses.dataclass
class Seq:
    """A request as the host holds it: its slot, its pages, its prompt and where it stands."""

    slot: int
    pages: list
    prompt: list
    params: SamplingParams
    seed: int
    done: int = 0  # tokens whose KV is in the cache

    def table(self, width: int) -> np.ndarray:
        row = np.zeros(width, np.int32)
        row[: len(self.pages)] = self.pages
        return row


def row_sampling(s: Seq, end: int, prefill: bool) -> RowSampling:
    if prefill:
        last = end == len(s.prompt)
        return RowSampling(s.params, s.seed, end, s.slot, is_output=last, prompt_len=len(s.prompt))
    return RowSampling(s.params, s.seed, end, s.slot, is_output=True, prompt_len=len(s.prompt))


def two_programs(params, cache, state, chunks, decodes, kernels, width=16):
    """Today's way: one [B, T] prefill of ``chunks`` [(seq, n)], then one [B, 1] decode of ``decodes``."""
    b, t = 4, 16
    tokens = np.zeros((b, t), np.int32)
    pos = np.full((b, t), -1, np.int32)
    slots = np.zeros((b, t), np.int32)
    table = np.zeros((b, width), np.int32)
    kv_lens = np.zeros(b, np.int32)
    last = np.zeros(b, np.int32)
    rows = [None] * b
    for i, (s, n) in enumerate(chunks):
        p = np.arange(s.done, s.done + n)
        tokens[i, :n] = s.prompt[s.done: s.done + n]
        pos[i, :n] = p
        table[i] = s.table(width)
        slots[i, :n] = table[i][p // PAGE] * PAGE + p % PAGE
        kv_lens[i] = s.done + n
        last[i] = n - 1
        rows[i] = row_sampling(s, s.done + n, True)
    md = build_metadata(rows, b, num_slots=SLOTS, max_logprobs=ENGINE.max_logprobs, vocab_size=TINY.vocab_size)
    pre, cache, state = step.prefill(params, cache, state, tokens, AttentionMetadata(pos, slots, table, kv_lens), last,
                                     md, cfg=TINY, kernels=kernels)
    pos = np.full((b, 1), -1, np.int32)
    slots = np.zeros((b, 1), np.int32)
    table = np.zeros((b, width), np.int32)
    kv_lens = np.zeros(b, np.int32)
    rows = [None] * b
    from_state = np.zeros(b, np.bool_)
    for i, s in enumerate(decodes):
        pos[i, 0] = s.done
        table[i] = s.table(width)
        slots[i, 0] = table[i][s.done // PAGE] * PAGE + s.done % PAGE
        kv_lens[i] = s.done + 1
        from_state[i] = True
        rows[i] = row_sampling(s, s.done + 1, False)
    md = build_metadata(rows, b, num_slots=SLOTS, max_logprobs=ENGINE.max_logprobs, vocab_size=TINY.vocab_size)
    dec, cache, state = step.decode_step(params, cache, state, np.zeros(b, np.int32), from_state,
                                         AttentionMetadata(pos, slots, table, kv_lens), md, cfg=TINY, kernels=kernels)
    return pre, dec, cache, state


def one_ragged_step(params, cache, state, chunks, decodes, kernels, width=16, n_pad=64, r_pad=8):
    """The same work as one flat list: decode rows first, then the chunks, padded to ``n_pad`` tokens and
    ``r_pad`` requests (an empty request between real ones is allowed, so one is put there)."""
    tokens = np.zeros(n_pad, np.int32)
    from_state = np.zeros(n_pad, np.bool_)
    pos = np.full(n_pad, -1, np.int32)
    slots = np.zeros(n_pad, np.int32)
    query_start = np.zeros(r_pad + 1, np.int32)
    table = np.zeros((r_pad, width), np.int32)
    kv_lens = np.zeros(r_pad, np.int32)
    logits_index = np.zeros(r_pad, np.int32)
    prompt_rows = np.zeros(r_pad, np.bool_)
    rows = [None] * r_pad
    work = [(s, 1, False) for s in decodes] + [(s, n, True) for s, n in chunks]
    at, r = 0, 0
    for s, n, prefill in work:
        p = np.arange(s.done, s.done + n)
        if prefill:
            tokens[at: at + n] = s.prompt[s.done: s.done + n]
        else:
            from_state[at] = True
        pos[at: at + n] = p
        table[r] = s.table(width)
        slots[at: at + n] = table[r][p // PAGE] * PAGE + p % PAGE
        kv_lens[r] = s.done + n
        logits_index[r] = at + n - 1
        prompt_rows[r] = prefill
        rows[r] = row_sampling(s, s.done + n, prefill)
        query_start[r] = at
        at += n
        query_start[r + 1] = at
        r += 1
        if r == 1:  # an empty request between real ones
            query_start[r + 1] = at
            r += 1
    query_start[r:] = at
    md = build_metadata(rows, r_pad, num_slots=SLOTS, max_logprobs=ENGINE.max_logprobs, vocab_size=TINY.vocab_size)
    meta = RaggedMetadata(pos, slots, query_start, table, kv_lens)
    request = np.array([i if row is not None else r_pad for i, row in enumerate(rows)], np.int32)
    out, cache, state = step.ragged_step(params, cache, state, tokens, from_state, meta,
                                         step.LogitsRows(logits_index, request), prompt_rows, md,
                                         cfg=TINY, kernels=kernels)
    return out, query_start, cache, state


def scenario():
    """Two running requests (one with penalties), a new prompt (with prompt logprobs) and a continuing one."""
    rng = np.random.default_rng(7)
    prompt = lambda n: [int(x) for x in rng.integers(1, TINY.vocab_size, n)]  # noqa: E731
    greedy = SamplingParams(temperature=0.0, logprobs=LOGPROBS)
    return [
        Seq(0, [1, 2, 3, 4], prompt(13), SamplingParams(temperature=0.8, logprobs=LOGPROBS), seed=11),
        Seq(1, [5, 6], prompt(5), SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5,
                                                 logprobs=LOGPROBS), seed=12),
        Seq(2, [7, 8, 9], prompt(9), SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=LOGPROBS), seed=13),
        Seq(3, [10, 11, 12], prompt(10), greedy, seed=14),
    ]


def run_both(kernels):
    params = tiny_params()
    cache = kv_cache.init_cache(TINY, ENGINE)
    state = init_sampler_state(SLOTS, TINY.vocab_size)
    a, b, c, d = seqs = scenario()
    # before: a and b prefilled whole (their first tokens drawn, on device), d's first 6 tokens
    _, _, cache, state = two_programs(params, cache, state, [(a, 13), (b, 5), (d, 6)], [], kernels)
    a.done, b.done, d.done = 13, 5, 6
    copy = lambda t: jax.tree.map(jnp.array, t)  # noqa: E731  (each path donates its own)
    chunks, decodes = [(c, 9), (d, 4)], [a, b]
    pre, dec, cache_two, state_two = two_programs(params, copy(cache), copy(state), chunks, decodes, kernels)
    rag, qs, cache_one, state_one = one_ragged_step(params, copy(cache), copy(state), chunks, decodes, kernels)
    return seqs, (pre, dec, cache_two, state_two), (rag, qs, cache_one, state_one)


@pytest.fixture(scope="module")
def cpu_kernels():
    choice = backend.prepare()
    if not (choice.cpu_attention and choice.cpu_matmul):
        pytest.skip(f"the native CPU kernels are not loaded ({choice})")
    return choice


def rows_of(out, row_index):
    """(token, logprob, top ids, top logprobs) of each row."""
    h = lambda x: np.asarray(x)  # noqa: E731
    return [(int(h(out.tokens)[i]), float(h(out.logprob)[i]), h(out.top_ids)[i, :LOGPROBS].tolist(),
             h(out.top_logprobs)[i, :LOGPROBS].tolist()) for i in row_index]


def compare(kernels, exact: bool):
    seqs, (pre, dec, cache_two, state_two), (rag, qs, cache_one, state_one) = run_both(kernels)
    # ragged rows: a, (empty), b, c, d; two programs: decode rows a, b; prefill rows c, d
    two = rows_of(dec, [0, 1]) + rows_of(pre, [0, 1])
    one = rows_of(rag, [0, 2, 3, 4])
    c_start = int(qs[3])
    two_prompt = np.asarray(pre.prompt_logprob)[0, :8]
    one_prompt = np.asarray(rag.prompt_logprob)[c_start: c_start + 8]
    if exact:
        assert one == two
        np.testing.assert_array_equal(one_prompt, two_prompt)
        np.testing.assert_array_equal(np.asarray(rag.prompt_top_ids)[c_start: c_start + 8, :2],
                                      np.asarray(pre.prompt_top_ids)[0, :8, :2])
        for x, y in zip(jax.tree.leaves(cache_one), jax.tree.leaves(cache_two)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    else:
        assert [r[0] for r in one] == [r[0] for r in two]  # the tiny model's margins are far above rounding
        np.testing.assert_allclose([r[1] for r in one], [r[1] for r in two], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(one_prompt, two_prompt, rtol=1e-4, atol=1e-5)
        for x, y in zip(jax.tree.leaves(cache_one), jax.tree.leaves(cache_two)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
    # the sampler state: every slot's last token; the token histories of the rows with penalties (a step
    # keeps histories only when one of its rows uses them, so other slots' may differ and are never read)
    np.testing.assert_array_equal(np.asarray(state_one.last_tokens), np.asarray(state_two.last_tokens))
    b = seqs[1]
    for field in ("output_counts", "prompt_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(state_one, field))[b.slot],
                                      np.asarray(getattr(state_two, field))[b.slot])
    assert (np.asarray(one_prompt) < 0).all()  # c asked for prompt logprobs: every scored position has one
    assert not np.asarray(rag.prompt_logprob)[: int(qs[3])].any()  # decode rows are never scored
    # the penalised row's history holds its prompt and its two drawn tokens
    counts = np.asarray(state_one.output_counts)[b.slot]
    assert counts.sum() == 2 and np.asarray(state_one.prompt_mask)[b.slot, b.prompt].all()


def test_a_mixed_ragged_step_is_bitwise_the_two_programs_with_the_cpu_kernels(cpu_kernels):
    compare(cpu_kernels, exact=True)


def test_a_mixed_ragged_step_matches_the_two_programs_on_the_pure_jax_path():
    compare(KernelChoice.pure_jax("cpu"), exact=False)
