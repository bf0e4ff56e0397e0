"""Timing on the device a model runs on: wall clock on CPU, CUDA events on GPUs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device | str) -> None:
    """Wait for `device`'s queued work (no-op off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device | str, repeats: int) -> float:
    """Median wall time of `fn()` in ms over `repeats` runs, synchronised on CUDA."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cpu_timer(func: Callable, args: tuple, kwargs: dict) -> tuple[Any, float]:
    """Run `func` and return (output, elapsed ms)."""
    t0 = time.perf_counter()
    out = func(*args, **kwargs)
    return out, (time.perf_counter() - t0) * 1e3


def cuda_timer(func: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """Run `func` between two CUDA events; `elapsed_ms` reads them later (no sync here)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = func(*args, **kwargs)
    end.record()
    return out, (start, end)


def timer_for(device: torch.device) -> Callable:
    return cuda_timer if device.type == "cuda" else cpu_timer


def elapsed_ms(elapsed: Any) -> float:
    """Milliseconds of a `cpu_timer` / `cuda_timer` result (CUDA: after a sync)."""
    if isinstance(elapsed, tuple):
        return elapsed[0].elapsed_time(elapsed[1])
    return float(elapsed)
