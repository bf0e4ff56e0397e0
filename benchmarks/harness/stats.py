"""What a throughput row's step times say, with how sure it is: paired per round, bootstrapped.

A shared CPU's speed drifts by +-20 % from step to step, so two strategies' medians differ by
more than their real difference; within one round of `steps.time_interleaved` they ran seconds
apart. So each comparison is made round by round (the median of a strategy's steps in a round,
against another's in the same round) and its uncertainty is a bootstrap over rounds. A claim is
``holds`` when its whole interval satisfies it, ``fails`` when none of it does, else
``undecided`` (more rounds, or a quieter machine, would tell).

- ``ratio_vs_best_fitting``: an Adacc strategy's tokens/s over the best baseline that fits the
  budget (`vs_best_fitting`), and per round with its interval; claim: >= `MIN_RATIO`.
- ``measured_added_ms``: a strategy's step time over no checkpointing's, and per round with its
  interval; ``predicted_over_measured_added``: the cost model's added time over it; claim: within
  `ADDED_TOLERANCE` (no verdict for a plan predicted to add nothing: ``none predicted``). On a
  CPU the rounds pair process CPU times (``cpu_ms_all``), the clock the profiler timed the
  prediction with (`adacc_hf.runtime.timing.work_clock`); on a GPU, wall times.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from .strategies import lookup

#: issue 12's bars: Adacc's tokens/s against the best fitting baseline; predicted added time.
MIN_RATIO = 0.98
ADDED_TOLERANCE = 0.15
LEVEL = 0.9  # two-sided bootstrap interval


def per_round(step_ms: Sequence[float], steps: int) -> list[float]:
    """The median step of each round (`steps` timed steps per round, in order)."""
    return [statistics.median(step_ms[i : i + steps]) for i in range(0, len(step_ms), steps)]


def bootstrap(
    xs: Sequence[float], stat: Callable[[Sequence[float]], float] = statistics.median
) -> tuple[float, float]:
    """`LEVEL` bootstrap interval of ``stat(xs)`` (2000 resamples, fixed seed)."""
    if len(xs) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(0)
    draws = sorted(stat(rng.choices(xs, k=len(xs))) for _ in range(2000))
    cut = int((1 - LEVEL) / 2 * len(draws))
    return (draws[cut], draws[-cut - 1])


def verdict(lo: float, hi: float, low: float, high: float = float("inf")) -> str:
    """``holds`` when [lo, hi] lies within [low, high], ``fails`` when it lies wholly outside,
    else (or without an interval) ``undecided``."""
    if lo != lo or hi != hi:  # NaN: fewer than two rounds
        return "undecided"
    if low <= lo and hi <= high:
        return "holds"
    if hi < low or lo > high:
        return "fails"
    return "undecided"


def vs_best_fitting(rows: dict[str, Any], steps: int) -> None:
    """Each Adacc strategy's tokens/s over the best baseline (a strategy not solved per budget)
    that fits the budget, from the same run: ``ratio_vs_best_fitting`` (medians), which baseline,
    and the ratio round by round: its median, interval and verdict against `MIN_RATIO`."""
    fitting = {
        n: r["tokens_per_s"]
        for n, r in rows.items()
        if not lookup(n).budgeted and r.get("fits") and r.get("tokens_per_s", 0) > 0
    }
    if not fitting:
        return
    best = max(fitting, key=fitting.__getitem__)
    base = per_round(rows[best]["step_ms_all"], steps)
    for n, r in rows.items():
        if not lookup(n).budgeted or "tokens_per_s" not in r:
            continue
        r["best_fitting_baseline"] = best
        r["ratio_vs_best_fitting"] = r["tokens_per_s"] / fitting[best]
        mine = per_round(r["step_ms_all"], steps)
        paired = [b / m for b, m in zip(base, mine, strict=False)]
        if paired:
            lo, hi = bootstrap(paired)
            r["paired_ratio_vs_best_fitting"] = statistics.median(paired)
            r["paired_ratio_interval"] = [lo, hi]
            r["ratio_verdict"] = verdict(lo, hi, MIN_RATIO)


def added_times(rows: dict[str, Any], steps: int, base: str = "none") -> None:
    """Each strategy's measured added time per step over no checkpointing (``base``, from the
    same interleaved run; CPU: also in process CPU time) beside the cost model's prediction; the
    paired per-round added time with its interval (process CPU time where measured, as the
    profile's), and the prediction's verdict against it."""
    ref = rows.get(base, {})
    clock = "cpu_ms_all" if "cpu_ms_all" in ref else "step_ms_all"
    ref_rounds = per_round(ref.get(clock, []), steps)
    for name, r in rows.items():
        for key, out in (
            ("step_ms_median", "measured_added_ms"),
            ("cpu_ms_median", "cpu_added_ms"),
            ("cpu_ms_min", "cpu_added_ms_min"),  # noise from other jobs only slows
        ):
            if key in r and key in ref:
                r[out] = r[key] - ref[key]
        pred, meas = r.get("predicted_added_ms"), r.get("cpu_added_ms", r.get("measured_added_ms"))
        if pred is not None and meas:
            r["predicted_over_measured_added"] = pred / meas
        if name == base or pred is None or not ref_rounds:
            continue
        mine = per_round(r.get(clock, []), steps)
        paired = [m - b for m, b in zip(mine, ref_rounds, strict=False)]
        if not paired:
            continue
        lo, hi = bootstrap(paired)
        r["paired_added_ms"] = statistics.median(paired)
        r["paired_added_interval"] = [lo, hi]
        if pred <= 0:  # a plan that checkpoints nothing: its ratio to no checkpointing tells
            r["added_verdict"] = "none predicted"
        elif lo > 0:  # pred / measured over the interval: [pred / hi, pred / lo]
            r["added_verdict"] = verdict(
                pred / hi, pred / lo, 1 - ADDED_TOLERANCE, 1 + ADDED_TOLERANCE
            )
        else:  # no checkpointing's own noise: a ratio to it says nothing
            r["added_verdict"] = "undecided"
