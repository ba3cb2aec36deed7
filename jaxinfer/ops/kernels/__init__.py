"""Native kernels for XLA's CPU backend, built when jaxinfer is installed.

Each kernel is a C++ XLA FFI handler in this package, registered with JAX as a
custom-call target for the ``cpu`` platform. ``pip install`` compiles them with
the system C++ compiler (``$CXX``, else ``g++`` or ``c++``) for this CPU
(``-march=native``) into the package (`jaxinfer.ops.kernels.install`), so a first
run only loads them. When there is no such build for this source, jaxlib and CPU
(an install that could not compile, an edited source, ``$JAXINFER_INSTALLED_KERNELS=0``),
the first use compiles it instead, once per machine, cached in
``$XDG_CACHE_HOME/jaxinfer/kernels``.

Nothing depends on them: with no compiler, a failed build, or
``JAXINFER_CPU_KERNELS=0``, `load` returns None (after one warning for a
failed build) and callers take their pure-JAX path, which gives the same
results. Whether a program uses them is decided once, after they load, by
`jaxinfer.ops.backend.prepare` (a `KernelChoice`): device code never reads
this module's registry while it is traced.

Every build, the default one and the variants tests and benchmarks build with
other SIMD flags (`load_variant`), goes through `build`, with warnings on
(`WARNING_FLAGS`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
import warnings
from typing import Optional, Sequence

from jaxinfer import progress
from jaxinfer.env import CPU_AMX, CPU_VNNI, INSTALLED_KERNELS, cache_root, cpu_flags, is_on
from jaxinfer.ops.kernels import install

_HERE = os.path.dirname(os.path.abspath(__file__))

# The sources in this package, and what each registers: {FFI target name: exported symbol}.
MATMUL = "matmul_cpu.cc"  # `jaxinfer.ops.cpu_matmul`
PAGED_ATTENTION = "paged_attention_cpu.cc"  # `jaxinfer.ops.attention`
TARGETS = {
    MATMUL: {"jaxinfer_matmul_float": "JaxinferMatmulFloat", "jaxinfer_matmul_q": "JaxinferMatmulQ"},
    PAGED_ATTENTION: {"jaxinfer_paged_attention": "JaxinferPagedAttention",
                      "jaxinfer_latent_attention": "JaxinferLatentAttention"},
}
_TITLES = {MATMUL: "matmul", PAGED_ATTENTION: "attention"}

# The build's flags (`install.MACHINE_FLAGS`: for this CPU; `build` takes other machine flags for variants,
# e.g. ``-mno-avx512f`` for the AVX2 path) and the compile command: one definition, shared with the
# install-time build (`jaxinfer.ops.kernels.install`).
MACHINE_FLAGS = install.MACHINE_FLAGS
WARNING_FLAGS = install.WARNING_FLAGS
_lock = threading.Lock()
_loaded: dict = {}  # source name -> ctypes library, or None when unavailable
_building: dict = {}  # source name -> the thread building it in the background
_variants: dict = {}  # (source, machine flags) -> (library, {target name: this build's target name})


def enabled() -> bool:
    return is_on("JAXINFER_CPU_KERNELS")


def compiler() -> Optional[str]:
    """The C++ compiler a build uses (``$CXX``, else g++, c++ or clang++ on the PATH), or None."""
    return install.find_compiler()


def cpu_signature() -> str:
    """What -march=native depends on: the CPU's architecture and feature flags."""
    return install.cpu_signature(cpu_flags())


def cache_dir() -> str:
    return os.path.join(cache_root(), "kernels")


def compile_command(source: str, out: str, flags: Optional[Sequence[str]] = None) -> list:
    """The compiler's arguments that build ``source`` (a file in this package) into ``out``, with
    ``flags`` in place of `MACHINE_FLAGS`. Raises RuntimeError when there is no compiler."""
    import jax

    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    machine = MACHINE_FLAGS if flags is None else tuple(flags)
    return install.compile_command(cxx, jax.ffi.include_dir(), os.path.join(_HERE, source), out, machine)


def _output_path(source: str, flags: Optional[Sequence[str]] = None) -> tuple[list, str, str]:
    """(the compile command less its output, the build's key, the cached library's path)."""
    import jaxlib

    cmd = compile_command(source, "", flags)[:-2]
    with open(cmd[-1], "rb") as f:
        text = f.read()
    key = hashlib.sha256(b"\0".join([text, " ".join(cmd[:-1]).encode(), jaxlib.__version__.encode(),
                                     cpu_signature().encode()])).hexdigest()[:16]
    return cmd, key, os.path.join(cache_dir(), f"{os.path.splitext(source)[0]}-{key}.so")


def installed(source: str) -> Optional[str]:
    """The library of ``source`` built at install time that this process can load (this source, this
    jaxlib, this CPU: `install.find`), or None (none fits, or ``$JAXINFER_INSTALLED_KERNELS`` is 0)."""
    if not is_on(INSTALLED_KERNELS):
        return None
    import jaxlib

    return install.find(os.path.join(_HERE, install.INSTALL_DIR), os.path.join(_HERE, source),
                        jaxlib.__version__, cpu_flags())


def is_built(source: str) -> bool:
    """Whether ``source`` is already built for this machine, at install time or since (loading it takes
    milliseconds)."""
    try:
        return installed(source) is not None or os.path.exists(_output_path(source)[2])
    except (OSError, RuntimeError):
        return False


def ready(source: str) -> bool:
    """Whether ``source`` is loaded and registered (never builds)."""
    return _loaded.get(source) is not None


def tried(source: str) -> bool:
    """Whether loading ``source`` was attempted in this process (successfully or not)."""
    return source in _loaded


def library(source: str) -> Optional[ctypes.CDLL]:
    """The loaded library of ``source`` (its default build), or None when it is not loaded."""
    return _loaded.get(source)


def matmul_isa(lib: ctypes.CDLL) -> str:
    """The SIMD path a build of `MATMUL` runs: "avx512", "avx2" or "scalar", and on AVX-512 the dot
    instructions its products use, each as "+feature": "+amx" (bfloat16 weights' products on the AMX
    tiles: built for a CPU with AMX-BF16, the OS grants the tile state, and ``$JAXINFER_CPU_AMX`` is not
    0), "+vnni" (int8 / int4 weights' products by VNNI: built for a CPU with AVX512-VNNI, and
    ``$JAXINFER_CPU_VNNI`` is not 0). E.g. "avx512+amx+vnni"."""
    fn = lib.JaxinferMatmulIsa
    fn.restype = ctypes.c_char_p
    isa = fn().decode()
    if isa != "avx512":
        return isa
    features = []
    if is_on(CPU_AMX) and lib.JaxinferMatmulAmx():
        features.append("amx")
    if is_on(CPU_VNNI) and hasattr(lib, "JaxinferMatmulVnni") and lib.JaxinferMatmulVnni():
        features.append("vnni")
    return "+".join([isa, *features])


def build(source: str, flags: Optional[Sequence[str]] = None) -> str:
    """The shared library of ``source`` (a file in this package): the one built at install time when it
    fits (`installed`), else compiled once per machine; returns its path.

    ``flags``: compiler flags in place of `MACHINE_FLAGS` (another SIMD path, for tests and
    benchmarks); each set of flags is a cached library of its own. Raises RuntimeError with the
    compiler's message when it cannot be built.
    """
    if flags is None:
        ready_made = installed(source)
        if ready_made is not None:
            return ready_made
    cmd, _, out = _output_path(source, flags)
    out_dir = os.path.dirname(out)
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(out):
        return out
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            what = source if flags is None else f"{source} with {' '.join(flags)}"
            raise RuntimeError(f"{cmd[0]} failed to build {what}:\n{proc.stderr.strip()[-2000:]}")
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


def _register(lib: ctypes.CDLL, targets: dict) -> None:
    import jax

    for name, symbol in targets.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def load(source: str, targets: Optional[dict] = None) -> Optional[ctypes.CDLL]:
    """Build (once) and load ``source``, registering ``targets`` ({FFI target name: symbol}; by
    default the source's `TARGETS`).

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
                lib = ctypes.CDLL(build(source))
                _register(lib, TARGETS[source] if targets is None else targets)
            except (OSError, RuntimeError, AttributeError) as e:
                warnings.warn(f"jaxinfer: native CPU kernel {source} unavailable, using the pure-JAX path: {e}")
                lib = None
        _loaded[source] = lib
        return lib


def prepare(source: str) -> bool:
    """`load` ``source`` with a progress line ("building the CPU matmul kernel (once per machine)", or
    "loading ..." when it is built), at most once per process; never inside a trace. Returns whether
    it is loaded."""
    if not enabled():
        return False
    if not tried(source):
        what = _TITLES.get(source, source)
        title = f"loading the CPU {what} kernel" if is_built(source) else (
            f"building the CPU {what} kernel (once per machine)")
        with progress.stage(title):
            load(source)
    return ready(source)


def load_variant(source: str, flags: Sequence[str]) -> tuple[ctypes.CDLL, dict]:
    """Build ``source`` with ``flags`` in place of `MACHINE_FLAGS` (e.g. ``-mno-avx512f`` for the
    AVX2 path), load it and register its handlers under target names of their own; returns (the
    library, {target name in `TARGETS`: this build's target name}). For tests and benchmarks; cached
    on disk like the default build. Raises RuntimeError when it cannot be built."""
    flags = tuple(flags)
    with _lock:
        got = _variants.get((source, flags))
        if got is None:
            key = _output_path(source, flags)[1]
            lib = ctypes.CDLL(build(source, flags))
            renamed = {name: f"{name}_{key}" for name in TARGETS[source]}
            _register(lib, {renamed[name]: symbol for name, symbol in TARGETS[source].items()})
            got = _variants[(source, flags)] = (lib, renamed)
        return got
