"""Compilation caching and counting.

* `enable_compilation_cache`: jaxinfer's program cache (`jaxinfer.engine.programs`)
  keeps every compiled step program on disk under `cache_root`, so a second
  start loads executables instead of tracing and compiling them. It replaces
  JAX's persistent compilation cache for the step programs, and jaxinfer no
  longer turns that one on: an executable JAX loaded from its own cache
  serializes without its object code on the CPU (jax 0.10.2: "Function ... not
  found" when the reloaded copy runs), so with JAX's cache configured by the
  user (``JAX_COMPILATION_CACHE_DIR``) programs are compiled through it and not
  saved again.
* `compile_count`: how many programs this process has lowered for XLA, from
  JAX's monitoring events, so tests and benchmarks can assert that nothing
  compiles after warm-up: step programs and stray eager ops alike.

``JAXINFER_COMPILATION_CACHE=0`` turns the program cache off.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

from jaxinfer.env import cache_root, is_on

# Every new program is lowered to MLIR once, whether XLA then compiles it or finds it in a
# persistent cache; a step program loaded from the program cache is not lowered at all.
_COMPILE_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_count = 0
_count_lock = threading.Lock()
_listening = False


def caching_enabled() -> bool:
    return is_on("JAXINFER_COMPILATION_CACHE")


def jax_cache_active() -> bool:
    """Whether JAX's own persistent compilation cache is configured in this process."""
    import jax

    return bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache)


def enable_compilation_cache() -> Optional[str]:
    """Start counting compiles; returns the program cache's directory (None when it is off)."""
    start_counting()
    return os.path.join(cache_root(), "programs") if caching_enabled() else None


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
