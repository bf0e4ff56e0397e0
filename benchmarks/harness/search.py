"""The largest that fits: doubling from 1, then bisection.

`largest(ok, cap)` assumes `ok` is monotone (a value that fits means every smaller one fits) and
calls it O(log cap) times; callers memoise `ok` (each call is a measured step). It finds the
largest micro-batch, and (`resolve_searched`) the ``every_n_layers`` a user would tune to.
"""

from __future__ import annotations

from collections.abc import Callable

from .strategies import COMPILE_FRACTIONS, SEARCHED


def largest(ok: Callable[[int], bool], cap: int) -> int:
    """Largest b in [1, cap] with ok(b); 0 if none."""
    if not ok(1):
        return 0
    lo, hi = 1, None
    while lo < cap:
        b = min(2 * lo, cap)
        if ok(b):
            lo = b
        else:
            hi = b
            break
    if hi is None:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def resolve_searched(name: str, fits: Callable[[str], bool], layers: int) -> str:
    """A `strategies.SEARCHED` name as the concrete strategy a user tuning the knob would pick,
    `fits(strategy)` saying whether its measured step peak fits the budget: for
    ``every_n_layers``, the largest ``k <= layers`` that fits (the peak grows with ``k``), else
    the fallback (``hf_full`` / ``hf_offload``); for ``compile_budget``, the first of
    `strategies.COMPILE_FRACTIONS` that fits (the partitioner's peak is not monotone), else the
    last."""
    prefix, fallback = SEARCHED[name]
    if name == "compile_budget":
        return next(
            (f"{prefix}{f:g}" for f in COMPILE_FRACTIONS if fits(f"{prefix}{f:g}")), fallback
        )
    k = largest(lambda k: k == 1 or fits(f"{prefix}{k}"), layers)  # k = 1: the fallback
    return fallback if k < 2 else f"{prefix}{k}"
