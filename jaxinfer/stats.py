"""Summary statistics of measured values (latencies, throughputs), shared by every report.

One place computes them, with numpy: the server's per-request timings, ``jaxinfer
bench``, the soak and the peer benchmarks under ``benchmarks/`` all print the same
percentiles the same way (linear interpolation between ranks, numpy's default).
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np


def _values(values: Iterable[Optional[float]]) -> np.ndarray:
    return np.asarray([float(v) for v in values if v is not None], dtype=np.float64)


def percentile(values: Iterable[Optional[float]], q: float) -> Optional[float]:
    """The q-th percentile (q in [0, 100]) of the values that are not None; None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}.")
    xs = _values(values)
    return float(np.percentile(xs, q)) if xs.size else None


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    return percentile(values, 50)


def describe(values: Iterable[Optional[float]], scale: float = 1.0) -> dict:
    """mean, median, p90, p99, std, min, max and count of the values (each times `scale`).

    Every figure is None (count 0) when there are no values.
    """
    xs = _values(values) * scale
    if not xs.size:
        return {"mean": None, "median": None, "p90": None, "p99": None, "std": None, "min": None, "max": None,
                "count": 0}
    p50, p90, p99 = np.percentile(xs, [50, 90, 99])
    return {
        "mean": float(xs.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "std": float(xs.std()),
        "min": float(xs.min()),
        "max": float(xs.max()),
        "count": int(xs.size),
    }
