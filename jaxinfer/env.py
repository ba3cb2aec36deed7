"""What the package reads from the process environment in more than one place: on/off switches
(``JAXINFER_CPU_KERNELS``, ``JAXINFER_COMPILATION_CACHE``, ``JAXINFER_MODEL_CACHE``) and the cache root.
Standard library only, so any layer may import it."""

from __future__ import annotations

import os

OFF = frozenset({"0", "false", "no", "off"})


def switched_off(value) -> bool:
    """Whether an environment value turns its switch off ("0", "false", "no", "off", in any case)."""
    return (value or "").strip().lower() in OFF


def is_on(name: str) -> bool:
    """A switch that is on unless the variable ``name`` turns it off."""
    return not switched_off(os.environ.get(name))


def cache_root() -> str:
    """``$XDG_CACHE_HOME/jaxinfer`` (``~/.cache/jaxinfer``): kernels, programs and converted models live below."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer")
