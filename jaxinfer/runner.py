"""The model runner: turns host request state into padded device inputs and calls the steps.

It owns the device state (parameters, KV cache, sampler state) and nothing
else; which requests run, and where their pages are, is decided by the caller
(the generation loop now, the scheduler later). All padding to buckets
happens here, through `jaxinfer.buckets`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jaxinfer import step
from jaxinfer.attention import AttentionMetadata
from jaxinfer.buckets import bucket_for, pages_needed
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.kv_cache import init_cache, slots_for
from jaxinfer.outputs import Logprob
from jaxinfer.request import Request, TokenRef
from jaxinfer.sampler import RowSampling, SamplerOutput, build_metadata, init_sampler_state


@dataclass
class PrefillChunk:
    """Prefill `length` tokens of `request` starting at position `start`."""

    request: Request
    start: int
    length: int


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, params: Any):
        self.cfg = model_cfg
        self.ecfg = engine_cfg
        self.params = params
        self.kv_cache = init_cache(model_cfg, engine_cfg)
        self.sampler_state = init_sampler_state(engine_cfg.max_num_seqs, model_cfg.vocab_size)

    # -- padded inputs ---------------------------------------------------

    def _page_table(self, reqs: Sequence[Request], num_tokens: Sequence[int], batch: int) -> np.ndarray:
        ps = self.ecfg.page_size
        need = max(pages_needed(n, ps) for n in num_tokens)
        p = bucket_for(need, self.ecfg.page_buckets, "pages attended")
        table = np.zeros((batch, p), np.int32)
        for i, (r, n) in enumerate(zip(reqs, num_tokens)):
            k = pages_needed(n, ps)
            if len(r.pages) < k:
                raise RuntimeError(f"{r.request_id} has {len(r.pages)} pages, needs {k}")
            table[i, :k] = r.pages[:k]
        return table

    def _num_logprobs(self, reqs: Sequence[Request]) -> int:
        return self.ecfg.max_logprobs if any(r.params.logprobs is not None for r in reqs) else 0

    def _sampling(self, rows: list, batch: int, reqs: Sequence[Request]):
        return build_metadata(
            rows, batch, num_slots=self.ecfg.max_num_seqs, num_logprobs=self._num_logprobs(reqs)
        )

    def _state_arg(self, md):
        return self.sampler_state if md.use_penalties else None

    def _keep_state(self, md, state) -> None:
        if md.use_penalties:
            self.sampler_state = state

    # -- steps -------------------------------------------------------------

    def prefill(self, chunks: Sequence[PrefillChunk]) -> SamplerOutput:
        """Dispatch one prefill step (asynchronously); rows follow `chunks`' order."""
        ps = self.ecfg.page_size
        b = bucket_for(len(chunks), self.ecfg.batch_buckets, "prefill batch size")
        t = bucket_for(max(c.length for c in chunks), self.ecfg.chunk_buckets, "prefill chunk length")
        tokens = np.zeros((b, t), np.int32)
        positions = np.full((b, t), -1, np.int32)
        slots = np.zeros((b, t), np.int32)
        kv_lens = np.zeros((b,), np.int32)
        last = np.zeros((b,), np.int32)
        table = self._page_table([c.request for c in chunks], [c.start + c.length for c in chunks], b)
        rows: list[Optional[RowSampling]] = [None] * b
        for i, c in enumerate(chunks):
            r, s, n = c.request, c.start, c.length
            ids = r.all_token_ids(s, n)
            pos = np.arange(s, s + n, dtype=np.int32)
            tokens[i, :n] = ids
            positions[i, :n] = pos
            slots[i, :n] = slots_for(table[i], pos, ps)
            kv_lens[i] = s + n
            last[i] = n - 1
            rows[i] = RowSampling(
                r.params,
                r.seed,
                s + n,
                r.slot,
                is_output=(s + n == r.prefill_target),
                banned=r.banned_ids(),
                prompt_len=r.prompt_len,
            )
        attn = AttentionMetadata(positions, slots, table, kv_lens)
        md = self._sampling(rows, b, [c.request for c in chunks])
        out, self.kv_cache, state = step.prefill(
            self.params, self.kv_cache, self._state_arg(md), tokens, attn, last, md, cfg=self.cfg
        )
        self._keep_state(md, state)
        return out

    def decode(self, reqs: Sequence[Request]) -> SamplerOutput:
        """Dispatch one decode step: each request's last drawn token goes in, the next comes out."""
        ps = self.ecfg.page_size
        b = bucket_for(len(reqs), self.ecfg.batch_buckets, "decode batch size")
        pos = np.full((b, 1), -1, np.int32)
        slots = np.zeros((b, 1), np.int32)
        kv_lens = np.zeros((b,), np.int32)
        table = self._page_table(reqs, [r.num_computed + 1 for r in reqs], b)
        rows: list[Optional[RowSampling]] = [None] * b
        for i, r in enumerate(reqs):
            p = r.num_computed
            pos[i, 0] = p
            slots[i, 0] = slots_for(table[i], p, ps)
            kv_lens[i] = p + 1
            rows[i] = RowSampling(r.params, r.seed, p + 1, r.slot, is_output=True, banned=r.banned_ids())
        attn = AttentionMetadata(pos, slots, table, kv_lens)
        md = self._sampling(rows, b, reqs)
        tokens = gather_last_tokens(reqs, b)
        out, self.kv_cache, state = step.decode_step(
            self.params, self.kv_cache, self._state_arg(md), tokens, attn, md, cfg=self.cfg
        )
        self._keep_state(md, state)
        return out


def gather_last_tokens(reqs: Sequence[Request], batch: int):
    """Each request's last drawn token as a [batch] int32 array, without a host round trip.

    Tokens already on the host are packed with numpy; tokens still on device
    (`TokenRef`) are gathered from the step outputs that produced them.
    """
    refs = [r.last_token for r in reqs]
    if not any(isinstance(t, TokenRef) for t in refs):
        out = np.zeros((batch,), np.int32)
        out[: len(refs)] = refs
        return out
    arrays: list = []
    index: dict = {}
    idx = np.zeros((batch,), np.int32)
    host = np.zeros((batch,), np.int32)
    offset = 0
    for i, t in enumerate(refs):
        if isinstance(t, TokenRef):
            key = id(t.array)
            if key not in index:
                index[key] = offset
                arrays.append(t.array)
                offset += t.array.shape[0]
            idx[i] = index[key] + t.row
        else:
            host[i] = t
    if len(arrays) == 1 and all(isinstance(t, TokenRef) for t in refs):
        src = arrays[0]
        if src.shape[0] == batch and np.array_equal(idx[: len(refs)], np.arange(len(refs))):
            return src  # steady state: the previous decode step's output, row for row
    # host tokens go at the end of the pool, addressed by their own index
    pool = jnp.concatenate(arrays + [jnp.asarray(host)])
    for i, t in enumerate(refs):
        if not isinstance(t, TokenRef):
            idx[i] = offset + i
    return pool[jnp.asarray(idx)]


def read_output(out: SamplerOutput, reqs: Sequence[Request], rows: Optional[Sequence[int]] = None) -> list:
    """Bring a step's results to the host: [(token, Logprob or None)] per request.

    ``rows`` gives each request's row in the step (default: row i for request i).
    """
    rows = list(range(len(reqs))) if rows is None else list(rows)
    tokens = np.asarray(out.tokens)
    lps = None
    if out.logprob is not None:
        lps = (np.asarray(out.logprob), np.asarray(out.top_ids), np.asarray(out.top_logprobs))
    res = []
    for i, r in zip(rows, reqs):
        lp = None
        if lps is not None and r.params.logprobs is not None:
            n = r.params.logprobs
            top = {int(k): float(v) for k, v in zip(lps[1][i, :n], lps[2][i, :n])}
            lp = Logprob(int(tokens[i]), float(lps[0][i]), top)
        res.append((int(tokens[i]), lp))
    return res
