"""Timing on the device a model runs on: wall clock on CPU, CUDA events on GPUs, or a modelled
device's clock.

What the profiler times (`work_clock`): on a CPU running one torch thread, that thread's CPU time,
so other jobs on a shared machine do not inflate one op's time and not another's; with more
threads, wall time (their barriers are part of the cost); on CUDA, synchronised wall time.

Inside `modelled` (a dry run of `devices.dryrun`: a device this machine does not have, priced
from its table), every clock here is the modelled one: the time at which the work issued so far
has finished on that device. One run suffices (it is deterministic), and `modelled_device` gives
the table's codec and host-link figures to the profiler.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

_modelled: list[tuple[Callable[[], float], Any, Callable[[], None]]] = []


@contextlib.contextmanager
def modelled(
    clock: Callable[[], float], device: Any = None, synchronize: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Inside, every timing here reads `clock` (modelled seconds) and `sync` calls
    `synchronize` (the host waits for the modelled device); `device` (a
    `devices.roofline.Roofline`) answers `modelled_device`."""
    _modelled.append((clock, device, synchronize))
    try:
        yield
    finally:
        _modelled.pop()


def modelled_device() -> Any:
    """The modelled device's pricing while `modelled` is on (None: real timing)."""
    return _modelled[-1][1] if _modelled else None


def modelled_clock() -> Callable[[], float] | None:
    return _modelled[-1][0] if _modelled else None


def sync(device: torch.device | str) -> None:
    """Wait for `device`'s queued work (no-op off CUDA; a modelled device's host waits)."""
    if _modelled:
        _modelled[-1][2]()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def work_clock(device: torch.device | str) -> Callable[[], float]:
    """The clock (seconds) the profiler times `device`'s work with (see the module docstring)."""
    if _modelled:
        return _modelled[-1][0]
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
    on CUDA; modelled (`modelled`): one run on the modelled clock."""
    if _modelled:
        clock, repeats = _modelled[-1][0], 1
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
    if device.type == "cuda" and not _modelled:
        return cuda_timer
    return partial(cpu_timer, clock=work_clock(device))


def elapsed_ms(elapsed: Any) -> float:
    """Milliseconds of a `cpu_timer` / `cuda_timer` result (CUDA: after a sync)."""
    if isinstance(elapsed, tuple):
        return elapsed[0].elapsed_time(elapsed[1])
    return float(elapsed)
