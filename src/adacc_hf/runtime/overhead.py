"""The runtime's own cost: how much a checkpointed block's dispatch modes add to its forward."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from ..schema import GroupPolicy, Variant
from .checkpoint import BlockRuntime
from .modes import _BuildMode, _KeepMode, _Run
from .timing import modelled_clock, time_call

__all__ = ["dispatch_overhead_ms"]


def dispatch_overhead_ms(
    block: nn.Module, fn: Any, args: tuple, gp: GroupPolicy, device: Any, repeats: int = 5
) -> float:
    """Measured runtime overhead of one checkpointed block that keeps some op: the block's
    forward under the forward dispatch mode (on a built slot table that keeps nothing) minus the
    plain forward, interleaved pairs, median, doubled (recompute crosses the replay mode the same
    way). What the cost model adds per such block (`GroupProfile.dispatch_ms`).

    The overhead is Python work on the calling thread: on CPU it is timed with that thread's CPU
    clock (other processes on a shared machine do not inflate it); on CUDA with synchronised wall
    time (host overhead the device hides costs nothing there)."""
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
    modelled = modelled_clock()
    if modelled is not None:  # a modelled device: one deterministic run of each
        return max(0.0, 2.0 * (time_call(keep, device, 1) - time_call(plain, device, 1)))
    diffs = []
    for _ in range(max(5, repeats) | 1):
        if cuda:
            diffs.append(time_call(keep, device, 1) - time_call(plain, device, 1))
            continue
        t0 = time.thread_time()
        plain()
        t1 = time.thread_time()
        keep()
        diffs.append((time.thread_time() - t1 - (t1 - t0)) * 1e3)
    return max(0.0, 2.0 * statistics.median(diffs))
