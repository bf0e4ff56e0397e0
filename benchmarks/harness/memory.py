"""Memory a training step needs under a strategy, measured (never predicted).

* held: what a forward leaves for backward (`adacc_hf.measure_activation_memory`);
* peak: the highest bytes alive during a whole training step, optimizer step included
  (`adacc_hf.measure_step_peak`: the allocator's statistics on CUDA, the CPU allocator's events on
  a CPU), measured on a second step so optimizer states exist as in training.

`fits` says whether a measurement fits a budget: ``"peak"`` (step peak <= budget, no OOM) or
``"held"`` (static + held <= budget: ignores backward temporaries).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from adacc_hf import measure_activation_memory, measure_step_peak

from .prepared import Prepared


def step_memory(
    strategy: Prepared, batch: Mapping[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``held_nbytes`` and ``peak_nbytes`` of a step under `strategy` (``peak_nbytes`` None and
    ``oom`` True when it ran out of memory)."""
    model = strategy.model
    out: dict[str, Any] = {}
    try:
        with strategy:
            out["held_nbytes"] = measure_activation_memory(model, batch)
            measure_step_peak(model, batch, optimizer)  # optimizer states exist
            out["peak_nbytes"] = measure_step_peak(model, batch, optimizer).peak_nbytes
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


def oom_errors() -> tuple[type[BaseException], ...]:
    """The out-of-memory errors of this machine (none on a CPU: the budget is checked instead)."""
    return (torch.cuda.OutOfMemoryError,) if torch.cuda.is_available() else ()


def free_cached() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
