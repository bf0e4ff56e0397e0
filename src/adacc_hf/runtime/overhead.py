"""The runtime's own cost: how much a checkpointed block's dispatch modes add to its forward."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from ..schema import GroupPolicy, Variant
from .checkpoint import BlockRuntime
from .modes import _BuildMode, _KeepMode, _Run
from .timing import added_work_ms, floor_met, least_added_ms, modelled_clock, steady_ms

__all__ = ["dispatch_overhead_ms"]


#: Runs of the plain and the dispatched forward each, at least (their minima:
#: `timing.least_added_ms`)...
MIN_RUNS = 7
#: ... and up to this many times as many until each kind's least run is met again
#: (`timing.floor_met`) and the minima tell the two apart: the modes run Python for every op of
#: the block, never free, so a difference of 0 is a run too few (a busy 2-core machine disturbs
#: most runs of a block of a millisecond).
MAX_RUNS_FACTOR = 4


def dispatch_overhead_ms(
    block: nn.Module, fn: Any, args: tuple, gp: GroupPolicy, device: Any, repeats: int = 5
) -> float:
    """Measured runtime overhead of one checkpointed block that keeps some op: the block's
    forward under the forward dispatch mode (on a built slot table that keeps nothing) over the
    plain forward, doubled (recompute crosses the replay mode the same way). What the cost model
    adds per such block (`GroupProfile.dispatch_ms`).

    The overhead is Python work on the calling thread: on CPU it is timed with that thread's CPU
    clock (other processes on a shared machine do not run on it); on CUDA (and a modelled
    device) on the device's queue among blocks run back to back (`timing.steady_ms`: host
    overhead the device hides behind the block before costs nothing there). The CPU clock still
    counts the OpenMP barriers the thread spins at while a worker waits for a busy core (a tiny llama's
    plain forward of 0.6 ms measured up to 37 ms so, on a loaded machine), so the two forwards
    run in alternating order, at least `MIN_RUNS` times each (`repeats` if more), and the
    estimate is their least-disturbed runs' difference (`timing.least_added_ms`; never below 0),
    taking more runs, up to `MAX_RUNS_FACTOR` times as many, until three runs of each agree at its
    least (`timing.floor_met`) and the difference is above 0."""
    rt = BlockRuntime(block, "profile", "", gp, Variant(1, True, {}), set())
    build = _Run(rt, None)
    with _BuildMode(build):
        fn(*args)
    table = build.built

    def keep() -> None:
        with _KeepMode(_Run(rt, table)):
            fn(*args)

    def plain() -> None:
        fn(*args)

    cuda = torch.device(device).type == "cuda"
    if modelled_clock() is not None:  # a modelled device: one deterministic run of each
        return 2.0 * added_work_ms(steady_ms(keep, device) - steady_ms(plain, device))

    def ms(f: Any) -> float:
        if cuda:
            return steady_ms(f, device)
        t0 = time.thread_time()
        f()
        return (time.thread_time() - t0) * 1e3

    runs = max(MIN_RUNS, repeats)
    times: dict[Any, list[float]] = {plain: [], keep: []}
    for i in range(runs * MAX_RUNS_FACTOR):
        for f in (plain, keep) if i % 2 == 0 else (keep, plain):
            times[f].append(ms(f))
        settled = all(floor_met(t) for t in times.values())
        if i + 1 >= runs and settled and least_added_ms(times[keep], times[plain]) > 0:
            break
    return 2.0 * least_added_ms(times[keep], times[plain])
