"""The largest micro-batch that fits: doubling from 1, then bisection.

`largest(ok, cap)` assumes `ok` is monotone (a batch that fits means every smaller one fits) and
calls it O(log cap) times; callers memoise `ok` (each call is a measured step).
"""

from __future__ import annotations

from collections.abc import Callable


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
