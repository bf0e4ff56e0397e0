"""Where and how a benchmark runs: device, dtype, threads, the results' file tag, the time limit,
and the header every results JSON starts with (command, device, threads, load, versions).

CPU runs are single-threaded by default: on a shared 2-core machine two OpenMP threads stall at
every op's barrier whenever another job holds a core. They also keep freed memory in the process
(`cache_freed_memory`), as CUDA's caching allocator does.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time
from typing import Any

import torch

from adacc_hf.runtime.timing import BLOCK_TIMING


def device_name(device: str | torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_tag(device: str | torch.device) -> str:
    """A file-name tag for the device: ``cpu``, or the GPU's name (``nvidia-h100-80gb-hbm3``)."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device))
        return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return "cpu"


def default_dtype(device: torch.device, name: str | None = None) -> torch.dtype:
    """`name` (``"bfloat16"``) if given; else bfloat16 on CUDA, float32 elsewhere."""
    if name:
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def set_threads(device: torch.device, threads: int | None) -> None:
    """`threads` torch threads; one on a CPU unless told otherwise."""
    if device.type != "cuda":
        torch.set_num_threads(threads or 1)
    elif threads:
        torch.set_num_threads(threads)


#: glibc's mallopt parameters (malloc.h): release freed heap top above this many bytes; at most
#: this many chunks served by mmap.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_TRIM_ABOVE = 2**31 - 1  # mallopt takes a C int: 2 GiB, beyond any CPU suite's heap


def cache_freed_memory(device: torch.device, enabled: bool = True) -> str:
    """On a CPU with glibc: serve every allocation from the heap and never give freed memory back
    (``M_MMAP_MAX=0``; ``M_TRIM_THRESHOLD`` 2 GiB), as CUDA's caching allocator keeps its blocks.
    Returns how the run's CPU allocator behaves, for the results header.

    Otherwise a step pays a page fault (~1.8 us on this VM) per 4 KiB the allocator gets anew
    from the OS, and how much that is depends on what earlier steps freed: on a 4-block LLaMA at
    batch 4 (the CPU suite's llama-cpu) the no-checkpointing step faulted 39.7k and 37.3k times
    and full recomputation's 24.6k and 40.8k times in two processes, shrinking the ~90 ms
    between them that the cost model predicts by 27 ms in one and growing it by 6 ms in the
    other. With the memory kept: no faults once the heap has settled (within the warm-up steps).
    The process keeps its largest heap (``max_rss_mib`` in the results); memory figures are
    unaffected (they track live storages, not the heap)."""
    if device.type == "cuda":
        return "CUDA caching allocator"
    if not enabled:
        return "system default"
    if platform.libc_ver()[0] != "glibc":
        return f"system default ({platform.libc_ver()[0] or 'not glibc'}: not configurable here)"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)):
        return "system default (mallopt refused)"
    return "glibc, freed memory kept (M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB)"


def command_line(argv: list[str] | None) -> str:
    """The command that ran (`argv`: what `main` was given, None: the real command line)."""
    return "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])


def header(suite: str, argv: list[str] | None, device: str | torch.device) -> dict[str, Any]:
    """What every results JSON of a training benchmark starts with."""
    import transformers

    return {
        "suite": suite,
        "command": command_line(argv),
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        # how the profiler timed a block (`runtime.timing.BLOCK_TIMING`): a committed run's plan
        # is made again so (`harness.device_runs`)
        "block_timing": BLOCK_TIMING,
        "load_average_at_start": os.getloadavg(),  # other jobs on the machine (1, 5, 15 min)
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }


class Deadline:
    """Seconds since start, and whether `limit` seconds (None: no limit) have passed."""

    def __init__(self, limit: float | None) -> None:
        self.limit = limit
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def passed(self) -> bool:
        return self.limit is not None and self.elapsed() > self.limit

    def __str__(self) -> str:
        return f"{self.elapsed():.0f} s"
