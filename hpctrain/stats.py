"""Interval arithmetic of the toolkit's comparisons (``hpctrain report``, the benchmarks):
Student t intervals of a mean, the MLPerf trimmed mean, Fieller intervals of a ratio of two
independent means with Welch's degrees of freedom, and the geometric mean of paired ratios
with a t interval on their logarithms (benchmarks that run the two cases back to back, where
one pair's machine state is shared by both runs). A leaf module, so that the benchmarks
and the experiments' report both use it.

Every interval is two-sided at ``LEVEL`` (95%). A group of one run has no interval (its
variance is unknown); the report says so instead of printing a made-up width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["LEVEL", "MEAN_METHOD", "RATIO_METHOD", "Interval", "t_quantile", "mean_interval",
           "trimmed_mean", "ratio_interval", "PAIRED_METHOD", "paired_ratio_interval", "verdict"]

LEVEL = 0.95
MEAN_METHOD = "Student t interval of the mean"
RATIO_METHOD = "Fieller interval of the ratio of means, Welch-Satterthwaite degrees of freedom"
PAIRED_METHOD = "geometric mean of paired ratios, Student t interval of their logarithms"


@dataclass(frozen=True)
class Interval:
    """An estimate with its two-sided ``LEVEL`` interval (``lo``/``hi`` None: not defined,
    e.g. one run, or a ratio whose denominator may be zero)."""

    estimate: float
    lo: float | None
    hi: float | None
    n: int
    df: float | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def t_quantile(df: float, level: float = LEVEL) -> float:
    """Two-sided Student t critical value: ``t_{(1+level)/2, df}``. SciPy is imported
    here, not with the module: the benchmarks import this module, and their training runs
    would carry SciPy's 46 MiB for a quantile they never take."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + level / 2, df))


def _mean_var(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else float("nan")
    return mean, var


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of ``values`` and its Student t interval ``mean +- t * s / sqrt(n)``."""
    if not values:
        raise ValueError("mean_interval of no values")
    n = len(values)
    mean, var = _mean_var(values)
    if n < 2:
        return Interval(mean, None, None, n)
    half = t_quantile(n - 1, level) * math.sqrt(var / n)
    return Interval(mean, mean - half, mean + half, n, float(n - 1))


def trimmed_mean(values: Sequence[float]) -> float | None:
    """MLPerf's rule: the mean without the fastest and the slowest run (needs 3 runs)."""
    if len(values) < 3:
        return None
    kept = sorted(values)[1:-1]
    return math.fsum(kept) / len(kept)


def ratio_interval(values: Sequence[float], baseline: Sequence[float],
                   level: float = LEVEL) -> Interval:
    """``mean(values) / mean(baseline)`` for independent samples and its Fieller interval:
    the ratios R with ``(ma - R mb)^2 <= q^2 (va + R^2 vb)``, ``va = s_a^2 / n_a``, where q is
    the t quantile at Welch-Satterthwaite's degrees of freedom of ``ma - R mb`` at the point
    estimate. No interval when a side has one run, or when the baseline mean is not
    significantly different from zero (the set is then unbounded)."""
    ma, sa = _mean_var(values)
    mb, sb = _mean_var(baseline)
    ratio = ma / mb if mb else float("nan")
    n = min(len(values), len(baseline))
    if len(values) < 2 or len(baseline) < 2 or not mb:
        return Interval(ratio, None, None, n)
    va, vb = sa / len(values), sb / len(baseline)
    spread = (va ** 2 / (len(values) - 1) + ratio ** 4 * vb ** 2 / (len(baseline) - 1))
    df = (va + ratio ** 2 * vb) ** 2 / spread if spread > 0 else math.inf
    q = t_quantile(df, level)
    a = mb ** 2 - q ** 2 * vb
    if a <= 0:
        return Interval(ratio, None, None, n, df)
    root = q * math.sqrt(max(ma ** 2 * vb + mb ** 2 * va - q ** 2 * va * vb, 0.0))
    lo, hi = sorted(((ma * mb - root) / a, (ma * mb + root) / a))
    return Interval(ratio, lo, hi, n, df)


def paired_ratio_interval(values: Sequence[float], baseline: Sequence[float],
                          level: float = LEVEL) -> Interval:
    """The geometric mean of ``values[i] / baseline[i]`` and its interval: a Student t
    interval of the mean log ratio, exponentiated. Pairing takes out what a pair's two runs
    share (a machine that is slow for a minute slows both), which independent samples
    (:func:`ratio_interval`) leave in the spread. No interval for one pair."""
    if len(values) != len(baseline) or not values:
        raise ValueError(f"paired_ratio_interval needs pairs, got {len(values)} values and "
                         f"{len(baseline)} baselines")
    logs = mean_interval([math.log(v / b) for v, b in zip(values, baseline, strict=True)],
                         level)
    if logs.lo is None or logs.hi is None:
        return Interval(math.exp(logs.estimate), None, None, logs.n)
    return Interval(math.exp(logs.estimate), math.exp(logs.lo), math.exp(logs.hi), logs.n,
                    logs.df)


def verdict(ratio: Interval, lower: str, higher: str) -> str:
    """``lower`` when the whole interval lies below 1, ``higher`` above 1, else no
    significant difference (or no interval)."""
    if ratio.lo is None or ratio.hi is None:
        return "no interval"
    if ratio.hi < 1.0:
        return lower
    if ratio.lo > 1.0:
        return higher
    return f"no significant difference at {LEVEL:.0%}"
