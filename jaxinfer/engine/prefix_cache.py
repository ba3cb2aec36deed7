"""Names for full KV pages: a hash chain over their tokens.

Page i of a sequence is named ``H(name of page i-1, its page_size tokens, extra)``,
so two sequences share a page name only if they share every token up to the end
of that page. ``extra`` carries anything else that changes a page's contents
(for example an adapter id); it is empty for plain text.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

ROOT = b"jaxinfer-prefix-v1"


def page_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def extend_hashes(hashes: list, tokens: Sequence[int], page_size: int, extra: bytes = b"") -> list:
    """Append names for the full pages of `tokens` that `hashes` does not name yet (in place)."""
    n_full = len(tokens) // page_size
    parent = hashes[-1] if hashes else ROOT
    for i in range(len(hashes), n_full):
        parent = page_hash(parent, tokens[i * page_size : (i + 1) * page_size], extra)
        hashes.append(parent)
    return hashes
