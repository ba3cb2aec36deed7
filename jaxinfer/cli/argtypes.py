"""argparse value types shared by every CLI subcommand: numbers with their limits in the message."""

from __future__ import annotations

import argparse
import re
from typing import Callable, Optional


def int_in(lo: Optional[int] = None, hi: Optional[int] = None) -> Callable[[str], int]:
    """An integer type; out-of-range values name the range."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer value: {s!r}") from None
        if lo is not None and hi is not None and not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {v}")
        return v

    return parse


def number(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {s!r}") from None


def non_negative_number(s: str) -> float:
    v = number(s)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {s}")
    return v


# The engine's --dtype choices (generate, bench, serve).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = ("weights' dtype (default: the preset's, auto: bfloat16 on GPU/TPU and where the native CPU kernel "
              "runs, else float32; the load line says why; float32 is bit-faithful to transformers)")

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
_ESCAPE = re.compile(r"\\([ntr\\])")


def unescape(s: str) -> str:
    r"""``\n``, ``\t``, ``\r`` and ``\\`` as the characters they name, as a shell user types them.

    Any other backslash stays as it is (``\x`` is two characters), so text
    without these escapes passes through unchanged.
    """
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(1)], s)
