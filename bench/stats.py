"""Small statistics helpers (no numpy needed)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linear interpolation between order statistics."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def summary(values: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "mean": statistics.fmean(values) if values else math.nan,
        "max": max(values) if values else math.nan,
    }


def window_rate(timestamps: Sequence[float], lo: float = 0.05, hi: float = 0.95) -> float:
    """Events per second in the steady part of a burst: the events between the ``lo`` and
    ``hi`` quantiles of their times, over that window (ramp-up and the tail of stragglers,
    when fewer runs are left than workers, are left out)."""
    if len(timestamps) < 20:
        return math.nan
    xs = sorted(timestamps)
    a, b = pct(xs, lo * 100), pct(xs, hi * 100)
    if b <= a:
        return math.nan
    return (hi - lo) * len(xs) / (b - a)


def span_rate(started: float, timestamps: Sequence[float]) -> float:
    """Events per second from ``started`` (the first submit) to the last event: stragglers
    and stalls included."""
    if not timestamps or max(timestamps) <= started:
        return math.nan
    return len(timestamps) / (max(timestamps) - started)


def ratio(value: float, base: float) -> float:
    if base is None or value is None or not base or math.isnan(base) or math.isnan(value):
        return math.nan
    return value / base
