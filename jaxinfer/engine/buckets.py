"""The one place that pads shapes to buckets.

Every step is padded to the smallest bucket that fits, so XLA compiles a bounded set of
programs known in advance (`jaxinfer.engine.programs.ProgramTable.keys`): its token count to a
token bucket, its request count to a request bucket that token bucket takes.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from jaxinfer.config import EngineConfig


def bucket_for(n: int, buckets: Sequence[int], what: str = "size") -> int:
    """Smallest bucket >= n; ValueError naming the limit when n exceeds the largest."""
    if n < 0:
        raise ValueError(f"{what} must be non-negative, got {n}")
    i = bisect.bisect_left(buckets, max(n, 1))
    if i == len(buckets):
        raise ValueError(f"{what} {n} exceeds the largest bucket ({buckets[-1]})")
    return buckets[i]


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def batch_buckets(ecfg: EngineConfig) -> list[int]:
    """The request-count buckets up to the one that holds ``max_num_seqs`` requests."""
    top = bucket_for(min(ecfg.max_num_seqs, ecfg.batch_buckets[-1]), ecfg.batch_buckets)
    return [b for b in ecfg.batch_buckets if b <= top]


def token_buckets(ecfg: EngineConfig) -> tuple[int, ...]:
    """A step's token counts: the batch buckets (a decode step is a token a request), then the chunk
    buckets, up to the one ``max_num_batched_tokens`` fits in."""
    every = sorted(set(batch_buckets(ecfg)) | set(ecfg.chunk_buckets))
    top = bucket_for(min(ecfg.max_num_batched_tokens, every[-1]), every)
    return tuple(t for t in every if t <= top)


def token_budget(ecfg: EngineConfig) -> int:
    """The most tokens one step computes: ``max_num_batched_tokens`` (at most the largest token
    bucket), and at least a token for each of ``max_num_seqs`` running requests."""
    top = token_buckets(ecfg)[-1]
    return min(max(ecfg.max_num_batched_tokens, ecfg.max_num_seqs), top)


def request_buckets(ecfg: EngineConfig, tokens: int) -> list[int]:
    """The request counts a step of ``tokens`` padded tokens pads to: each batch bucket up to ``tokens``
    while ``tokens`` is within the batch buckets (decode steps and small mixes: the padding follows
    the requests); past them a small bucket (a lone prompt's chunk) and the largest."""
    batches = batch_buckets(ecfg)
    if tokens <= batches[-1]:  # up to the bucket that holds a request for each token
        return [b for b in batches if b < tokens] + [bucket_for(tokens, batches)]
    return sorted({batches[min(2, len(batches) - 1)], batches[-1]})


def logits_buckets(ecfg: EngineConfig, requests: int, tokens: int) -> list[int]:
    """The logits-row counts of a step of ``requests`` and ``tokens`` (padded): one row a request; with
    speculative decoding (``num_speculative_tokens`` k) also the most a step of them can need, each
    request verifying 1 + k tokens, at most one row a token (the verify programs)."""
    k = ecfg.num_speculative_tokens
    verify = min(tokens, requests * (1 + k))
    return [requests, verify] if verify > requests else [requests]
