"""Timing on the device a model runs on: wall clock on CPU, CUDA events on GPUs, or a modelled
device's clock.

What the profiler times (`work_clock`): on a CPU running one torch thread, that thread's CPU time,
so other jobs on a shared machine do not inflate one op's time and not another's; with more
threads, wall time (their barriers are part of the cost); on CUDA, synchronised wall time.

Inside `modelled` (a dry run of `devices.dryrun`: a device this machine does not have, priced
from its table), every clock here is the modelled one: the time at which the work issued so far
has finished on that device. One run suffices (it is deterministic), and `modelled_device` gives
the table's codec and host-link figures to the profiler.

Added times (`added_work_ms`): what a recompute, a codec, an offload's copies or the runtime's
dispatch modes add to a step is measured as a difference of two timings (the work with it and
without), and on a loaded machine either can be the more disturbed one. The work itself takes no
negative time, so every such difference goes through `added_work_ms` (never below 0), estimated
from paired rounds (`paired_added_ms`) or the least-disturbed runs (`least_added_ms`): the one
place the rule lives, for the profiler's figures and the cost model's sums alike.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

_modelled: list[tuple[Callable[[], float], Any, Callable[[], None], Callable[[], float]]] = []


@contextlib.contextmanager
def modelled(
    clock: Callable[[], float],
    device: Any = None,
    synchronize: Callable[[], None] = lambda: None,
    queue: Callable[[], float] | None = None,
) -> Iterator[None]:
    """Inside, every timing here reads `clock` (modelled seconds) and `sync` calls
    `synchronize` (the host waits for the modelled device); `device` (a
    `devices.roofline.Roofline`) answers `modelled_device`; `queue` is the modelled seconds at
    which the device has run what was issued so far, the host aside (default: `clock`)."""
    _modelled.append((clock, device, synchronize, queue or clock))
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


#: How the profiler times a block's step (`steady_ms`), recorded in every GPU check's results:
#: runs recorded without it timed one synchronised run alone (`synchronised`).
BLOCK_TIMING = "steady"
_synchronised: list[bool] = []


@contextlib.contextmanager
def synchronised(on: bool = True) -> Iterator[None]:
    """Inside (where `on`), `steady_ms` times one synchronised run, as the profiler did before it
    timed blocks among blocks: how a committed GPU run's plan is made again as its code made it
    (`devices.calibrate.Run.synchronised_blocks`)."""
    _synchronised.append(on)
    try:
        yield
    finally:
        _synchronised.pop()


def steady_ms(fn: Callable[[], Any], device: torch.device | str) -> float:
    """`fn()`'s time in ms as a step runs it, among more of the same work: on a GPU (and a
    modelled one) the host issues ops ahead of the device, so its own cost is hidden wherever
    the device is busier; a lone synchronised run would show the queue draining empty and the
    device waiting for the host at its start. So `fn` runs twice back to back and the second
    run is timed on the device's queue, from the first run's end to its own (CUDA events; a
    modelled device's `queue`): the device's busy time plus any wait for a host that falls
    behind. Elsewhere (a CPU runs ops as they are issued, and inside `synchronised`) one run on
    `work_clock`, synchronised."""
    lone = bool(_synchronised) and _synchronised[-1]
    if lone or (not _modelled and torch.device(device).type != "cuda"):
        return time_call(fn, device, 1, work_clock(device))
    if _modelled:
        queue = _modelled[-1][3]
        sync(device)
        fn()
        start = queue()
        fn()
        end = queue()
        sync(device)
        return (end - start) * 1e3
    first, second = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    fn()
    first.record()
    fn()
    second.record()
    torch.cuda.synchronize(device)
    return first.elapsed_time(second)


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


def added_work_ms(ms: float) -> float:
    """`ms`, an estimate of the time some work adds (a recompute, an encode + decode, an
    offload's copies, the dispatch modes' Python, a chunked head's rerun logits), bounded below
    by 0. Such an estimate is a difference of two noisy timings, the work run and not run; work
    takes no negative time, so a negative difference is noise (the run with the work was the
    less disturbed one), never a saving a plan could bank. NaN (nothing measured) is 0 too."""
    return ms if ms > 0.0 else 0.0


def paired_added_ms(more: Sequence[float], less: Sequence[float]) -> float:
    """What the work timed in `more` adds over `less` (ms), from rounds timed interleaved (the
    i-th of each in the same round): the median of the rounds' differences (a machine whose
    speed drifts, a shared CPU, a boosting clock, shifts both alike, and one disturbed round
    of a few moves no median), never below 0 (`added_work_ms`)."""
    diffs = [a - b for a, b in zip(more, less, strict=True)]
    return added_work_ms(statistics.median(diffs)) if diffs else 0.0


def least_added_ms(more: Sequence[float], less: Sequence[float]) -> float:
    """What the work timed in `more` adds over `less` (ms), from each side's least-disturbed
    run: their minima's difference, never below 0 (`added_work_ms`). For a small overhead on a
    larger base timed on the calling thread: noise there (another job taking the core, an
    OpenMP barrier the thread spins at while a worker waits for a core) only ever adds time,
    so each minimum tends to the undisturbed time as runs accumulate, where a median of paired
    differences still carries one side's disturbance."""
    if not more or not less:
        return 0.0
    return added_work_ms(min(more) - min(less))


#: The least of some runs is their undisturbed time once `FLOOR_RUNS` of them come within
#: `FLOOR_AGREEMENT` of it (`floor_met`): undisturbed runs of a block differ by 10-30 % on a
#: loaded 2-core machine, disturbed ones by milliseconds.
FLOOR_RUNS = 3
FLOOR_AGREEMENT = 0.25


def floor_met(runs: Sequence[float]) -> bool:
    """Whether the least of `runs` is met again: `FLOOR_RUNS` of them lie within
    `FLOOR_AGREEMENT` of it. A disturbance adds some time at random, so runs that agree at the
    bottom are undisturbed ones; a lone least run may still be disturbed (with 70 % of runs
    disturbed, all 7 runs of one kind are one time in 12)."""
    if len(runs) < FLOOR_RUNS:
        return False
    least = sorted(runs)[:FLOOR_RUNS]
    return least[-1] <= least[0] + FLOOR_AGREEMENT * abs(least[0])
