"""Allocation sequences for the caching-allocator model (`caching_allocator`): a step's, recorded
on this CPU, or a CUDA run's, read from a memory snapshot it dumped.

An event is ``(action, id, size, stream)``: ``"alloc"`` of `size` bytes (what the allocator was
asked for: a storage's nbytes) or ``"free"`` of the allocation `id`, in order.

A CUDA snapshot (``torch.cuda.memory._snapshot()``, pickled by ``_dump_snapshot``; ``.gz``
read too) holds ``segments`` (the allocator's state when it was taken) and ``device_traces``
(one list per device of ``{"action", "addr", "size", "stream", "time_us", "frames"}``; actions
``alloc`` / ``free_requested`` / ``free_completed`` (sizes: the bytes requested),
``segment_alloc`` / ``segment_free`` / ``segment_map`` / ``segment_unmap`` (sizes: segment or
page bytes), ``oom`` (``device_free`` instead of ``addr``), ``snapshot``), from
``THCPModule_memorySnapshot`` and ``record_trace`` in torch's sources. For a trace that covers a
whole step, record history from the process's first CUDA allocation with enough ``max_entries``:
what was alive before the trace began is only approximated (`Snapshot.complete` says so).
"""

from __future__ import annotations

import gzip
import itertools
import os
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Event",
    "Snapshot",
    "StepAllocations",
    "allocation_events",
    "load_snapshot",
    "profiler_allocations",
    "record_allocations",
    "snapshot_events",
]

Event = tuple[str, int, int, int]  # (action, id, size, stream)

_RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass
class StepAllocations:
    """A recorded step's allocation events.

    Storages alive before the recording and freed inside it are allocated first in `events`
    (a device holds them when the step starts); `prior_nbytes` is their bytes, so the step's own
    requested peak is the replay's minus `prior_nbytes`.
    """

    events: list[Event]
    prior_nbytes: int = 0


def profiler_allocations(results: Any, device_type: str = "cpu") -> list[tuple[int, int, int]]:
    """The allocator events of a finished ``torch.profiler`` run (``profile_memory=True``).

    Args:
        results: ``prof.profiler.kineto_results``.
        device_type: the allocator's device (``"cpu"``).

    Returns:
        ``(time ns, address, bytes)`` (negative bytes: a free) in time order, a free first among
        events of the same nanosecond, as ``runtime.peak.AllocationTracker`` replays them.
    """
    from ..runtime.peak import memory_events

    allocs, _ = memory_events(results, lambda d: d.type == device_type)
    return [(t, ptr, n) for t, ptr, n, _ in allocs]


def allocation_events(allocs: Iterable[tuple[int, int, int]]) -> StepAllocations:
    """Turn ``(time, address, bytes)`` allocator events into alloc / free events.

    Args:
        allocs: in order; a free whose address was never allocated here frees a storage from
            before the recording, which is then allocated first (`StepAllocations`).
    """
    live: dict[int, int] = {}
    prior: list[Event] = []
    events: list[Event] = []
    for _, ptr, n in allocs:
        if n > 0:
            live[ptr] = len(prior) + len(events)
            events.append(("alloc", live[ptr], n, 0))
        elif n < 0:
            key = live.pop(ptr, None)
            if key is None:
                key = len(prior) + len(events)
                prior.append(("alloc", key, -n, 0))
            events.append(("free", key, -n, 0))
    return StepAllocations(prior + events, sum(e[2] for e in prior))


def record_allocations(fn: Callable[[], object]) -> StepAllocations:
    """Run `fn` on the CPU under ``torch.profiler`` and return the allocations it made.

    Sizes are the storages' bytes, what a CUDA run asks its allocator for; every CPU allocation
    counts (a CUDA step would make small host ones too: scalars, indices kept on the host). The
    profiler never reports the free of a storage allocated before any profiling session (torch's
    CPUAllocator.cpp warns so): run one step under it first when earlier storages die in `fn`.

    Args:
        fn: the step (e.g. forward, loss and backward); its result is dropped.
    """
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # as runtime.peak: no start / stop logs
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return allocation_events(profiler_allocations(prof.profiler.kineto_results))


@dataclass
class Snapshot:
    """What a CUDA memory snapshot says about one device."""

    events: list[Event]  # allocations (sizes requested) and their frees, in trace order
    reserved_peak: int  # the highest reserved bytes over the trace, measured
    reserved_start: int  # reserved when the trace began (0: the trace saw every segment)
    expandable: bool
    options: dict[str, int]  # CachingAllocatorModel keywords the run's settings imply
    complete: bool  # the trace began with nothing reserved and saw every allocation


def load_snapshot(source: str | Path | Mapping[str, Any], device: int = 0) -> Snapshot:
    """Read a snapshot (a dict, or a pickle file, gzip-compressed when it ends in ``.gz``).

    Args:
        source: the ``_snapshot()`` dict or a ``_dump_snapshot`` file.
        device: which device's trace and segments.
    """
    if not isinstance(source, Mapping):
        opener = gzip.open if str(source).endswith(".gz") else open
        with opener(source, "rb") as f:
            source = pickle.load(f)
    return snapshot_events(source, device)


def snapshot_events(snap: Mapping[str, Any], device: int = 0) -> Snapshot:
    """The allocation events and measured reserved peak of one device's trace.

    Reserved bytes at the end are the segments' total (for expandable segments: their mapped
    ranges); walking the trace's segment_alloc / free / map / unmap back from there gives the
    bytes reserved when it began and the peak. Frees are taken at ``free_completed`` (when the
    allocator can reuse the block; ``free_requested`` if the trace skipped those). Blocks alive
    before the trace (a free without an alloc, or allocated in ``segments`` but never allocated
    in the trace) are allocated first, in address order.

    Args:
        snap: the ``_snapshot()`` dict.
        device: which device.
    """
    trace = list(snap.get("device_traces", [[]] * (device + 1))[device])
    segments = [s for s in snap.get("segments", []) if s.get("device", device) == device]
    end_reserved = sum(int(s["total_size"]) for s in segments)
    delta = [_RESERVE.get(e["action"], 0) * int(e.get("size", 0)) for e in trace]
    reserved = start = end_reserved - sum(delta)
    peak = reserved
    for d in delta:
        reserved += d
        peak = max(peak, reserved)

    free_action = (
        "free_completed"
        if any(e["action"] == "free_completed" for e in trace)
        else "free_requested"
    )
    live: dict[int, int] = {}
    prior: dict[int, tuple[int, int]] = {}  # address -> (id, size), alive before the trace
    events: list[Event] = []
    ids = itertools.count()
    for e in trace:
        if e["action"] == "alloc":
            live[int(e["addr"])] = next(ids)
            events.append(("alloc", live[int(e["addr"])], int(e["size"]), int(e["stream"])))
        elif e["action"] == free_action:
            key = live.pop(int(e["addr"]), None)
            if key is None:
                key = next(ids)
                prior[int(e["addr"])] = (key, int(e["size"]))
            events.append(("free", key, int(e["size"]), int(e["stream"])))
    for s in segments:  # allocated at the end, never allocated in the trace
        for b in s.get("blocks", []):
            if b.get("state") == "active_allocated" and int(b["address"]) not in live:
                prior[int(b["address"])] = (next(ids), int(b["requested_size"]))
    streams = {int(s["address"]): int(s.get("stream", 0)) for s in segments}
    first = [("alloc", k, n, streams.get(a, 0)) for a, (k, n) in sorted(prior.items())]

    settings = snap.get("allocator_settings", {})
    expandable = bool(
        settings.get("expandable_segments")
        or any(s.get("is_expandable") for s in segments)
        or any(e["action"] in ("segment_map", "segment_unmap") for e in trace)
    )
    options: dict[str, int] = {}
    split = int(settings.get("max_split_size", -1))
    if 0 < split < 2**63:
        options["max_split_size"] = split
    conf = str(settings.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    for item in conf.replace(" ", "").split(","):
        if item.startswith("large_segment_size_mb:"):
            options["large_segment_size"] = int(item.split(":")[1]) * 2**20
    return Snapshot(first + events, peak, start, expandable, options, not prior and start == 0)
