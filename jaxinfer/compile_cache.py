"""Compilation caches and counting.

* JAX's persistent compilation cache, on by default: a second start loads
  XLA executables from disk (``$XDG_CACHE_HOME/jaxinfer/xla``).
* The root of jaxinfer's own caches (`cache_root`), where the program table
  (`jaxinfer.programs`) keeps its serialized step programs.
* `compile_count`: how many programs this process has lowered for XLA, from JAX's
  monitoring events, so tests and benchmarks can assert that nothing compiles
  after warm-up — step programs and stray eager ops alike.

``JAXINFER_COMPILATION_CACHE=0`` turns both caches off.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

# Every new program is lowered to MLIR once, whether XLA then compiles it or finds it in the
# persistent cache; a step program loaded from the program cache is not lowered at all.
_COMPILE_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_count = 0
_count_lock = threading.Lock()
_listening = False


def caching_enabled() -> bool:
    return os.environ.get("JAXINFER_COMPILATION_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_root() -> str:
    """``$XDG_CACHE_HOME/jaxinfer`` (``~/.cache/jaxinfer``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer")


def enable_compilation_cache() -> Optional[str]:
    """Turn on JAX's persistent compilation cache so later runs skip XLA compiles.

    The cache lives in ``$XDG_CACHE_HOME/jaxinfer/xla`` (``~/.cache/jaxinfer/xla``);
    ``JAXINFER_COMPILATION_CACHE=0`` disables it, and a directory already set
    through JAX (``JAX_COMPILATION_CACHE_DIR``) is kept. Returns the directory.
    """
    start_counting()
    if not caching_enabled():
        return None
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = os.path.join(cache_root(), "xla")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # a read-only home is no reason to fail; compile as usual
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _on_event(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _COMPILE_EVENT:
        with _count_lock:
            _count += 1


def start_counting() -> None:
    """Listen to JAX's compile events (idempotent; called by `enable_compilation_cache`)."""
    global _listening
    with _count_lock:
        if _listening:
            return
        _listening = True
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """Programs lowered (traced and compiled, or found in JAX's persistent cache) in this process
    since counting started; loading a step program from the program cache counts as none."""
    start_counting()
    return _count
