"""Native kernels for XLA's CPU backend, built from source on first use.

Each kernel is a C++ XLA FFI handler in this package. It is compiled once per
machine with the system C++ compiler (``$CXX``, else ``g++`` or ``c++``) for
this CPU (``-march=native``), cached in ``$XDG_CACHE_HOME/jaxinfer/kernels``,
and registered with JAX as a custom-call target for the ``cpu`` platform.

Nothing depends on them: with no compiler, a failed build, or
``JAXINFER_CPU_KERNELS=0``, `load` returns None (after one warning for a
failed build) and callers take their pure-JAX path, which gives the same
results.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from typing import Optional

from jaxinfer.env import cache_root, is_on

_HERE = os.path.dirname(os.path.abspath(__file__))
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w"]
_lock = threading.Lock()
_loaded: dict = {}  # source name -> ctypes library, or None when unavailable
_building: dict = {}  # source name -> the thread building it in the background


def enabled() -> bool:
    return is_on("JAXINFER_CPU_KERNELS")


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's architecture and feature flags."""
    import platform

    from jaxinfer.config import cpu_flags

    return " ".join([platform.machine(), platform.processor(), *sorted(cpu_flags())])


def cache_dir() -> str:
    return os.path.join(cache_root(), "kernels")


def _output_path(source: str) -> tuple[str, str, str]:
    """(compiler, source path, the cached library's path) for ``source``."""
    import jaxlib

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    src_path = os.path.join(_HERE, source)
    with open(src_path, "rb") as f:
        text = f.read()
    key = hashlib.sha256(
        b"\0".join([text, " ".join(_FLAGS).encode(), cxx.encode(), jaxlib.__version__.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    return cxx, src_path, os.path.join(cache_dir(), f"{os.path.splitext(source)[0]}-{key}.so")


def is_built(source: str) -> bool:
    """Whether ``source`` is already built for this machine (loading it takes milliseconds)."""
    try:
        return os.path.exists(_output_path(source)[2])
    except (OSError, RuntimeError):
        return False


def ready(source: str) -> bool:
    """Whether ``source`` is loaded and registered (never builds: safe inside a trace)."""
    return _loaded.get(source) is not None


def tried(source: str) -> bool:
    """Whether loading ``source`` was attempted in this process (successfully or not)."""
    return source in _loaded


def build(source: str) -> str:
    """Compile ``source`` (a file in this package) to a shared library; returns its path.

    Raises RuntimeError with the compiler's message when it cannot be built.
    """
    import jax

    cxx, src_path, out = _output_path(source)
    include = jax.ffi.include_dir()
    out_dir = os.path.dirname(out)
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(out):
        return out
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *_FLAGS, f"-I{include}", src_path, "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build {source}:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders each land a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build_in_background(source: str) -> None:
    """Start building ``source`` on a thread (the compiler runs as a subprocess), so the
    build overlaps other start-up work; `load` waits for it. Does nothing when the library
    is already built, loaded, or native kernels are off."""
    with _lock:
        if not enabled() or source in _loaded or source in _building or is_built(source):
            return

        def run():
            try:
                build(source)
            except (OSError, RuntimeError):
                pass  # `load` builds again in the foreground and reports the failure once

        t = threading.Thread(target=run, name=f"jaxinfer-build-{source}", daemon=True)
        _building[source] = t
        t.start()


def load(source: str, targets: dict) -> Optional[ctypes.CDLL]:
    """Build (once) and load ``source``, registering ``targets`` ({ffi target name: symbol}).

    Returns the library, or None when native kernels are disabled or cannot be built.
    """
    pending = _building.pop(source, None)
    if pending is not None:
        pending.join()
    with _lock:
        if source in _loaded:
            return _loaded[source]
        lib = None
        if enabled():
            try:
                import jax

                lib = ctypes.CDLL(build(source))
                for name, symbol in targets.items():
                    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            except (OSError, RuntimeError, AttributeError) as e:
                warnings.warn(f"jaxinfer: native CPU kernel {source} unavailable, using the pure-JAX path: {e}")
                lib = None
        _loaded[source] = lib
        return lib
