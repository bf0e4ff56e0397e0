"""Offload: what a checkpointed block keeps for backward, parked in host memory until then.

An op the policy offloads (``offload``, or ``offload:<codec>``: encoded first, its payload parked)
and a block input the policy offloads (``Variant.offload_input``: what the block's recompute starts
from, as transformers' ``offload=True`` moves) leave the device in forward and come back in
backward, one block ahead: when block j's backward starts, what block j parked is staged (it
normally is already) and what the offloading block before it parked starts coming back.

* CUDA: pinned host buffers from a pool reused across steps; copies each way on one side stream,
  ordered by events against the compute stream (the copy waits for the op, the op's consumer
  waits for the copy), never by a host wait; a device tensor the side stream reads or fills is
  marked with ``record_stream`` so the caching allocator does not reuse it early.
* CPU (and any device without a side stream): the same path with a stand-in host: buffers
  outside torch's allocator (numpy's), so a step meter sees exactly what a device would hold,
  copies made at once.

The pool holds at most ``cap_nbytes``; a tensor it cannot take stays on the device (a warning
names the cap). `HostStore.host_nbytes` is what the pool holds now; ``peak_host_nbytes`` the most.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

import numpy as np
import torch

from ..schema import OffloadLink
from .timing import modelled_device, sync, time_call, work_clock

logger = logging.getLogger("adacc_hf")

#: Default cap on the host memory offload may hold: this share of the host's available memory.
DEFAULT_HOST_SHARE = 0.5
_ALIGN = 512  # host buffers are handed out in multiples of this (fewer distinct sizes to reuse)


def host_available(total: int = 0) -> int:
    """Bytes of host memory available now (``MemAvailable``; `total` where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return total


def default_host_cap() -> int:
    """`DEFAULT_HOST_SHARE` of the host memory available now."""
    return int(DEFAULT_HOST_SHARE * host_available())


class HostPool:
    """Host buffers by size, reused: a freed buffer goes back to its size's free list."""

    def __init__(self, pinned: bool, cap_nbytes: int) -> None:
        self.pinned = pinned
        self.cap_nbytes = cap_nbytes
        self.held_nbytes = 0  # every buffer the pool made (free or in use)
        self.used_nbytes = 0
        self.peak_used_nbytes = 0
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor | None:
        size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        free = self._free.get(size)
        if free:
            buf = free.pop()
        else:
            if self.held_nbytes + size > self.cap_nbytes:
                self._trim(size)
                if self.held_nbytes + size > self.cap_nbytes:
                    return None
            if self.pinned:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            else:  # the stand-in host: memory torch's allocator (and a step meter) never sees
                buf = torch.from_numpy(np.empty(size, dtype=np.uint8))
            self.held_nbytes += size
        self.used_nbytes += size
        self.peak_used_nbytes = max(self.peak_used_nbytes, self.used_nbytes)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self.used_nbytes -= buf.numel()
        self._free.setdefault(buf.numel(), []).append(buf)

    def _trim(self, need: int) -> None:
        """Free buffers of other sizes until `need` more bytes fit under the cap."""
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            while bufs and self.held_nbytes + need > self.cap_nbytes:
                bufs.pop()
                self.held_nbytes -= size

    def clear(self) -> None:
        for size, bufs in self._free.items():
            self.held_nbytes -= size * len(bufs)
        self._free.clear()


class Parked:
    """One tensor in host memory: its buffer, how to rebuild it, and its staged device copy."""

    __slots__ = ("buf", "dense", "dtype", "event", "numel", "shape", "staged", "stride")

    def __init__(self, buf: torch.Tensor, t: torch.Tensor) -> None:
        self.buf = buf
        self.shape, self.stride, self.dtype = t.shape, t.stride(), t.dtype
        self.numel = t.numel()
        # its elements fill exactly `numel` slots in some order: the copies keep its strides
        self.dense = t.dim() > 0 and (t.is_contiguous() or _dense(t.shape, t.stride()))
        self.staged: torch.Tensor | None = None
        self.event: Any = None  # CUDA: the copy that filled `staged` (or emptied `t`)


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether the layout covers exactly ``numel`` slots, in any order of its dims."""
    expect = 1
    for size, st in sorted(zip(shape, stride, strict=True), key=lambda d: d[1]):
        if size > 1 and st != expect:
            return False
        expect *= size
    return True


class Frame:
    """What one checkpointed block forward parked, in order."""

    __slots__ = ("__weakref__", "backward", "items", "store")

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self.items: list[Parked] = []
        self.backward = False

    def __del__(self) -> None:  # a graph dropped without its backward: give the buffers back
        for p in self.items:
            if p.buf is not None:
                self.store.pool.give(p.buf)
                p.buf = None


class HostStore:
    """Parks tensors of checkpointed blocks in host memory and brings them back one block ahead
    (see the module docstring). One per patched model."""

    def __init__(
        self, device: torch.device | str, cap_nbytes: int | None = None, prefetch: bool = True
    ) -> None:
        self.device = torch.device(device)
        self.prefetch = prefetch  # False: each tensor comes back only when it is used
        cuda = self.device.type == "cuda"
        self.pool = HostPool(cuda, default_host_cap() if cap_nbytes is None else int(cap_nbytes))
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._frames: list[weakref.ref[Frame]] = []  # forward order
        self.refused = 0  # tensors the cap kept on the device

    @property
    def host_nbytes(self) -> int:
        return self.pool.used_nbytes

    @property
    def peak_host_nbytes(self) -> int:
        return self.pool.peak_used_nbytes

    def frame(self) -> Frame:
        """A new block forward's frame (the one after every frame opened before it)."""
        f = Frame(self)
        self._frames = [r for r in self._frames if r() is not None]
        self._frames.append(weakref.ref(f))
        return f

    def park(self, frame: Frame, t: torch.Tensor) -> Parked | torch.Tensor:
        """`t` copied to host memory (the device copy is the caller's to drop); `t` itself where
        the cap has no room for it."""
        nbytes = t.numel() * t.element_size()
        buf = self.pool.take(nbytes)
        if buf is None:
            self.refused += 1
            if self.refused == 1:
                logger.warning(
                    "adacc: offload's host memory cap (%d bytes) is full; tensors that do not fit "
                    "stay on the device (raise offload_host_cap, or plan with the smaller cap)",
                    self.pool.cap_nbytes,
                )
            return t
        p = Parked(buf, t)
        host = self._view(p)
        if self.stream is None:
            host.copy_(t)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # its memory is not reused before the copy is done
        frame.items.append(p)
        return p

    def _view(self, p: Parked) -> torch.Tensor:
        flat = p.buf[: p.numel * p.dtype.itemsize].view(p.dtype)
        return flat.as_strided(p.shape, p.stride) if p.dense else flat.view(p.shape)

    def _stage(self, p: Parked) -> None:
        if p.staged is not None or p.buf is None:
            return
        host = self._view(p)
        if p.dense:
            dev = torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=self.device)
        else:
            dev = torch.empty(p.shape, dtype=p.dtype, device=self.device)
        if self.stream is None:
            dev.copy_(host)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # dev is free to fill
            with torch.cuda.stream(self.stream):
                dev.copy_(host, non_blocking=True)
                p.event = torch.cuda.Event()
                p.event.record(self.stream)
            dev.record_stream(self.stream)
        p.staged = dev

    def begin_backward(self, frame: Frame) -> None:
        """Block `frame`'s backward starts: stage what it parked (if the block after it did not
        already) and start bringing back what the offloading block before it parked."""
        if frame.backward:
            return
        frame.backward = True
        for p in frame.items:
            self._stage(p)
        live = [f for r in self._frames if (f := r()) is not None]
        if frame in live and self.prefetch:
            i = live.index(frame)
            prev = next((f for f in reversed(live[:i]) if f.items and not f.backward), None)
            if prev is not None:
                for p in prev.items:
                    self._stage(p)
            self._frames = [weakref.ref(f) for f in live if f is not frame]

    def discard(self, frame: Frame, p: Parked) -> None:
        """Give a parked tensor up (its entry was dropped): its buffer back, nothing staged."""
        if p.buf is not None:
            self.pool.give(p.buf)
        p.buf = p.staged = p.event = None
        if p in frame.items:
            frame.items.remove(p)

    def fetch(self, frame: Frame, p: Parked | torch.Tensor) -> torch.Tensor:
        """The parked tensor back on the device (its host buffer freed for reuse)."""
        if isinstance(p, torch.Tensor):  # the cap kept it on the device
            return p
        self.begin_backward(frame)
        self._stage(p)
        dev = p.staged
        if p.event is not None:
            torch.cuda.current_stream(self.device).wait_event(p.event)
        self.pool.give(p.buf)
        p.buf = p.staged = p.event = None
        return dev


def park_tree(store: HostStore, frame: Frame, value: Any) -> Any:
    """`value` (a tensor, an `Encoded`, or a list / tuple of them) with every tensor parked."""
    from ..codecs import Encoded

    if isinstance(value, torch.Tensor):
        return store.park(frame, value)
    if isinstance(value, Encoded):
        value.tensors = {k: store.park(frame, t) for k, t in value.tensors.items()}
        value.meta = {
            k: store.park(frame, v) if torch.is_tensor(v) else v for k, v in value.meta.items()
        }
        return value
    return value


def fetch_tree(store: HostStore, frame: Frame, value: Any, discard: bool = False) -> Any:
    """`park_tree` undone: every parked tensor back on the device (`discard`: given up instead,
    its host buffer freed, nothing staged)."""
    from ..codecs import Encoded

    def back(p: Any) -> Any:
        if not isinstance(p, Parked):
            return p
        return store.discard(frame, p) if discard else store.fetch(frame, p)

    if isinstance(value, Encoded):
        value.tensors = {k: back(t) for k, t in value.tensors.items()}
        value.meta = {k: back(v) for k, v in value.meta.items()}
        return value
    return back(value)


#: Bytes `measure_link` copies each way (large enough to run at the link's bandwidth).
LINK_PROBE_NBYTES = 64 * 2**20


def measure_link(
    device: torch.device | str,
    host_cap_nbytes: int = 0,
    nbytes: int = LINK_PROBE_NBYTES,
    repeats: int = 5,
) -> OffloadLink:
    """The link `HostStore` copies cross on `device`, measured: median times of `nbytes` copied
    each way between a device tensor and a host buffer of the pool's kind (pinned on CUDA, on a
    side stream; the stand-in's off CUDA, in line), and of a tiny copy (each copy's launch).
    On a modelled device (`timing.modelled`), the link its table measured."""
    device = torch.device(device)
    modelled = modelled_device()
    if modelled is not None:
        return modelled.link(int(host_cap_nbytes))
    store = HostStore(device, cap_nbytes=2 * nbytes + 2 * _ALIGN)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = store.pool.take(nbytes)
    tiny_dev = torch.empty(_ALIGN, dtype=torch.uint8, device=device)
    tiny_host = store.pool.take(_ALIGN)
    assert host is not None and tiny_host is not None
    stream = store.stream

    def copy(dst: torch.Tensor, src: torch.Tensor) -> Any:
        if stream is None:
            return lambda: dst.copy_(src)

        def run() -> None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()

        return run

    clock = time.perf_counter if device.type == "cuda" else work_clock(device)
    sync(device)
    out = time_call(copy(host[:nbytes], dev), device, repeats, clock)
    back = time_call(copy(dev, host[:nbytes]), device, repeats, clock)
    launch = time_call(copy(tiny_host[:_ALIGN], tiny_dev), device, repeats, clock)
    return OffloadLink(
        d2h_gbps=nbytes / max(out, 1e-6) / 1e6,
        h2d_gbps=nbytes / max(back, 1e-6) / 1e6,
        overlap=stream is not None,
        launch_ms=launch,
        host_cap_nbytes=int(host_cap_nbytes),
    )
