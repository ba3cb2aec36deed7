"""argparse value types shared by every CLI subcommand: numbers with their limits in the message."""

from __future__ import annotations

import argparse
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
