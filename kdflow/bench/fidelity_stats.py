"""Noise margins for `kdflow bench fidelity`: paired differences over seeds, a t interval on them, and targets
that are met only when the interval lies on the right side of the bound.

The Student t distribution is written here (no scipy): for an integer number of degrees of freedom n its
two-sided probability P(|T| < t) has a closed form in theta = atan(t / sqrt(n)) (a finite sum of powers of
cos(theta)), and the quantile is found by bisection on it.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

CONFIDENCE = 0.95
MET, NOT_MET, NOT_RESOLVED = "met", "NOT met", "not resolved"


def t_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with `df` (>= 1, integer) degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), df - 3 powers at most
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        return 2.0 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term, total = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), df - 2 powers at most
    for k in range(1, df // 2):
        term *= cos2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_quantile(confidence: float, df: int) -> float:
    """t such that P(|T| < t) = confidence (0 < confidence < 1): the half-width multiplier of a t interval."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    low, high = 0.0, 1.0
    while t_two_sided(high, df) < confidence:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        low, high = (middle, high) if t_two_sided(middle, df) < confidence else (low, middle)
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2.0


def paired_interval(differences: list[float], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """The mean of paired differences (one per seed) and its t interval: mean +- t(conf, n - 1) sd / sqrt(n).
    With fewer than two differences there is no interval (low, high None)."""
    n = len(differences)
    record: dict[str, Any] = {"n": n, "mean": statistics.fmean(differences) if n else None, "confidence": confidence,
                              "sd": None, "half_width": None, "low": None, "high": None}
    if n >= 2:
        sd = statistics.stdev(differences)
        half = t_quantile(confidence, n - 1) * sd / math.sqrt(n)
        record |= {"sd": sd, "half_width": half, "low": record["mean"] - half, "high": record["mean"] + half}
    return record


def verdict(interval: dict[str, Any], *, at_most: float | None = None, at_least: float | None = None) -> str:
    """`met` when the whole interval satisfies the bound(s) (<= at_most, >= at_least), `NOT met` when the whole
    interval lies on the wrong side of one, else (it straddles a bound, or there is no interval) `not resolved`."""
    low, high = interval["low"], interval["high"]
    if low is None or high is None:
        return NOT_RESOLVED
    if (at_most is not None and low > at_most) or (at_least is not None and high < at_least):
        return NOT_MET
    if (at_most is None or high <= at_most) and (at_least is None or low >= at_least):
        return MET
    return NOT_RESOLVED


def paired(runs: list[dict[str, Any]], variant: str, reference: str, key: str, relative: bool = False) -> list[float]:
    """Per seed both ran: variant's `key` minus reference's (divided by reference's, `relative`), in seed order."""
    by_seed = {(r["variant"], r["seed"]): r for r in runs}
    out = []
    for seed in sorted({r["seed"] for r in runs}):
        mine, other = by_seed.get((variant, seed)), by_seed.get((reference, seed))
        if mine is not None and other is not None:
            delta = mine[key] - other[key]
            out.append(delta / other[key] if relative else delta)
    return out
