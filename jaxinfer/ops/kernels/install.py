"""The CPU kernels built when jaxinfer is installed, and how a process finds them.

``pip install`` runs `build_installed` (setup.py's build hook), so a user's first
run loads a library in milliseconds instead of compiling C++ for a minute. The
builds land beside the sources, in ``installed/``, with a manifest that says, for
each library: the source it was built from (its SHA-256), the jaxlib whose FFI
headers it was compiled against, and the CPU it runs on. `find` takes a library
only when all three still hold; otherwise (a source edited in an editable install,
another jaxlib, another CPU, an install whose compiler failed) the package's
runtime build (`jaxinfer.ops.kernels.build`, cached per machine) is the fallback.

Targets (``$JAXINFER_KERNEL_TARGETS`` at install time, comma-separated; default
``native``):

* ``native``: ``-march=native``, the build the runtime would make on this machine
  (the same flags); it runs only on a CPU with this one's feature flags.
* ``x86-64-v3`` / ``x86-64-v4``: the portable x86 levels (AVX2 + FMA + F16C; plus
  AVX-512 F/BW/CD/DQ/VL), for a wheel built on one machine and installed on others:
  a process takes the highest level its CPU has.
* ``none`` (or empty): build nothing at install time.

Standard library only: setup.py loads this file by path, before jaxinfer's own
dependencies are importable.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import platform
import shutil
import subprocess
from typing import Callable, Iterable, Optional, Sequence

TARGETS_ENV = "JAXINFER_KERNEL_TARGETS"  # install time: which builds to make
INSTALL_DIR = "installed"  # beside the sources, in the package
MANIFEST = "manifest.json"
SOURCES = ("paged_attention_cpu.cc", "matmul_cpu.cc")  # the package's kernels, shortest build first

# How a default build is optimised: for the CPU it runs on. A target replaces ``-march=native``.
MACHINE_FLAGS = ("-O3", "-march=native", "-fopenmp-simd")
# Warnings on (the sources build clean with GCC). JAX's FFI headers are included as system headers,
# so their own warnings (unused parameters, sign comparisons) are not reported as ours.
# -Wno-psabi: GCC notes that a function returning a 64-byte vector would pass it differently with
# AVX-512; the kernels' vector helpers are inline in one translation unit, so no ABI boundary is crossed.
WARNING_FLAGS = ("-Wall", "-Wextra", "-Wno-psabi")
FIXED_FLAGS = ("-std=c++17", "-shared", "-fPIC", *WARNING_FLAGS)

# The portable x86 levels: the CPU flags (as /proc/cpuinfo spells them) each one needs, lowest first.
_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
LEVELS = {
    "x86-64-v3": _V3,
    "x86-64-v4": (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}


def cpu_signature(flags: Iterable[str]) -> str:
    """What ``-march=native`` depends on: the CPU's architecture and its feature flags."""
    return " ".join([platform.machine(), platform.processor(), *sorted(flags)])


def machine_flags(target: str) -> tuple:
    """The optimisation flags of a target: `MACHINE_FLAGS`, with ``-march=`` the level for a portable one."""
    if target == "native":
        return MACHINE_FLAGS
    if target not in LEVELS:
        raise ValueError(f"unknown kernel target {target!r}: native, {', '.join(LEVELS)} or none")
    return tuple(f"-march={target}" if f == "-march=native" else f for f in MACHINE_FLAGS)


def compile_command(cxx: str, include_dir: str, source_path: str, out: str,
                    flags: Sequence[str] = MACHINE_FLAGS) -> list:
    """The compiler's arguments that build one kernel source into the shared library ``out``."""
    return [cxx, *flags, *FIXED_FLAGS, "-isystem", include_dir, source_path, "-o", out]


def find_compiler() -> Optional[str]:
    """The C++ compiler a build uses (``$CXX``, else g++, c++ or clang++ on the PATH), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def source_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def requested_targets(value: Optional[str] = None) -> list:
    """The install-time targets ``$JAXINFER_KERNEL_TARGETS`` names (default: native); portable levels
    only on x86-64."""
    value = os.environ.get(TARGETS_ENV, "native") if value is None else value
    names = [t.strip() for t in value.split(",") if t.strip() and t.strip() != "none"]
    for t in names:
        machine_flags(t)  # an unknown name is an error here, with the list
    if platform.machine() not in ("x86_64", "AMD64"):
        names = [t for t in names if t == "native"]
    return names


def build_installed(source_dir: str, dest_dir: str, include_dir: str, jaxlib_version: str,
                    cpu_flags: Iterable[str], targets: Sequence[str],
                    say: Callable[[str], None] = print) -> dict:
    """Compile every source in `SOURCES` for every target into ``dest_dir`` (all at once: a compiler
    process each) and write the manifest; returns it. A build that fails is left out of the manifest
    (its message goes to ``say``); the runtime builds that one on first use."""
    cxx = find_compiler()
    if cxx is None:
        say("jaxinfer: no C++ compiler (set $CXX, or install g++): the CPU kernels will be built on first use")
        return {}
    os.makedirs(dest_dir, exist_ok=True)
    signature = cpu_signature(cpu_flags)
    jobs = []
    for target in targets:
        for source in SOURCES:
            src = os.path.join(source_dir, source)
            out = os.path.join(dest_dir, f"{os.path.splitext(source)[0]}-{target}.so")
            jobs.append((source, target, src, out, compile_command(cxx, include_dir, src, out, machine_flags(target))))

    def run(job):
        return job, subprocess.run(job[-1], capture_output=True, text=True)

    entries = []
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for (source, target, src, out, cmd), proc in pool.map(run, jobs):
            if proc.returncode != 0:
                say(f"jaxinfer: building {source} for {target} failed (it will be built on first use):\n"
                    f"{proc.stderr.strip()[-1500:]}")
                continue
            entries.append({"source": source, "target": target, "file": os.path.basename(out),
                            "source_sha256": source_digest(src), "jaxlib": jaxlib_version,
                            "cpu_signature": signature if target == "native" else None,
                            "requires": list(LEVELS.get(target, ())), "command": cmd})
            say(f"jaxinfer: built {source} for {target}")
    manifest = {"libraries": entries}
    with open(os.path.join(dest_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def find(dest_dir: str, source_path: str, jaxlib_version: str, cpu_flags: Iterable[str]) -> Optional[str]:
    """The installed library of ``source_path`` this process can load, or None: built from this very
    source against this jaxlib, for this CPU (the native build when the CPU's flags are the ones it was
    built on, else the highest portable level the CPU has)."""
    try:
        with open(os.path.join(dest_dir, MANIFEST)) as f:
            entries = json.load(f)["libraries"]
        digest = source_digest(source_path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    flags = frozenset(cpu_flags)
    signature = cpu_signature(flags)
    name = os.path.basename(source_path)
    best, rank = None, -1
    order = ["native", *reversed(LEVELS)]  # preference: native, then the highest level first
    for e in entries:
        if not isinstance(e, dict) or e.get("source") != name or e.get("source_sha256") != digest:
            continue
        if e.get("jaxlib") != jaxlib_version or e.get("target") not in order:
            continue
        if e["target"] == "native" and e.get("cpu_signature") != signature:
            continue
        if not set(e.get("requires") or ()) <= flags:
            continue
        r = len(order) - order.index(e["target"])
        path = os.path.join(dest_dir, str(e.get("file")))
        if r > rank and os.path.exists(path):
            best, rank = path, r
    return best
