"""JAX's persistent compilation cache, on by default: a second start loads programs from disk."""

from __future__ import annotations

import os
from typing import Optional


def enable_compilation_cache() -> Optional[str]:
    """Turn on JAX's persistent compilation cache so later runs skip XLA compiles.

    The cache lives in ``$XDG_CACHE_HOME/jaxinfer/xla`` (``~/.cache/jaxinfer/xla``);
    ``JAXINFER_COMPILATION_CACHE=0`` disables it, and a directory already set
    through JAX (``JAX_COMPILATION_CACHE_DIR``) is kept. Returns the directory.
    """
    if os.environ.get("JAXINFER_COMPILATION_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "jaxinfer", "xla")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # a read-only home is no reason to fail; compile as usual
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
