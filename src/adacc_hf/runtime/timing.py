"""Timing on the device a model runs on: wall clock on CPU, CUDA events on GPUs.

What the profiler times (`work_clock`): on a CPU running one torch thread, that thread's CPU time,
so other jobs on a shared machine do not inflate one op's time and not another's; with more
threads, wall time (their barriers are part of the cost); on CUDA, synchronised wall time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch


def sync(device: torch.device | str) -> None:
    """Wait for `device`'s queued work (no-op off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def work_clock(device: torch.device | str) -> Callable[[], float]:
    """The clock (seconds) the profiler times `device`'s work with (see the module docstring)."""
    if torch.device(device).type != "cuda" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def time_call(
    fn: Callable[[], Any],
    device: torch.device | str,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median time of `fn()` in ms over `repeats` runs on `clock` (wall by default), synchronised
    on CUDA."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = clock()
        fn()
        sync(device)
        times.append((clock() - t0) * 1e3)
    return statistics.median(times)


def cpu_timer(
    func: Callable, args: tuple, kwargs: dict, clock: Callable[[], float] = time.perf_counter
) -> tuple[Any, float]:
    """Run `func` and return (output, elapsed ms on `clock`, wall by default)."""
    t0 = clock()
    out = func(*args, **kwargs)
    return out, (clock() - t0) * 1e3


def cuda_timer(func: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """Run `func` between two CUDA events; `elapsed_ms` reads them later (no sync here)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = func(*args, **kwargs)
    end.record()
    return out, (start, end)


def timer_for(device: torch.device) -> Callable:
    """The per-op timer the profiler uses on `device` (its `work_clock`)."""
    return cuda_timer if device.type == "cuda" else partial(cpu_timer, clock=work_clock(device))


def elapsed_ms(elapsed: Any) -> float:
    """Milliseconds of a `cpu_timer` / `cuda_timer` result (CUDA: after a sync)."""
    if isinstance(elapsed, tuple):
        return elapsed[0].elapsed_time(elapsed[1])
    return float(elapsed)
