"""A device of a given size, simulated on CPU: live storages metered, out of memory raised.

`DeviceMeter` is a dispatch mode that follows every storage an op creates while it is active
until the storage dies (a finalizer on torch's preserved storage object: the moment the last
tensor, view or saved activation holding it goes), so it knows the bytes alive after every op and
their highest level. It does not read the library's plans or profiles: an independent meter for
whole training runs (a Trainer's steps, profiling included). With a `capacity` it raises
``torch.OutOfMemoryError`` (the class a GPU raises; the wording of torch's CPU allocator, which
accelerate's batch-size finder recognises, with the sizes CUDA's message gives) when
an op leaves more than that alive, and counts the event where `oom_count` reads it, as CUDA's
allocator counts its own: tests see what a GPU would do. ``inflate`` scales every new storage's
bytes (1.1: an allocator that rounds up 10 %; a plan that under-predicts).

Not seen: temporaries that live and die inside one kernel, and storages made before entry
(pass them as `baseline`, e.g. `runtime.peak.live_state_nbytes(model)`; if they are freed inside
the window the meter still counts them, so it never reads low).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .peak import plain_tensors

__all__ = ["DeviceMeter", "oom_count"]

_cpu_ooms = 0


def oom_count(device: torch.device) -> int:
    """Out-of-memory errors raised on `device` so far in this process (a host counter: CUDA's
    ``num_ooms`` statistic; on CPU those of `DeviceMeter`)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_stats(device).get("num_ooms", 0))
    return _cpu_ooms


class DeviceMeter(TorchDispatchMode):
    """Bytes alive on a simulated device: ``live_nbytes`` now, ``peak_nbytes`` since entry or the
    last ``reset_peak()``; past `capacity` an op raises ``torch.OutOfMemoryError``."""

    def __init__(
        self, capacity: int | None = None, baseline: int = 0, inflate: float = 1.0
    ) -> None:
        super().__init__()
        self.capacity = capacity
        self.inflate = inflate
        self.live_nbytes = baseline
        self.peak_nbytes = baseline
        self.ooms = 0
        self._held: dict[int, int] = {}  # id of a storage object -> bytes counted for it

    def reset_peak(self) -> int:
        """Start a new peak window at the bytes alive now; returns the last window's peak."""
        last, self.peak_nbytes = self.peak_nbytes, self.live_nbytes
        return last

    def _free(self, key: int) -> None:
        self.live_nbytes -= self._held.pop(key, 0)

    def _follow(self, out: Any, inputs: Any) -> int:
        """Count the storages of `out` not seen yet and not an input's (views, in-place results
        and ``out=`` of storages made before entry are not new); returns the bytes added."""
        added = 0
        old = {id(t.untyped_storage()) for x in tree_leaves(inputs) for t in plain_tensors(x)}
        for leaf in tree_leaves(out):
            for t in plain_tensors(leaf):
                if t.device.type == "meta":
                    continue
                s = t.untyped_storage()
                key = id(s)
                if key in self._held or key in old or not s.nbytes():
                    continue
                n = int(s.nbytes() * self.inflate)
                self._held[key] = n
                weakref.finalize(s, self._free, key)
                added += n
        self.live_nbytes += added
        return added

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        added = self._follow(out, (args, kwargs))
        if self.capacity is not None and self.live_nbytes > self.capacity:
            global _cpu_ooms
            self.ooms += 1
            _cpu_ooms += 1
            alive = self.live_nbytes - added
            del out  # the op's outputs die with the error, as a failed allocation leaves nothing
            raise torch.OutOfMemoryError(
                f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {added} bytes "
                f"({func}) on a simulated device of {self.capacity} bytes, of which "
                f"{max(self.capacity - alive, 0)} bytes free; {alive} bytes in use"
            )
        self.peak_nbytes = max(self.peak_nbytes, self.live_nbytes)
        return out
