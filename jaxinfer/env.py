"""What the package reads from the process environment and the host in more than one place: on/off
switches (``JAXINFER_CPU_KERNELS``, ``JAXINFER_COMPILATION_CACHE``, ``JAXINFER_MODEL_CACHE``,
``JAXINFER_BATCH_INVARIANT``, ``JAXINFER_GPU_KERNELS``), the cache root and the CPU's feature flags. Standard library only, so any
layer may import it."""

from __future__ import annotations

import os

OFF = frozenset({"0", "false", "no", "off"})
ON = frozenset({"1", "true", "yes", "on"})
CPU_AMX = "JAXINFER_CPU_AMX"  # bfloat16 products on AMX tiles where the CPU has them (x rounded to bfloat16); on unless 0
# int8 / int4 products by VNNI where the CPU has AVX512-VNNI (x quantized to int8 per block of 32); on unless 0
CPU_VNNI = "JAXINFER_CPU_VNNI"
# the CPU kernels built at install time (`jaxinfer.ops.kernels.install`); on unless 0 (then built on first use)
INSTALLED_KERNELS = "JAXINFER_INSTALLED_KERNELS"
BATCH_INVARIANT = "JAXINFER_BATCH_INVARIANT"  # batch-invariant mode (`jaxinfer.ops.invariant`); off unless set
# the Pallas GPU (Triton) kernels on NVIDIA (`jaxinfer.ops.attention_pallas_gpu`); on unless 0 (then pure JAX)
GPU_KERNELS = "JAXINFER_GPU_KERNELS"


def switched_off(value) -> bool:
    """Whether an environment value turns its switch off ("0", "false", "no", "off", in any case)."""
    return (value or "").strip().lower() in OFF


def is_on(name: str) -> bool:
    """A switch that is on unless the variable ``name`` turns it off."""
    return not switched_off(os.environ.get(name))


def is_set(name: str) -> bool:
    """A switch that is off unless the variable ``name`` turns it on ("1", "true", "yes", "on", in any case)."""
    return (os.environ.get(name) or "").strip().lower() in ON


def cache_root() -> str:
    """``$XDG_CACHE_HOME/jaxinfer`` (``~/.cache/jaxinfer``): kernels, programs and converted models live below."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer")


def cpu_flags() -> frozenset:
    """The host CPU's feature flags (x86 "flags" / Arm "Features" in /proc/cpuinfo); empty if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
