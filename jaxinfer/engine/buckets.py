"""The one place that pads shapes to buckets.

Every device call is padded to the smallest bucket that fits, so XLA compiles
a bounded set of programs known in advance (`all_shapes`).
"""

from __future__ import annotations

import bisect
from typing import Sequence


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
