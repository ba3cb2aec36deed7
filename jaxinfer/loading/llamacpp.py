"""llama.cpp's conventions that a GGUF file's tensors carry: the rotary row order of Q and K, and
Llama-3 RoPE scaling stored as per-frequency divisors (``rope_freqs``).

Shared by the GGUF reader (`jaxinfer.loading.gguf_models`, which undoes them) and the tests that
write GGUF files (which apply them); imports nothing of jaxinfer but the config.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config import RopeScaling

__all__ = ["llama3_rope_divisors", "permute_rotary", "unpermute_rotary"]


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face → llama.cpp row order of a Q or K projection (``[n_head * head_dim, ...]``).

    HF rotates pairs ``(j, j + head_dim/2)`` within a head ("rotate_half");
    llama.cpp rotates adjacent pairs ``(2j, 2j + 1)``. Its converter therefore
    interleaves each head's two halves: new row ``2j + c`` = old row
    ``c * head_dim/2 + j``. For K, ``n_head`` is the number of KV heads.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp → Hugging Face row order; the inverse of `permute_rotary`."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)



def llama3_rope_divisors(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """Per-frequency divisors ``[head_dim/2]`` of Llama-3 rope scaling (llama.cpp's rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = 1.0 / ((1.0 - smooth) / s.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, s.factor, mid))
