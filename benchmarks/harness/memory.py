"""Memory a training step needs under a strategy, measured (never predicted).

* held: what a forward leaves for backward (`adacc_hf.measure_activation_memory`);
* peak on a GPU: ``torch.cuda.max_memory_allocated`` over a whole step
  (`adacc_hf.peak_step_memory`), after one warm step so optimizer states exist;
* peak on a CPU, where there is no allocator peak to read: parameters and optimizer states (the
  static estimate less gradients) plus the highest sum of live storages that forward + backward
  create, gradients included, checked after every aten op (`cpu_step_peak_nbytes`; kernel
  workspaces are not seen).

`fits` says whether a measurement fits a budget: ``"peak"`` (step peak <= budget, no OOM) or
``"held"`` (static + held <= budget: ignores backward temporaries).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from adacc_hf import measure_activation_memory, peak_step_memory
from adacc_hf.runtime.ops import is_keyed, tensor_outputs

from .prepared import Prepared
from .steps import loss_of, train_step


def oom_errors() -> tuple[type[BaseException], ...]:
    """The out-of-memory errors of this machine (none on a CPU: the budget is checked instead)."""
    return (torch.cuda.OutOfMemoryError,) if torch.cuda.is_available() else ()


def free_cached() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _LivePeak(TorchDispatchMode):
    """Highest sum of live storages created by aten ops, checked after every op."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]
        if is_keyed(func):
            for t in tensor_outputs(out):
                s = t.untyped_storage()
                key = s.data_ptr()
                if s.nbytes() and key not in self.live:
                    self.live[key] = (StorageWeakRef(s), s.nbytes())
                    self.current += s.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def cpu_step_peak_nbytes(model: nn.Module, batch: Mapping[str, Any]) -> int:
    """Peak bytes of the storages a forward + backward creates (gradients included: they start
    as None, as after ``zero_grad(set_to_none=True)``). Works on any device: the CPU stand-in for
    ``torch.cuda.max_memory_allocated`` minus parameters and optimizer states."""
    model.zero_grad(set_to_none=True)
    tracker = _LivePeak()
    with tracker:
        loss = loss_of(model(**batch))
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return tracker.peak


def step_memory(
    strategy: Prepared,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    *,
    static_nbytes: int,
    grads_nbytes: int,
) -> dict[str, Any]:
    """``held_nbytes`` and ``peak_nbytes`` of a step under `strategy` (``peak_nbytes`` None and
    ``oom`` True when it ran out of memory). `grads_nbytes` is the part of `static_nbytes` the CPU
    peak measures itself (gradients appear during backward)."""
    model = strategy.model
    out: dict[str, Any] = {}
    try:
        with strategy:
            out["held_nbytes"] = measure_activation_memory(model, batch)
            if next(model.parameters()).device.type == "cuda":
                train_step(model, batch, optimizer, strategy)  # optimizer states exist
                out["peak_nbytes"] = peak_step_memory(model, batch, optimizer)
            else:
                dyn = cpu_step_peak_nbytes(model, batch)
                out["peak_nbytes"] = static_nbytes - grads_nbytes + dyn
    except oom_errors():
        out.update(peak_nbytes=None, oom=True)
        optimizer.zero_grad(set_to_none=True)
        free_cached()
    return out


def fits(mem: Mapping[str, Any], budget: int, static_nbytes: int, rule: str = "peak") -> bool:
    if mem.get("oom") or mem.get("peak_nbytes") is None:
        return False
    if rule == "held":
        return static_nbytes + mem["held_nbytes"] <= budget
    return mem["peak_nbytes"] <= budget
